package backend

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/xfer"
)

// TestSpillInParts: an eviction into new memory of a size worth parts gets
// spill memory in parts (and counts among the allocations making memory
// until it is filled); smaller ones one memfd.
func TestSpillInParts(t *testing.T) {
	host, err := NewHost()
	if err != nil {
		t.Fatal(err)
	}
	s := NewSpill(host, 0)
	before := spillMemfds(t)
	m, err := s.AllocateScratch(0, 2*partMin+4096, maxParts)
	if err != nil {
		t.Fatal(err)
	}
	pm, ok := m.(*partsMemory)
	if !ok || len(pm.Parts()) != 2 || pm.Size() != 2*partMin+4096 {
		t.Fatalf("an eviction of %d bytes got %T, want two parts", 2*partMin+4096, m)
	}
	if n := spillMemfds(t) - before; n != 2 {
		t.Fatalf("%d spill memfds for two parts", n)
	}
	if s.making.Load() != 1 {
		t.Fatal("new memory in parts is not counted as being made")
	}
	pm.settled()
	pm.settled()
	if s.making.Load() != 0 {
		t.Fatalf("making %d after the copy settled twice, want 0", s.making.Load())
	}
	m.Free()
	if n := spillMemfds(t) - before; n != 0 {
		t.Fatalf("%d spill memfds left after Free", n)
	}
	one, err := s.AllocateScratch(0, 2*partMin-4096, maxParts)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := one.(*hostMemory); !ok {
		t.Fatalf("an eviction of less than two parts' worth got %T, want one memfd", one)
	}
	one.Free()
	// Where the daemon's descriptors leave room for fewer, fewer.
	for _, c := range []struct {
		size         int64
		allowed, got int
	}{{2 * partMin, 1, 1}, {4 * partMin, 3, 3}} {
		m, err := s.AllocateScratch(0, c.size, c.allowed)
		if err != nil {
			t.Fatal(err)
		}
		n := 1
		if pm, ok := m.(*partsMemory); ok {
			n = len(pm.parts)
		}
		if n != c.got {
			t.Fatalf("an eviction of %d bytes allowed %d descriptors got %d", c.size, c.allowed, n)
		}
		m.Free()
	}
}

// TestMovePartsRoundTrip moves bytes between a device's memory and spill
// memory in parts of unequal size, both ways, on every backend this
// machine has, and reads and writes the parts across their boundaries
// as the FUSE view does; then joins them again from their descriptors,
// as a restart does.
func TestMovePartsRoundTrip(t *testing.T) {
	onEachBackend(t, func(t *testing.T, name string, b Backend, host *Host) {
		mover := b.(segment.Mover)
		const n = 3<<23 + 3*4096
		dev := b.DefaultDevice()
		src, want := filled(t, b, dev, n, 9)
		defer src.Free()
		spill, err := makeParts(n, 4)
		if err != nil {
			t.Fatal(err)
		}
		if len(spill.parts) != 4 || spill.parts[3].size == spill.parts[0].size {
			t.Fatalf("parts of %d bytes: %d", n, len(spill.parts))
		}
		if err := mover.Move(spill, src, n); err != nil {
			t.Fatalf("out: %v", err)
		}
		got := make([]byte, n)
		if err := spill.ReadAt(got, 0); err != nil || !bytes.Equal(got, want) {
			t.Fatalf("spill memory after the move out: equal %v, %v", bytes.Equal(got, want), err)
		}
		// Across the first boundary.
		at := spill.parts[0].size - 5
		patch := []byte("0123456789")
		if err := spill.WriteAt(patch, at); err != nil {
			t.Fatal(err)
		}
		copy(want[at:], patch)
		if err := spill.Zero(at+20, 3*4096); err != nil {
			t.Fatal(err)
		}
		clear(want[at+20 : at+20+3*4096])
		// Into a memfd and back, as the FUSE view's resizes copy.
		h, err := host.Allocate(0, n)
		if err != nil {
			t.Fatal(err)
		}
		defer h.Free()
		if err := h.(segment.Data).CopyFrom(spill, n); err != nil {
			t.Fatal(err)
		}
		if err := h.(segment.Data).ReadAt(got, 0); err != nil || !bytes.Equal(got, want) {
			t.Fatalf("a memfd copied from the parts differs from what was written: %v", err)
		}
		if err := spill.ReadAt(got[:100], at-50); err != nil || !bytes.Equal(got[:100], want[at-50:at+50]) {
			t.Fatalf("read across a boundary: %v", err)
		}
		if err := spill.ReadAt(got[:10], n-5); err == nil {
			t.Fatal("a read past the end was taken")
		}
		// A restart: each part's descriptor restored, then joined.
		var parts []segment.Memory
		for _, p := range spill.parts {
			fd, err := syscall.Dup(p.fd)
			if err != nil {
				t.Fatal(err)
			}
			m, err := host.Restore(0, fd, p.size)
			if err != nil {
				t.Fatal(err)
			}
			parts = append(parts, m)
		}
		joined, err := JoinParts(parts)
		if err != nil {
			t.Fatal(err)
		}
		if err := spill.Free(); err != nil {
			t.Fatal(err)
		}
		back := movedBack(t, b, dev, joined, want)
		defer back.Free()
		if err := joined.Free(); err != nil {
			t.Fatal(err)
		}
		if _, err := JoinParts([]segment.Memory{back}); name == "cuda" && err == nil {
			t.Fatal("GPU memory was joined as a part of spill memory")
		}
	})
}

