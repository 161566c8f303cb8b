package disk

import (
	"context"
	"errors"
	"os"
	"strings"
	"testing"
)

// checkSink is a Sink that fails the test if it is given a byte that is
// not want's.
type checkSink struct {
	t    *testing.T
	want mem
}

func (c checkSink) WriteAt(p []byte, off int64) error {
	if i := firstDiff(p, c.want[off:off+int64(len(p))]); i >= 0 {
		c.t.Errorf("the sink was given byte %d wrong: a corrupt chunk was served", off+int64(i))
	}
	return nil
}

func flipByte(t *testing.T, path string, off int64) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, 1)
	if _, err := f.ReadAt(b, off); err != nil {
		t.Fatal(err)
	}
	b[0] ^= 0x40
	if _, err := f.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
}

// TestCorruption damages a copy's files in each way a disk or a person
// can, and reads it: the read must fail naming the key and the file, and
// give the sink nothing that is not the copy's.
func TestCorruption(t *testing.T) {
	const size = 5*testChunk + 777
	for _, tc := range []struct {
		name string
		file int // index in Entry.Files: 0-1 data, 2-3 manifests (2 the commit's)
		harm func(t *testing.T, path string)
	}{
		{"a data byte flipped", 1, func(t *testing.T, p string) { flipByte(t, p, testChunk+5) }},
		{"the last chunk's byte flipped", 1, func(t *testing.T, p string) { flipByte(t, p, 2*testChunk+3) }},
		{"a manifest byte flipped", 2, func(t *testing.T, p string) { flipByte(t, p, 30) }},
		{"the manifest's key flipped", 2, func(t *testing.T, p string) { flipByte(t, p, 100) }},
		{"a data file truncated", 1, func(t *testing.T, p string) { os.Truncate(p, testChunk) }},
		{"a data file grown", 0, func(t *testing.T, p string) { os.Truncate(p, 4*testChunk) }},
		{"a data file removed", 0, func(t *testing.T, p string) { os.Remove(p) }},
		{"the manifest truncated", 2, func(t *testing.T, p string) { os.Truncate(p, 20) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := open(t, tempDirs(t, "/var/tmp", 2), Options{Chunk: testChunk})
			want := pattern(size, 7)
			key := "corrupt " + tc.name
			e := write(t, s, key, want, "")
			path := e.Files[tc.file]
			tc.harm(t, path)
			_, err := s.Read(context.Background(), key, checkSink{t, want})
			if err == nil {
				t.Fatalf("Read of a copy with %s succeeded", tc.name)
			}
			if !strings.Contains(err.Error(), "\""+key+"\"") || !strings.Contains(err.Error(), path) {
				t.Errorf("Read = %v: want the key %q and the file %s named", err, key, path)
			}
			if !errors.Is(err, ErrCorrupt) {
				t.Errorf("Read = %v, want ErrCorrupt", err)
			}
		})
	}
}

// TestCorruptAtOpen: a copy whose every manifest is damaged is removed at
// Open, and its neighbours are kept.
func TestCorruptAtOpen(t *testing.T) {
	dirs := tempDirs(t, "/var/tmp", 1)
	s := open(t, dirs, Options{Chunk: testChunk})
	bad := write(t, s, "bad", pattern(100, 1), "")
	good := write(t, s, "good", pattern(100, 2), "")
	s.Close()
	flipByte(t, bad.Files[1], 40)
	s = open(t, dirs, Options{Chunk: testChunk})
	if _, err := s.Stat("bad"); !errors.Is(err, ErrNotExist) {
		t.Errorf("Stat of a copy whose manifest is corrupt = %v, want ErrNotExist", err)
	}
	readBack(t, s, "good", pattern(100, 2))
	assertOnly(t, dirs[0], good)
}
