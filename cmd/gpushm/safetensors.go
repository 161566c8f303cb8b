package main

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/bits"
	"os"
	"slices"
	"sort"
	"strings"
	"unicode/utf8"
)

// maxSafetensorsHeader is the safetensors library's own limit on the JSON
// header; a larger length field means a corrupt or hostile file.
const maxSafetensorsHeader = 100_000_000

// safetensorsBits is the element width of every dtype the safetensors format
// defines. F4 and F6 pack elements below a byte.
var safetensorsBits = map[string]uint64{
	"BOOL": 8, "U8": 8, "I8": 8,
	"F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
	"I16": 16, "U16": 16, "F16": 16, "BF16": 16,
	"I32": 32, "U32": 32, "F32": 32,
	"I64": 64, "U64": 64, "F64": 64, "C64": 64,
	"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}

// bundleMeta is the segment meta of a safetensors bundle; docs/python.md
// gives the schema, which the Python client reads.
type bundleMeta struct {
	Kind        string `json:"kind"`   // "bundle"
	Format      string `json:"format"` // "safetensors"
	HeaderBytes uint64 `json:"header_bytes"`
	Tensors     int    `json:"tensors"`
}

// safetensorsMeta recognizes a safetensors file, which needs no conversion to
// become a bundle segment: the format is the segment layout. It returns the
// meta to create the segment with and ok=true; ok=false with no error when
// the file is not safetensors. A file named *.safetensors must be valid; any
// other file counts as safetensors only if it validates completely, so that
// an arbitrary binary is never refused for looking a little like one. The
// file offset is left alone.
func safetensorsMeta(f *os.File, size int64) (json.RawMessage, bool, error) {
	named := strings.HasSuffix(strings.ToLower(f.Name()), ".safetensors")
	if !named {
		// Cheap sniff before reading up to 100 MB of a header: the JSON
		// object must start right after the length.
		var b [9]byte
		if _, err := f.ReadAt(b[:], 0); err != nil || b[8] != '{' {
			return nil, false, nil
		}
	}
	n, count, err := checkSafetensors(f, size)
	if err != nil {
		if named {
			return nil, false, fmt.Errorf("%s is not a valid safetensors file: %w", f.Name(), err)
		}
		return nil, false, nil
	}
	meta, err := json.Marshal(bundleMeta{Kind: "bundle", Format: "safetensors", HeaderBytes: n, Tensors: count})
	return meta, true, err
}

// checkSafetensors validates the header of a safetensors file of size bytes
// and returns the header's length and the number of tensors. Every tensor
// must have a known dtype, a byte range matching its shape, and lie inside
// the data without overlapping another; gaps are allowed.
func checkSafetensors(r io.ReaderAt, size int64) (uint64, int, error) {
	var lb [8]byte
	if size < 8 {
		return 0, 0, fmt.Errorf("%d bytes is shorter than the 8-byte header length", size)
	}
	if _, err := r.ReadAt(lb[:], 0); err != nil {
		return 0, 0, err
	}
	n := binary.LittleEndian.Uint64(lb[:])
	if n > maxSafetensorsHeader {
		return 0, 0, fmt.Errorf("header length %d exceeds the safetensors limit of %d bytes", n, maxSafetensorsHeader)
	}
	if n > uint64(size-8) {
		return 0, 0, fmt.Errorf("header length %d runs past the end of the %d-byte file", n, size)
	}
	hdr := make([]byte, n)
	if _, err := r.ReadAt(hdr, 8); err != nil {
		return 0, 0, err
	}
	if !utf8.Valid(hdr) || len(bytes.TrimLeft(hdr, " \t\r\n")) == 0 || bytes.TrimLeft(hdr, " \t\r\n")[0] != '{' {
		return 0, 0, errors.New("header is not a UTF-8 JSON object")
	}
	type span struct {
		name       string
		begin, end uint64
	}
	var spans []span
	data := uint64(size) - 8 - n
	seen := map[string]bool{}
	d := json.NewDecoder(bytes.NewReader(hdr))
	if _, err := d.Token(); err != nil {
		return 0, 0, fmt.Errorf("header: %w", jsonErr(err))
	}
	for d.More() {
		tok, err := d.Token()
		if err != nil {
			return 0, 0, fmt.Errorf("header: %w", jsonErr(err))
		}
		name := tok.(string) // object keys are always strings
		if seen[name] {
			return 0, 0, fmt.Errorf("header names %q twice", name)
		}
		seen[name] = true
		if name == "__metadata__" {
			var m map[string]string
			if err := d.Decode(&m); err != nil {
				return 0, 0, fmt.Errorf("__metadata__ must map strings to strings: %w", jsonErr(err))
			}
			continue
		}
		var t struct {
			Dtype       string   `json:"dtype"`
			Shape       []uint64 `json:"shape"`
			DataOffsets []uint64 `json:"data_offsets"`
		}
		if err := d.Decode(&t); err != nil {
			return 0, 0, fmt.Errorf("tensor %q: %w", name, jsonErr(err))
		}
		width, ok := safetensorsBits[t.Dtype]
		if !ok {
			return 0, 0, fmt.Errorf("tensor %q: unknown dtype %q", name, t.Dtype)
		}
		if t.Shape == nil || len(t.DataOffsets) != 2 {
			return 0, 0, fmt.Errorf("tensor %q: needs a shape and data_offsets [begin, end]", name)
		}
		nbits, over := width, false
		for _, dim := range t.Shape {
			hi, lo := bits.Mul64(nbits, dim)
			over = over || hi != 0
			nbits = lo
		}
		if over || nbits%8 != 0 {
			return 0, 0, fmt.Errorf("tensor %q: shape %v of %s is not a whole number of bytes that fits in 64 bits", name, t.Shape, t.Dtype)
		}
		b, e := t.DataOffsets[0], t.DataOffsets[1]
		if b > e || e > data {
			return 0, 0, fmt.Errorf("tensor %q: data_offsets [%d, %d] are outside the %d data bytes", name, b, e, data)
		}
		if e-b != nbits/8 {
			return 0, 0, fmt.Errorf("tensor %q: data_offsets [%d, %d] hold %d bytes, but %s%v needs %d", name, b, e, e-b, t.Dtype, t.Shape, nbits/8)
		}
		spans = append(spans, span{name, b, e})
	}
	if _, err := d.Token(); err != nil {
		return 0, 0, fmt.Errorf("header: %w", jsonErr(err))
	}
	if _, err := d.Token(); err != io.EOF {
		return 0, 0, errors.New("header has data after its JSON object")
	}
	count := len(spans)
	// Empty tensors occupy no bytes and can overlap nothing.
	spans = slices.DeleteFunc(spans, func(s span) bool { return s.begin == s.end })
	sort.Slice(spans, func(i, j int) bool { return spans[i].begin < spans[j].begin })
	for i := 1; i < len(spans); i++ {
		if spans[i].begin < spans[i-1].end {
			return 0, 0, fmt.Errorf("tensors %q and %q overlap", spans[i-1].name, spans[i].name)
		}
	}
	return n, count, nil
}

// jsonErr names the truncation a decoder reports as a bare EOF.
func jsonErr(err error) error {
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return errors.New("the JSON ends early")
	}
	return err
}
