package backend

import (
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/wire"
)

type fakeMem struct {
	size  int64
	freed *atomic.Int64
}

func (m *fakeMem) FD() (int, error) { return -1, nil }
func (m *fakeMem) Size() int64      { return m.size }
func (m *fakeMem) Free() error      { m.freed.Add(1); return nil }

func waitFor(t *testing.T, what string, ok func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !ok(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

func TestPool(t *testing.T) {
	var made, freed atomic.Int64
	p := newPool(3<<20, func(size int64) (segment.Memory, error) {
		made.Add(1)
		return &fakeMem{size: size, freed: &freed}, nil
	})
	if m := p.take(1 << 20); m != nil {
		t.Fatal("a size never asked for was ready")
	}
	// A size asked for once is not made ahead: a single create leaves
	// nothing behind.
	time.Sleep(10 * kickAfter)
	if made.Load() != 0 {
		t.Fatalf("made %d ahead of a size asked for once", made.Load())
	}
	// The second miss starts making depth (2) of that size.
	if m := p.take(1 << 20); m != nil {
		t.Fatal("a size asked for once was ready")
	}
	waitFor(t, "two ready", func() bool { return p.ready() == 2<<20 })
	m := p.take(1 << 20)
	if m == nil || m.Size() != 1<<20 {
		t.Fatalf("take after fill = %v", m)
	}
	waitFor(t, "the replacement", func() bool { return p.ready() == 2<<20 })
	// A second size fits only once within the 3 MiB limit (2 ready of
	// the first, one of the second).
	p.take(1 << 20)
	p.take(1 << 20)
	waitFor(t, "refill", func() bool { return p.ready() == 2<<20 })
	if m := p.take(2 << 20); m != nil {
		t.Fatal("an unseen size was ready")
	}
	time.Sleep(50 * time.Millisecond)
	if got := p.ready(); got > 3<<20 {
		t.Fatalf("pool holds %d bytes, limit %d", got, 3<<20)
	}
	if !p.drain() || p.ready() != 0 {
		t.Fatalf("drain left %d", p.ready())
	}
	p.close()
	if m := p.take(1 << 20); m != nil {
		t.Fatal("a closed pool gave memory")
	}
	waitFor(t, "everything made to be freed or taken", func() bool { return made.Load()-freed.Load() == 3 }) // the three taken
}

func TestPoolBoundsSizes(t *testing.T) {
	var freed atomic.Int64
	p := newPool(1<<30, func(size int64) (segment.Memory, error) {
		return &fakeMem{size: size, freed: &freed}, nil
	})
	defer p.close()
	for i := range maxPoolSizes + 10 {
		p.take(int64(i+1) << 12)
	}
	p.mu.Lock()
	n := len(p.sizes)
	p.mu.Unlock()
	if n != maxPoolSizes {
		t.Fatalf("pool keeps %d sizes, want %d", n, maxPoolSizes)
	}
}

func TestPoolTrimsIdleSizes(t *testing.T) {
	var freed atomic.Int64
	p := newPool(1<<30, func(size int64) (segment.Memory, error) {
		return &fakeMem{size: size, freed: &freed}, nil
	})
	p.idle = time.Hour
	defer p.close()
	p.take(4096)
	p.take(4096)
	// Both made first: a trim that came while they were still being made
	// would rightly leave them unmade, on a busy machine.
	waitFor(t, "the size's allocations to be made", func() bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		return len(p.sizes[4096].ready) == 2
	})
	p.mu.Lock()
	p.idle = 20 * time.Millisecond
	p.armTrimLocked(4096, p.sizes[4096])
	p.mu.Unlock()
	// The trim takes the size out under the pool's lock and frees its
	// allocations after, outside it: wait for both.
	waitFor(t, "the idle size to be given back and its 2 allocations freed", func() bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		return len(p.sizes) == 0 && p.bytes == 0 && freed.Load() == 2
	})
	time.Sleep(20 * time.Millisecond)
	if freed.Load() != 2 {
		t.Fatalf("freed %d allocations, want the 2 made", freed.Load())
	}
}

func TestHostPoolGivesSealedMemory(t *testing.T) {
	h, err := NewHost()
	if err != nil {
		t.Fatal(err)
	}
	h.Pool(8 << 20)
	defer h.Close()
	for range 2 {
		m, err := h.Allocate(0, 1<<20)
		if err != nil {
			t.Fatal(err)
		}
		m.Free()
	}
	waitFor(t, "the pool to fill", func() bool { return h.PoolStats().Bytes == 2<<20 })
	m, err := h.Allocate(0, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Free()
	if p, ok := m.(segment.Pooled); !ok || !p.FromPool() {
		t.Error("memory taken from the pool does not say so")
	}
	if h.PoolStats().Bytes != 1<<20 {
		t.Fatalf("pooled %d after a take", h.PoolStats().Bytes)
	}
	fd, _ := m.FD()
	seals, err := fcntlSeals(fd)
	if err != nil {
		t.Fatal(err)
	}
	if seals == 0 || m.Size() != 1<<20 {
		t.Fatalf("pooled memfd: seals %#x size %d", seals, m.Size())
	}
}

func fcntlSeals(fd int) (int, error) { return unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0) }

// TestPoolMakesAfterTheReply: what a take has made waits for refill (the
// server calls it once the reply is sent), or for the pool's own kick a
// moment later when nobody calls it.
func TestPoolMakesAfterTheReply(t *testing.T) {
	var made, freed atomic.Int64
	p := newPool(1<<30, func(size int64) (segment.Memory, error) {
		made.Add(1)
		return &fakeMem{size: size, freed: &freed}, nil
	})
	defer p.close()
	p.take(4096)
	p.take(4096)
	// Counted at once, as info and the limit see it, before it is made.
	if s := p.stats(); s.Filling != 1 {
		t.Fatalf("stats right after the take %+v, want one size filling", s)
	}
	p.refill()
	waitFor(t, "two made by refill", func() bool { return p.ready() == 2*4096 })
	if s := p.stats(); s != (wire.Pool{Ready: 2, Bytes: 2 * 4096}) {
		t.Fatalf("stats %+v, want 2 ready", s)
	}
	// Nobody calls refill: the kick makes the replacement.
	if m := p.take(4096); m == nil {
		t.Fatal("nothing ready")
	}
	waitFor(t, "the replacement, made by the kick", func() bool { return p.ready() == 2*4096 })
	if made.Load() != 3 {
		t.Fatalf("made %d, want 3", made.Load())
	}
}
