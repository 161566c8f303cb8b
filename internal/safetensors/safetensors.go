// Package safetensors reads and writes the header of the safetensors format:
// an 8-byte little-endian length N, N bytes of JSON naming each tensor's
// dtype, shape and byte range, then the data.
//
// Read checks a header completely before anyone allocates memory for the
// file: the length within the format's limit and the file, a JSON object
// and nothing after it, a known dtype for every tensor, a byte range inside
// the data and exactly as long as the shape needs, no name twice and no two
// tensors overlapping. Gaps between tensors are allowed (the safetensors
// library writes none, but other writers do).
package safetensors

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/bits"
	"slices"
	"sort"
	"strconv"
	"unicode/utf8"
)

// MaxHeader is the safetensors library's own limit on the JSON header; a
// larger length field means a corrupt or hostile file.
const MaxHeader = 100_000_000

// Bits is the element width of every dtype the format defines. F4 and F6
// pack elements below a byte.
var Bits = map[string]uint64{
	"BOOL": 8, "U8": 8, "I8": 8,
	"F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
	"I16": 16, "U16": 16, "F16": 16, "BF16": 16,
	"I32": 32, "U32": 32, "F32": 32,
	"I64": 64, "U64": 64, "F64": 64, "C64": 64,
	"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}

// Tensor is one entry of a header.
type Tensor struct {
	Name       string
	Dtype      string
	Shape      []uint64
	Begin, End uint64 // data_offsets: the byte range, relative to the data's start
}

// Header is a checked header.
type Header struct {
	// Len is N, the JSON's length: the data starts at 8+N.
	Len uint64
	// Tensors are in the order the header lists them.
	Tensors []Tensor
	// Metadata is the "__metadata__" object, or nil.
	Metadata map[string]string
}

// DataStart is where the data begins in the file: 8+N.
func (h *Header) DataStart() int64 { return 8 + int64(h.Len) }

// Read checks the header of a safetensors file of size bytes read through r.
func Read(r io.ReaderAt, size int64) (*Header, error) {
	var lb [8]byte
	if size < 8 {
		return nil, fmt.Errorf("%d bytes is shorter than the 8-byte header length", size)
	}
	if _, err := r.ReadAt(lb[:], 0); err != nil {
		return nil, err
	}
	n := binary.LittleEndian.Uint64(lb[:])
	if n > MaxHeader {
		return nil, fmt.Errorf("header length %d exceeds the safetensors limit of %d bytes", n, MaxHeader)
	}
	if n > uint64(size-8) {
		return nil, fmt.Errorf("header length %d runs past the end of the %d-byte file", n, size)
	}
	hdr := make([]byte, n)
	if _, err := r.ReadAt(hdr, 8); err != nil {
		return nil, err
	}
	h := &Header{Len: n}
	if err := h.parse(hdr, uint64(size)-8-n); err != nil {
		return nil, err
	}
	return h, nil
}

func (h *Header) parse(hdr []byte, data uint64) error {
	if !utf8.Valid(hdr) || len(bytes.TrimLeft(hdr, " \t\r\n")) == 0 || bytes.TrimLeft(hdr, " \t\r\n")[0] != '{' {
		return errors.New("header is not a UTF-8 JSON object")
	}
	seen := map[string]bool{}
	d := json.NewDecoder(bytes.NewReader(hdr))
	if _, err := d.Token(); err != nil {
		return fmt.Errorf("header: %w", jsonErr(err))
	}
	for d.More() {
		tok, err := d.Token()
		if err != nil {
			return fmt.Errorf("header: %w", jsonErr(err))
		}
		name := tok.(string) // object keys are always strings
		if seen[name] {
			return fmt.Errorf("header names %q twice", name)
		}
		seen[name] = true
		if name == "__metadata__" {
			if err := d.Decode(&h.Metadata); err != nil {
				return fmt.Errorf("__metadata__ must map strings to strings: %w", jsonErr(err))
			}
			continue
		}
		var t struct {
			Dtype       string   `json:"dtype"`
			Shape       []uint64 `json:"shape"`
			DataOffsets []uint64 `json:"data_offsets"`
		}
		if err := d.Decode(&t); err != nil {
			return fmt.Errorf("tensor %q: %w", name, jsonErr(err))
		}
		width, ok := Bits[t.Dtype]
		if !ok {
			return fmt.Errorf("tensor %q: unknown dtype %q", name, t.Dtype)
		}
		if t.Shape == nil || len(t.DataOffsets) != 2 {
			return fmt.Errorf("tensor %q: needs a shape and data_offsets [begin, end]", name)
		}
		nbits, over := width, false
		for _, dim := range t.Shape {
			hi, lo := bits.Mul64(nbits, dim)
			over = over || hi != 0
			nbits = lo
		}
		if over || nbits%8 != 0 {
			return fmt.Errorf("tensor %q: shape %v of %s is not a whole number of bytes that fits in 64 bits", name, t.Shape, t.Dtype)
		}
		b, e := t.DataOffsets[0], t.DataOffsets[1]
		if b > e || e > data {
			return fmt.Errorf("tensor %q: data_offsets [%d, %d] are outside the %d data bytes", name, b, e, data)
		}
		if e-b != nbits/8 {
			return fmt.Errorf("tensor %q: data_offsets [%d, %d] hold %d bytes, but %s%v needs %d", name, b, e, e-b, t.Dtype, t.Shape, nbits/8)
		}
		h.Tensors = append(h.Tensors, Tensor{Name: name, Dtype: t.Dtype, Shape: t.Shape, Begin: b, End: e})
	}
	if _, err := d.Token(); err != nil {
		return fmt.Errorf("header: %w", jsonErr(err))
	}
	if _, err := d.Token(); err != io.EOF {
		return errors.New("header has data after its JSON object")
	}
	// Empty tensors occupy no bytes and can overlap nothing.
	spans := slices.DeleteFunc(slices.Clone(h.Tensors), func(t Tensor) bool { return t.Begin == t.End })
	sort.Slice(spans, func(i, j int) bool { return spans[i].Begin < spans[j].Begin })
	for i := 1; i < len(spans); i++ {
		if spans[i].Begin < spans[i-1].End {
			return fmt.Errorf("tensors %q and %q overlap", spans[i-1].Name, spans[i].Name)
		}
	}
	return nil
}

// jsonErr names the truncation a decoder reports as a bare EOF.
func jsonErr(err error) error {
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return errors.New("the JSON ends early")
	}
	return err
}

