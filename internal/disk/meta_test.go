package disk

import (
	"errors"
	"strings"
	"testing"
)

// TestSetMeta: a copy's meta is replaced without its bytes; the usage
// follows the manifests' lengths, and a reopened store serves the new meta
// with the same bytes.
func TestSetMeta(t *testing.T) {
	dirs := tempDirs(t, "/var/tmp", 3)
	s := open(t, dirs, Options{Chunk: testChunk})
	data := pattern(4*testChunk+5, 4)
	e := write(t, s, "k", data, "short")
	used, _ := s.Usage()
	long := strings.Repeat("x", 5000)
	if err := s.SetMeta("k", []byte(long)); err != nil {
		t.Fatal(err)
	}
	if got, _ := s.Stat("k"); string(got.Meta) != long || got.Gen != e.Gen {
		t.Fatalf("Stat after SetMeta: meta %d bytes, gen %d; want %d bytes, gen %d", len(got.Meta), got.Gen, len(long), e.Gen)
	}
	grown, _ := s.Usage()
	if grown <= used {
		t.Errorf("Usage after a longer meta = %d, before %d", grown, used)
	}
	if err := s.SetMeta("nothing", nil); !errors.Is(err, ErrNotExist) {
		t.Errorf("SetMeta of no copy = %v, want ErrNotExist", err)
	}
	if err := s.SetMeta("k", make([]byte, MaxMeta+1)); err == nil {
		t.Error("SetMeta over MaxMeta succeeded")
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	s = open(t, dirs, Options{Chunk: testChunk})
	if got, _ := s.Stat("k"); string(got.Meta) != long {
		t.Fatalf("meta after reopen: %q", got.Meta)
	}
	if u, _ := s.Usage(); u != grown {
		t.Errorf("Usage after reopen = %d, before Close %d", u, grown)
	}
	readBack(t, s, "k", data)
}
