package testutil

import (
	"math/rand/v2"
	"os"
	"testing"

	"github.com/gpushm/gpushm/internal/safetensors"
)

// Tensor is a tensor WriteShard writes.
type Tensor struct {
	Name  string
	Dtype string
	Shape []uint64
}

// Bytes is the tensor's size.
func (t Tensor) Bytes() int {
	n := int(safetensors.Bits[t.Dtype])
	for _, d := range t.Shape {
		n *= int(d)
	}
	return n / 8
}

// WriteShard writes a safetensors file as the safetensors library lays one
// out (tensors back to back in the order given, the header padded to 8
// bytes), filled with bytes that depend on each tensor's name, and returns
// them by name.
func WriteShard(t testing.TB, path string, meta map[string]string, ts ...Tensor) map[string][]byte {
	t.Helper()
	var st []safetensors.Tensor
	var data []byte
	out := map[string][]byte{}
	for _, x := range ts {
		b := make([]byte, x.Bytes())
		seed := [32]byte{}
		copy(seed[:], x.Name)
		rand.NewChaCha8(seed).Read(b)
		st = append(st, safetensors.Tensor{Name: x.Name, Dtype: x.Dtype, Shape: x.Shape, Begin: uint64(len(data)), End: uint64(len(data) + len(b))})
		data = append(data, b...)
		out[x.Name] = b
	}
	if err := os.WriteFile(path, append(safetensors.Encode(st, meta, 8), data...), 0o644); err != nil {
		t.Fatal(err)
	}
	return out
}

// NewTensor is a tensor of dtype and shape (none: a scalar).
func NewTensor(name, dtype string, shape ...uint64) Tensor {
	if shape == nil {
		shape = []uint64{} // "shape":[], as the safetensors library writes a scalar's
	}
	return Tensor{Name: name, Dtype: dtype, Shape: shape}
}
