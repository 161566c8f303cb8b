package backend

import (
	"bytes"
	"log/slog"
	"math/rand/v2"
	"testing"

	"github.com/gpushm/gpushm/internal/cuda"
	"github.com/gpushm/gpushm/internal/segment"
)

// TestMoveRoundTrip moves bytes from a device's memory to spill memory and
// back into a new allocation, as an eviction and a restore do, on every
// backend this machine has: the host's always, cuda's with a GPU.
func TestMoveRoundTrip(t *testing.T) {
	onEachBackend(t, func(t *testing.T, name string, b Backend, host *Host) {
		mover := b.(segment.Mover)
		// Not a multiple of the copy engine's chunk, so the last is short.
		const n = 3<<23 + 12345
		dev := b.DefaultDevice()
		src, want := filled(t, b, dev, n, 7)
		defer src.Free()
		spill, err := NewSpill(host, 0).Allocate(0, n)
		if err != nil {
			t.Fatal(err)
		}
		defer spill.Free()
		if err := mover.Move(spill, src, n); err != nil {
			t.Fatalf("out: %v", err)
		}
		got := make([]byte, n)
		if err := spill.(segment.Data).ReadAt(got, 0); err != nil || !bytes.Equal(got, want) {
			t.Fatalf("host memory after the move out: equal %v, %v", bytes.Equal(got, want), err)
		}
		back := movedBack(t, b, dev, spill, want)
		defer back.Free()
		if err := mover.Move(back, src, n); name == "cuda" && err == nil {
			t.Fatal("a move between two GPU allocations was taken")
		}
	})
}

// filled is new memory of b's on dev holding n random bytes (from seed),
// and those bytes; the caller frees it.
func filled(t *testing.T, b Backend, dev int, n int64, seed byte) (segment.Memory, []byte) {
	t.Helper()
	want := make([]byte, n)
	rand.NewChaCha8([32]byte{seed}).Read(want)
	m, err := b.Allocate(dev, n)
	if err != nil {
		t.Fatal(err)
	}
	if err := m.(segment.Data).WriteAt(want, 0); err != nil {
		m.Free()
		t.Fatal(err)
	}
	return m, want
}

// movedBack moves spill's bytes into new memory of b's on dev, as a
// restore does, and checks that they are want; the caller frees it.
func movedBack(t *testing.T, b Backend, dev int, spill segment.Memory, want []byte) segment.Memory {
	t.Helper()
	n := int64(len(want))
	back, err := b.Allocate(dev, n)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.(segment.Mover).Move(back, spill, n); err != nil {
		back.Free()
		t.Fatalf("back: %v", err)
	}
	got := make([]byte, n)
	if err := back.(segment.Data).ReadAt(got, 0); err != nil || !bytes.Equal(got, want) {
		back.Free()
		t.Fatalf("device memory after the move back: equal %v, %v", bytes.Equal(got, want), err)
	}
	return back
}

// onEachBackend runs f in a subtest for every backend this machine has:
// the host's always, cuda's with a GPU.
func onEachBackend(t *testing.T, f func(t *testing.T, name string, b Backend, host *Host)) {
	names := []string{"host"}
	if cuda.Init() == nil {
		names = append(names, "cuda")
	} else {
		t.Log("cuda: skipped, no usable GPU (libcuda.so.1 absent or no device)")
	}
	for _, name := range names {
		t.Run(name, func(t *testing.T) {
			b, err := Open(name, "all", slog.Default())
			if err != nil {
				t.Fatal(err)
			}
			defer b.Close()
			host, err := NewHost()
			if err != nil {
				t.Fatal(err)
			}
			f(t, name, b, host)
		})
	}
}

// TestSpillRecycles: spill memory let go of comes back, as it was, to the
// next eviction of its size (AllocateScratch), never to Allocate (which
// gives zeroed memory), and only up to the limit.
func TestSpillRecycles(t *testing.T) {
	host, err := NewHost()
	if err != nil {
		t.Fatal(err)
	}
	s := NewSpill(host, 3<<20)
	a, err := s.Allocate(0, 2<<20)
	if err != nil {
		t.Fatal(err)
	}
	a.(segment.Data).WriteAt([]byte("left over"), 0)
	fd, _ := a.FD()
	a.Free()
	fresh, err := s.Allocate(0, 2<<20)
	if err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 9)
	fresh.(segment.Data).ReadAt(got, 0)
	if f, _ := fresh.FD(); f == fd || string(got) != "\x00\x00\x00\x00\x00\x00\x00\x00\x00" {
		t.Fatalf("Allocate gave recycled memory: fd %d (was %d), %q", f, fd, got)
	}
	if other, _ := s.AllocateScratch(0, 1<<20, maxParts); other != nil {
		if f, _ := other.FD(); f == fd {
			t.Fatal("memory of another size was recycled")
		}
		other.Free()
	}
	b, err := s.AllocateScratch(0, 2<<20, maxParts)
	if err != nil {
		t.Fatal(err)
	}
	if f, _ := b.FD(); f != fd {
		t.Fatalf("AllocateScratch made new memory (fd %d), not the one let go of (%d)", f, fd)
	}
	// The 1 MiB is kept, and one 2 MiB; the other is over the limit
	// (3 MiB) and freed.
	b.Free()
	fresh.Free()
	s.mu.Lock()
	kept, twos := s.bytes, len(s.recycled[2<<20])
	s.mu.Unlock()
	if kept != 3<<20 || twos != 1 {
		t.Fatalf("%d bytes kept for reuse, %d of 2 MiB; want 3 MiB, one of 2 MiB", kept, twos)
	}
}
