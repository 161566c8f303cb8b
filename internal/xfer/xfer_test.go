package xfer

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
)

// TestCopyStops: a copy whose context ends stops at its copiers' next
// chunk, with an error that carries the context's cause, and copies
// nothing more.
func TestCopyStops(t *testing.T) {
	const chunk, chunks = 1 << 20, 64
	path := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(path, make([]byte, chunk*chunks), 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	mem := make([]byte, chunk*chunks)
	gone := errors.New("the client hung up")
	for _, load := range []bool{true, false} {
		ctx, cancel := context.WithCancelCause(context.Background())
		var moved atomic.Int64
		o := &Options{Workers: 2, Chunk: chunk, Progress: func(n int64) {
			if moved.Add(n) >= 3*chunk {
				cancel(gone)
			}
		}}
		r := []Range{{File: f, Len: chunk * chunks}}
		t0 := Target{Host: mem, Size: int64(len(mem))}
		var err error
		if load {
			_, err = Load(ctx, t0, r, o)
		} else {
			_, err = Store(ctx, t0, r, o)
		}
		if !errors.Is(err, gone) {
			t.Fatalf("load %v: %v, want the context's cause", load, err)
		}
		// Each copier finishes the chunk it is on.
		if n := moved.Load(); n > (3+2)*chunk {
			t.Errorf("load %v: %d chunks copied after the copy was stopped at 3", load, n/chunk)
		}
	}
}
