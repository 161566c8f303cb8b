package backend

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/xfer"
)

var (
	_ segment.Mover = (*Host)(nil)
	_ segment.Mover = (*CUDA)(nil)
)

// Spill allocates the host memory that segments are evicted to: sealed
// memfds as Host makes them, named gpushm-spill, except that their pages
// are made by several threads at once and mapped in the daemon on the way
// (MADV_POPULATE_WRITE, which reports running out of memory as an error
// where a fault would be a SIGBUS). Measured on an H200 machine at 4 GiB:
// populating took 0.95 s and the copy into it 0.26 s; a fallocate took
// 0.81 s, but the copy then faulted every page into the daemon's mapping,
// 1.80 s. Making 4 KiB pages is most of a first eviction's time either way
// (without transparent huge pages for shmem, which that machine has off):
// the reserve (Reserve, reserve_linux.go) makes them ahead.
type Spill struct {
	host *Host
	// res is the reserve while Reserve runs; meminfo and every are how
	// it reads the kernel's memory figures and how often (tests set them).
	res     atomic.Pointer[reserve]
	meminfo func() (meminfo, error)
	every   time.Duration
	// keeper, if set, holds the reserve's pieces (SetKeeper); pieceIDs
	// names them to it.
	keeper   Keeper
	pieceIDs atomic.Uint64
	// demand, if set, is the host memory the next eviction may need
	// (SetDemand).
	demand func() int64
	// making counts allocations making new memory; the reserve waits
	// for them. An allocation waits for a piece being made for as long
	// as new memory would take at waitRate bytes a second.
	making   atomic.Int32
	waitRate int64
	// recycled holds spill memory let go of, by size, for the next
	// eviction of that size: a restore that was written to after leaves
	// its host memory, and an eviction that reuses it copies at the copy
	// engine's speed instead of waiting for the kernel to make pages.
	mu       sync.Mutex
	recycled map[int64][]*recycledMem
	bytes    int64
	limit    int64
	timer    *time.Timer
}

type recycledMem struct {
	m     *hostMemory
	since time.Time
}

var (
	_ segment.Allocator        = (*Spill)(nil)
	_ segment.ScratchAllocator = (*Spill)(nil)
)

// recycleIdle is how long spill memory waits for an eviction of its size
// before it is freed.
const recycleIdle = 30 * time.Second

// NewSpill returns the spill allocator over host, keeping up to limit
// bytes of freed spill memory for reuse (0: none).
func NewSpill(host *Host, limit int64) *Spill {
	return &Spill{host: host, recycled: map[int64][]*recycledMem{}, limit: limit,
		meminfo: readMeminfo, every: time.Second, waitRate: 1e9}
}

// HandleType implements segment.Allocator.
func (s *Spill) HandleType() string { return s.host.HandleType() }

// Capacity implements segment.Allocator.
func (s *Spill) Capacity(device int) (int64, error) { return s.host.Capacity(device) }

// Allocate implements segment.Allocator: new memory, zeroed (the
// reserve's, never written, or made now).
func (s *Spill) Allocate(device int, size int64) (segment.Memory, error) {
	g := s.host.Granularity()
	size = (size + g - 1) / g * g
	if m := s.fromReserve(size, s.waitRate); m != nil {
		return m, nil
	}
	return s.allocate(size)
}

