package testutil

import (
	"encoding/binary"
	"os"
	"testing"
)

// Files for the tests of put and get: safetensors laid out by hand, and
// large sparse files.

// SparseFile makes a file of size bytes, all holes but for marks at each
// end and in the middle: fast to read, and every step of a copy differs.
func SparseFile(t testing.TB, path string, header []byte, size int64) {
	t.Helper()
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	f.Write(header)
	for _, off := range []int64{int64(len(header)), size / 3, size / 2, size - 8} {
		f.WriteAt([]byte("gpushm!!"), off)
	}
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
}

// SafetensorsFile lays out header JSON and data as a safetensors file.
func SafetensorsFile(header string, data []byte) []byte {
	b := binary.LittleEndian.AppendUint64(nil, uint64(len(header)))
	return append(append(b, header...), data...)
}