// Encode lays out a header for tensors (in their order, offsets as given)
// and metadata (keys sorted), padded with spaces so that the data starts at
// a multiple of align bytes from the start of the file. It returns the
// 8-byte length and the JSON.
func Encode(tensors []Tensor, metadata map[string]string, align int) []byte {
	b := make([]byte, 8, 8+64*len(tensors)+64)
	b = append(b, '{')
	first := true
	sep := func() {
		if !first {
			b = append(b, ',')
		}
		first = false
	}
	if len(metadata) > 0 {
		sep()
		b = append(b, `"__metadata__":{`...)
		keys := make([]string, 0, len(metadata))
		for k := range metadata {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for i, k := range keys {
			if i > 0 {
				b = append(b, ',')
			}
			b = appendString(b, k)
			b = append(b, ':')
			b = appendString(b, metadata[k])
		}
		b = append(b, '}')
	}
	for _, t := range tensors {
		sep()
		b = appendString(b, t.Name)
		b = append(b, `:{"dtype":`...)
		b = appendString(b, t.Dtype)
		b = append(b, `,"shape":[`...)
		for i, d := range t.Shape {
			if i > 0 {
				b = append(b, ',')
			}
			b = strconv.AppendUint(b, d, 10)
		}
		b = append(b, `],"data_offsets":[`...)
		b = strconv.AppendUint(b, t.Begin, 10)
		b = append(b, ',')
		b = strconv.AppendUint(b, t.End, 10)
		b = append(b, "]}"...)
	}
	b = append(b, '}')
	if align > 1 {
		for len(b)%align != 0 {
			b = append(b, ' ')
		}
	}
	binary.LittleEndian.PutUint64(b, uint64(len(b)-8))
	return b
}

func appendString(b []byte, s string) []byte {
	q, _ := json.Marshal(s) // a string always marshals
	return append(b, q...)
}
