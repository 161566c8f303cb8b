package main

import (
	"encoding/binary"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// safetensorsFile lays out header JSON and data as a safetensors file.
func safetensorsFile(header string, data []byte) []byte {
	b := binary.LittleEndian.AppendUint64(nil, uint64(len(header)))
	return append(append(b, header...), data...)
}

const goodHeader = `{"__metadata__":{"format":"pt"},"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},"b":{"dtype":"BF16","shape":[3],"data_offsets":[16,22]},"e":{"dtype":"F4","shape":[0],"data_offsets":[22,22]}}   `

func TestSafetensorsMeta(t *testing.T) {
	dir := t.TempDir()
	tests := []struct {
		name    string
		file    string // name in dir
		content []byte
		wantOK  bool
		wantErr string // "" for no error
	}{
		{"valid", "m.safetensors", safetensorsFile(goodHeader, make([]byte, 22)), true, ""},
		{"valid without extension, by content", "m.bin", safetensorsFile(goodHeader, make([]byte, 22)), true, ""},
		{"gap between tensors is fine", "gap.safetensors", safetensorsFile(`{"a":{"dtype":"U8","shape":[1],"data_offsets":[4,5]}}`, make([]byte, 8)), true, ""},
		{"packed F4", "f4.safetensors", safetensorsFile(`{"a":{"dtype":"F4","shape":[4],"data_offsets":[0,2]}}`, make([]byte, 2)), true, ""},
		{"not safetensors, other extension", "x.bin", []byte("just some bytes, not a header"), false, ""},
		{"broken header, other extension", "y.bin", safetensorsFile(`{"a":1}`, nil), false, ""},
		{"too short", "s.safetensors", []byte{1, 2}, false, "shorter than the 8-byte header length"},
		{"header too large", "h.safetensors", binary.LittleEndian.AppendUint64(nil, 200_000_000), false, "exceeds the safetensors limit"},
		{"header past end", "p.safetensors", binary.LittleEndian.AppendUint64(nil, 100), false, "runs past the end"},
		{"not JSON", "j.safetensors", safetensorsFile(`{"a":`, nil), false, "the JSON ends early"},
		{"not an object", "o.safetensors", safetensorsFile(`[1,2]`, nil), false, "not a UTF-8 JSON object"},
		{"unknown dtype", "d.safetensors", safetensorsFile(`{"a":{"dtype":"F128","shape":[1],"data_offsets":[0,16]}}`, make([]byte, 16)), false, `unknown dtype "F128"`},
		{"offsets outside data", "r.safetensors", safetensorsFile(`{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}`, make([]byte, 8)), false, "outside the 8 data bytes"},
		{"size mismatch", "z.safetensors", safetensorsFile(`{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}}`, make([]byte, 16)), false, "F32[3] needs 12"},
		{"overlap", "v.safetensors", safetensorsFile(`{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}}`, make([]byte, 6)), false, "overlap"},
		{"duplicate name", "u.safetensors", safetensorsFile(`{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}`, make([]byte, 1)), false, `names "a" twice`},
		{"metadata not strings", "md.safetensors", safetensorsFile(`{"__metadata__":{"n":1}}`, nil), false, "__metadata__ must map strings to strings"},
		{"negative offset", "n.safetensors", safetensorsFile(`{"a":{"dtype":"U8","shape":[1],"data_offsets":[-1,0]}}`, make([]byte, 1)), false, `tensor "a"`},
		{"shape overflow", "ov.safetensors", safetensorsFile(`{"a":{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,0]}}`, nil), false, "fits in 64 bits"},
		{"trailing data", "t.safetensors", safetensorsFile(`{} {}`, nil), false, "data after its JSON object"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(dir, tc.file)
			if err := os.WriteFile(path, tc.content, 0o644); err != nil {
				t.Fatal(err)
			}
			f, err := os.Open(path)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			meta, ok, err := safetensorsMeta(f, int64(len(tc.content)))
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("safetensorsMeta = %s, %v, %v; want error mentioning %q", meta, ok, err, tc.wantErr)
				}
				return
			}
			if err != nil || ok != tc.wantOK {
				t.Fatalf("safetensorsMeta = %s, %v, %v; want ok=%v", meta, ok, err, tc.wantOK)
			}
			if off, _ := f.Seek(0, 1); off != 0 {
				t.Fatalf("file offset moved to %d", off)
			}
		})
	}
}

func TestPutSafetensors(t *testing.T) {
	dir := socketDir(t)
	sock := filepath.Join(dir, "gpushm.sock")
	startDaemonProc(t, sock)
	t.Setenv("GPUSHM_SOCKET", sock)

	data := make([]byte, 22)
	for i := range data {
		data[i] = byte(i)
	}
	file := safetensorsFile(goodHeader, data)
	good := filepath.Join(dir, "model.safetensors")
	os.WriteFile(good, file, 0o644)
	mustRun(t, nil, "put", "model", good)
	want := `meta:        {"kind":"bundle","format":"safetensors","header_bytes":` + strconv.Itoa(len(goodHeader)) + `,"tensors":3}`
	if out := mustRun(t, nil, "stat", "model"); !strings.Contains(out, want) {
		t.Fatalf("stat lacks %q:\n%s", want, out)
	}
	// The segment is the file, byte for byte.
	if got := mustRun(t, nil, "get", "model", "-"); got != string(file) {
		t.Fatalf("get returned %d bytes that differ from the %d-byte file", len(got), len(file))
	}
	// From a pipe the name says nothing; the content does.
	mustRun(t, file, "put", "piped", "-")
	if out := mustRun(t, nil, "stat", "piped"); !strings.Contains(out, `"kind":"bundle"`) {
		t.Fatalf("stat of a piped safetensors file lacks the bundle meta:\n%s", out)
	}
	// Other files keep no meta.
	plain := filepath.Join(dir, "plain.bin")
	os.WriteFile(plain, []byte("plain bytes"), 0o644)
	mustRun(t, nil, "put", "plain", plain)
	if out := mustRun(t, nil, "stat", "plain"); strings.Contains(out, "meta:") {
		t.Fatalf("a plain file got meta:\n%s", out)
	}

	// A malformed header fails before anything is allocated.
	bad := filepath.Join(dir, "bad.safetensors")
	os.WriteFile(bad, safetensorsFile(`{"w":{"dtype":"F32","shape":[8],"data_offsets":[0,32]}}`, make([]byte, 16)), 0o644)
	mustFail(t, "bad.safetensors is not a valid safetensors file: tensor \"w\": data_offsets [0, 32] are outside the 16 data bytes", "put", "bad", bad)
	mustFail(t, "no such segment", "stat", "bad")
	if out := mustRun(t, nil, "info"); !strings.Contains(out, "3 named") {
		t.Fatalf("info after the failed put:\n%s", out)
	}
}
