package safetensors

import (
	"bytes"
	"encoding/binary"
	"reflect"
	"strings"
	"testing"
)

// file lays out header JSON and data as a safetensors file.
func file(header string, data []byte) []byte {
	b := binary.LittleEndian.AppendUint64(nil, uint64(len(header)))
	return append(append(b, header...), data...)
}

const goodHeader = `{"__metadata__":{"format":"pt"},"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},"b":{"dtype":"BF16","shape":[3],"data_offsets":[16,22]},"e":{"dtype":"F4","shape":[0],"data_offsets":[22,22]}}   `

func TestRead(t *testing.T) {
	tests := []struct {
		name    string
		content []byte
		wantErr string // "" for no error
	}{
		{"valid", file(goodHeader, make([]byte, 22)), ""},
		{"gap between tensors is fine", file(`{"a":{"dtype":"U8","shape":[1],"data_offsets":[4,5]}}`, make([]byte, 8)), ""},
		{"packed F4", file(`{"a":{"dtype":"F4","shape":[4],"data_offsets":[0,2]}}`, make([]byte, 2)), ""},
		{"too short", []byte{1, 2}, "shorter than the 8-byte header length"},
		{"header too large", binary.LittleEndian.AppendUint64(nil, 200_000_000), "exceeds the safetensors limit"},
		{"header past end", binary.LittleEndian.AppendUint64(nil, 100), "runs past the end"},
		{"not JSON", file(`{"a":`, nil), "the JSON ends early"},
		{"not an object", file(`[1,2]`, nil), "not a UTF-8 JSON object"},
		{"not UTF-8", file("{\"\xff\":1}", nil), "not a UTF-8 JSON object"},
		{"unknown dtype", file(`{"a":{"dtype":"F128","shape":[1],"data_offsets":[0,16]}}`, make([]byte, 16)), `unknown dtype "F128"`},
		{"offsets outside data", file(`{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}`, make([]byte, 8)), "outside the 8 data bytes"},
		{"size mismatch", file(`{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}}`, make([]byte, 16)), "F32[3] needs 12"},
		{"overlap", file(`{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}}`, make([]byte, 6)), "overlap"},
		{"duplicate name", file(`{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}`, make([]byte, 1)), `names "a" twice`},
		{"metadata not strings", file(`{"__metadata__":{"n":1}}`, nil), "__metadata__ must map strings to strings"},
		{"negative offset", file(`{"a":{"dtype":"U8","shape":[1],"data_offsets":[-1,0]}}`, make([]byte, 1)), `tensor "a"`},
		{"no shape", file(`{"a":{"dtype":"U8","data_offsets":[0,1]}}`, make([]byte, 1)), "needs a shape"},
		{"shape overflow", file(`{"a":{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,0]}}`, nil), "fits in 64 bits"},
		{"trailing data", file(`{} {}`, nil), "data after its JSON object"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h, err := Read(bytes.NewReader(tc.content), int64(len(tc.content)))
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("Read = %+v, %v; want error mentioning %q", h, err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("Read: %v", err)
			}
		})
	}
}

func TestReadGivesTheHeader(t *testing.T) {
	b := file(goodHeader, make([]byte, 22))
	h, err := Read(bytes.NewReader(b), int64(len(b)))
	if err != nil {
		t.Fatal(err)
	}
	want := &Header{
		Len: uint64(len(goodHeader)),
		Tensors: []Tensor{
			{"w", "F32", []uint64{2, 2}, 0, 16},
			{"b", "BF16", []uint64{3}, 16, 22},
			{"e", "F4", []uint64{0}, 22, 22},
		},
		Metadata: map[string]string{"format": "pt"},
	}
	if !reflect.DeepEqual(h, want) {
		t.Fatalf("Read = %+v, want %+v", h, want)
	}
	if h.DataStart() != int64(8+len(goodHeader)) {
		t.Fatalf("DataStart = %d", h.DataStart())
	}
}

func TestEncodeRoundTrip(t *testing.T) {
	tensors := []Tensor{
		{`odd "name" <&>`, "BF16", []uint64{3, 5}, 0, 30},
		{"scalar", "F64", []uint64{}, 32, 40},
		{"empty", "I8", []uint64{0, 7}, 40, 40},
	}
	meta := map[string]string{"b": "2", "a": "1"}
	for _, align := range []int{0, 8, 64} {
		prefix := Encode(tensors, meta, align)
		if align > 1 && len(prefix)%align != 0 {
			t.Errorf("align %d: data starts at %d", align, len(prefix))
		}
		b := append(prefix, make([]byte, 40)...)
		h, err := Read(bytes.NewReader(b), int64(len(b)))
		if err != nil {
			t.Fatalf("align %d: Read(Encode) = %v\n%s", align, err, prefix[8:])
		}
		if !reflect.DeepEqual(h.Tensors, tensors) || !reflect.DeepEqual(h.Metadata, meta) {
			t.Errorf("align %d: Read(Encode) = %+v, %v", align, h.Tensors, h.Metadata)
		}
	}
	if got := string(Encode(nil, nil, 0)[8:]); got != "{}" {
		t.Errorf("Encode(nothing) = %q", got)
	}
}