// allocate makes new memory of size bytes, a multiple of the page size.
func (s *Spill) allocate(size int64) (segment.Memory, error) {
	s.making.Add(1)
	defer s.making.Add(-1)
	m, err := newMemfd("gpushm-spill", size, func(m *hostMemory) error {
		b, err := m.bytes()
		if err != nil {
			return err
		}
		if shmemTHP() {
			unix.Madvise(b, unix.MADV_HUGEPAGE) // a hint: none is no error
		}
		if err := populate(b); !errors.Is(err, unix.EINVAL) {
			return err
		}
		// A kernel older than 5.14.
		if err := unix.Fallocate(m.fd, 0, 0, size); err != nil {
			return fmt.Errorf("fallocate: %w", noMem(err))
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	m.recycle = s.recycle
	return m, nil
}

// AllocateScratch implements segment.ScratchAllocator: memory of exactly
// size bytes (rounded to a page) whose bytes are whatever an earlier
// segment left there, for a caller that overwrites every one of them (an
// eviction's copy) before anyone reads them.
func (s *Spill) AllocateScratch(device int, size int64, parts int) (segment.Memory, error) {
	g := s.host.Granularity()
	size = (size + g - 1) / g * g
	s.mu.Lock()
	if l := s.recycled[size]; len(l) > 0 {
		r := l[len(l)-1]
		s.recycled[size] = l[:len(l)-1]
		s.bytes -= size
		s.mu.Unlock()
		return r.m, nil
	}
	s.mu.Unlock()
	n := min(partsFor(size), parts)
	if n <= 1 {
		if m := s.fromReserve(size, s.waitRate); m != nil {
			return m, nil
		}
		return s.allocate(size)
	}
	// New memory in parts comes at tens of GB/s, as fast as a piece of
	// the reserve being made would be ready: one made already, or none.
	if m := s.fromReserve(size, 0); m != nil {
		return m, nil
	}
	m, err := makeParts(size, n)
	if err != nil {
		return nil, err
	}
	// Its pages are made by the copy that fills it, which the reserve
	// leaves alone as it does an allocation making them.
	s.making.Add(1)
	var once sync.Once
	m.settle = func() { once.Do(func() { s.making.Add(-1) }) }
	return m, nil
}

// Kept reports the spill memory kept for reuse: how many memfds, how many
// bytes.
func (s *Spill) Kept() (int, int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, l := range s.recycled {
		n += len(l)
	}
	return n, s.bytes
}

// recycle keeps m, freed, for a later eviction of its size; false when
// there is no room for it (the caller frees it).
func (s *Spill) recycle(m *hostMemory) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.bytes+m.size > s.limit {
		return false
	}
	s.recycled[m.size] = append(s.recycled[m.size], &recycledMem{m: m, since: time.Now()})
	s.bytes += m.size
	if s.timer == nil {
		s.timer = time.AfterFunc(recycleIdle, s.trim)
	}
	return true
}

// trim frees what waited longer than recycleIdle.
func (s *Spill) trim() {
	s.mu.Lock()
	var old []*hostMemory
	for size, l := range s.recycled {
		kept := l[:0]
		for _, r := range l {
			if time.Since(r.since) >= recycleIdle {
				old = append(old, r.m)
				s.bytes -= size
			} else {
				kept = append(kept, r)
			}
		}
		s.recycled[size] = kept
	}
	s.timer = nil
	if s.bytes > 0 {
		s.timer = time.AfterFunc(recycleIdle, s.trim)
	}
	s.mu.Unlock()
	for _, m := range old {
		m.recycle = nil
		m.Free()
	}
}

// populateChunk is what one thread populates at a time.
const populateChunk = 64 << 20

// populate makes every page of b, a shared mapping of a memfd, on up to
// 16 threads.
func populate(b []byte) error {
	return populateIn(b, populateChunk, 16, nil, nil)
}

// errStopped: a populate was told to stop.
var errStopped = errors.New("stopped")

// populateIn makes every page of b chunk bytes at a time on up to workers
// threads; each calls start (if set) first, and asks more (if set) before
// each chunk, stopping all with errStopped at its first no.
func populateIn(b []byte, chunk, workers int, start func(), more func() bool) error {
	return populateWith(unix.MADV_POPULATE_WRITE, b, chunk, workers, start, more)
}

// populateWith is populateIn with advice MADV_POPULATE_WRITE (make every
// page) or MADV_POPULATE_READ (map pages that exist: faults map 16 at a
// time, and a shared mapping of shmem maps them writable).
func populateWith(advice int, b []byte, chunk, workers int, start func(), more func() bool) error {
	n := (len(b) + chunk - 1) / chunk
	err := inChunks(n, workers, start, more, func(i int) error {
		return noMem(unix.Madvise(b[i*chunk:min((i+1)*chunk, len(b))], advice))
	})
	if err != nil {
		return fmt.Errorf("populate %d bytes of host memory: %w", len(b), err)
	}
	return nil
}

// inChunks runs do for chunks 0 to n-1 on up to workers threads; each
// calls start (if set) first, and asks more (if set) before each chunk.
// The first error, or more's first no (errStopped), stops them all, and
// is what it returns.
func inChunks(n, workers int, start func(), more func() bool, do func(i int) error) error {
	workers = min(n, workers, runtime.NumCPU())
	var (
		mu   sync.Mutex
		next int
		errs []error
		wg   sync.WaitGroup
	)
	failed := func(err error) {
		mu.Lock()
		errs = append(errs, err)
		mu.Unlock()
	}
	for range workers {
		wg.Go(func() {
			if start != nil {
				start()
			}
			for {
				mu.Lock()
				i := next
				next++
				stop := i >= n || len(errs) > 0
				mu.Unlock()
				if stop {
					return
				}
				if more != nil && !more() {
					failed(errStopped)
					return
				}
				if err := do(i); err != nil {
					failed(err)
					return
				}
			}
		})
	}
	wg.Wait()
	if len(errs) > 0 {
		return errs[0]
	}
	return nil
}

// Move implements segment.Mover: both memories are host memory, a memfd
// on at least one side; spill memory in parts is written and read by
// pwrite and pread, a thread a part (parts_linux.go).
func (h *Host) Move(dst, src segment.Memory, n int64) error {
	if d, ok := dst.(*hostMemory); ok {
		to, err := d.span(0, n)
		if err != nil {
			return err
		}
		return moveHost(xfer.Target{Host: to, Size: n}, src, n, true)
	}
	if s, ok := src.(*hostMemory); ok {
		from, err := s.span(0, n)
		if err != nil {
			return err
		}
		return moveHost(xfer.Target{Host: from, Size: n}, dst, n, false)
	}
	return fmt.Errorf("move from %T to %T: not host memory", src, dst)
}

// Move implements segment.Mover: between a GPU allocation and host
// memory, through the daemon's pinned buffers.
func (c *CUDA) Move(dst, src segment.Memory, n int64) error {
	in := true // into the GPU
	gpu, _ := dst.(*cudaMemory)
	host := src
	if gpu == nil {
		in = false
		gpu, _ = src.(*cudaMemory)
		host = dst
	}
	if gpu == nil {
		return fmt.Errorf("move from %T to %T: want cuda and host memory", src, dst)
	}
	t, err := gpu.XferTarget()
	if err != nil {
		return err
	}
	if n > t.Size {
		return fmt.Errorf("move of %d bytes into %d bytes of GPU memory", n, t.Size)
	}
	t.Size = n
	if err := moveHost(t, host, n, in); err != nil {
		return fmt.Errorf("move from %T to %T: %w", src, dst, err)
	}
	return nil
}

// moveHost copies n bytes between t and host, spill memory of either
// kind: from host into t when in is true, from t into host otherwise.
func moveHost(t xfer.Target, host segment.Memory, n int64, in bool) error {
	switch h := host.(type) {
	case *partsMemory:
		return moveParts(t, h, n, in)
	case *hostMemory:
		b, err := h.span(0, n)
		if err != nil {
			return err
		}
		_, err = xfer.Move(t, b, in, nil)
		return err
	}
	return fmt.Errorf("%T is not host memory", host)
}