// The copy's ranges take the parts in turn, a chunk each, and cover every
// byte once.
func TestPartsRanges(t *testing.T) {
	m := &partsMemory{size: 10}
	for _, n := range []int64{4, 4, 2} {
		m.parts = append(m.parts, &hostMemory{size: n})
	}
	fs := partFiles{nil, nil, nil}
	rs := m.ranges(fs, 10, 2)
	var got [][2]int64
	for _, r := range rs {
		got = append(got, [2]int64{r.At, r.Len})
	}
	want := [][2]int64{{0, 2}, {4, 2}, {8, 2}, {2, 2}, {6, 2}}
	if len(got) != len(want) {
		t.Fatalf("ranges %v, want %v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("ranges %v, want %v", got, want)
		}
	}
	if rs := m.ranges(fs, 5, 2); len(rs) != 3 || rs[1].At != 4 || rs[1].Len != 1 || rs[2].At != 2 {
		t.Fatalf("the first 5 bytes: %+v", rs)
	}
}

// TestStoreManySteps stores a device's memory into a file in many chunks
// on few copiers, as an eviction in parts and a dump do: every chunk must
// land once, and the progress count each.
func TestStoreManySteps(t *testing.T) {
	onEachBackend(t, func(t *testing.T, name string, b Backend, host *Host) {
		const n = 5<<20 + 12345
		src, want := filled(t, b, b.DefaultDevice(), n, 11)
		defer src.Free()
		tg, err := src.(interface{ XferTarget() (xfer.Target, error) }).XferTarget()
		if err != nil {
			t.Fatal(err)
		}
		tg.Size = n
		f, err := os.Create(filepath.Join(t.TempDir(), "dump"))
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		var progress atomic.Int64
		st, err := xfer.Store(context.Background(), tg, []xfer.Range{{File: f, Len: n}},
			&xfer.Options{Workers: 3, Chunk: 64 << 10, Progress: func(k int64) { progress.Add(k) }})
		if err != nil {
			t.Fatal(err)
		}
		got, err := os.ReadFile(f.Name())
		if err != nil || !bytes.Equal(got, want) || st.Bytes != n || progress.Load() != n {
			t.Fatalf("stored %d bytes (progress %d), equal %v, %v", st.Bytes, progress.Load(), bytes.Equal(got, want), err)
		}
	})
}
