package pull

import (
	"fmt"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm/internal/cuda"
)

// A source is what a lender serves: the memory UCX registers, and a way
// to put chunk [off, end) there.
type source interface {
	region() []byte
	ring() int // 0: the segment in place
	stage(i, off, end int64) ([]byte, error)
	close()
}

// A sink is what a fetcher fills: where chunk i is got to, and what to do
// with it once checked; flush waits for every chunk handed to put, and
// says how many chunks are in the segment for good.
type sink interface {
	buf(i, n int64) ([]byte, error)
	put(i, off int64, b []byte) (landed int64, err error)
	flush() (landed int64, err error)
	close()
}

// hostSource lends a memfd in place, mapped copy-on-write: UCX may touch
// what it registers, and a peer's put lands in this process's copy alone.
type hostSource struct{ b []byte }

func newHostSource(fd int, size int64) (*hostSource, error) {
	b, err := unix.Mmap(fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE)
	if err != nil {
		return nil, fmt.Errorf("lend: map the segment: %w", err)
	}
	return &hostSource{b}, nil
}

func (h *hostSource) region() []byte                          { return h.b }
func (h *hostSource) ring() int                               { return 0 }
func (h *hostSource) stage(_, off, end int64) ([]byte, error) { return h.b[off:end], nil }
func (h *hostSource) close()                                  { unix.Munmap(h.b) }

// hostSink fills a memfd in place.
type hostSink struct{ b []byte }

func newHostSink(fd int, size int64) (*hostSink, error) {
	b, err := unix.Mmap(fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("fetch: map the segment: %w", err)
	}
	return &hostSink{b}, nil
}

func (h *hostSink) buf(i, n int64) ([]byte, error)          { return h.b[i*Chunk : i*Chunk+n], nil }
func (h *hostSink) put(i, _ int64, _ []byte) (int64, error) { return i + 1, nil }
func (h *hostSink) flush() (int64, error)                   { return -1, nil }
func (h *hostSink) close()                                  { unix.Munmap(h.b) }

// gpuMemory is a CUDA allocation imported from descriptor 3 and mapped.
type gpuMemory struct {
	dev   *cuda.Device
	h     cuda.Handle
	ptr   uint64
	alloc int64
}

func openGPU(fd int, m Memory, readOnly bool) (*gpuMemory, error) {
	if err := cuda.Init(); err != nil {
		return nil, err
	}
	dev, err := cuda.GetDevice(m.Device)
	if err != nil {
		return nil, err
	}
	h, err := dev.ImportFD(fd)
	if err != nil {
		return nil, err
	}
	ptr, err := dev.Map(h, m.Alloc, readOnly, dev)
	if err != nil {
		dev.Release(h)
		return nil, err
	}
	return &gpuMemory{dev: dev, h: h, ptr: ptr, alloc: m.Alloc}, nil
}

// warmGPU makes device's context ahead of the memory it will map.
func warmGPU(device int) error {
	if err := cuda.Init(); err != nil {
		return err
	}
	dev, err := cuda.GetDevice(device)
	if err != nil {
		return err
	}
	_, _, err = dev.MemInfo()
	return err
}

func (g *gpuMemory) close() {
	g.dev.Unmap(g.ptr, g.alloc)
	g.dev.Release(g.h)
}

// gpuSource lends GPU memory through a ring of pinned buffers: chunk i is
// copied from the GPU to slot i % ringSlots once the fetcher has taken
// chunk i - ringSlots.
type gpuSource struct {
	*gpuMemory
	pinned []byte
}

func newGPUSource(fd int, m Memory) (*gpuSource, error) {
	g, err := openGPU(fd, m, true)
	if err != nil {
		return nil, fmt.Errorf("lend: %w", err)
	}
	p, err := g.dev.AllocHost(ringSlots * Chunk)
	if err != nil {
		g.close()
		return nil, fmt.Errorf("lend: the ring: %w", err)
	}
	return &gpuSource{g, p}, nil
}

func (s *gpuSource) region() []byte { return s.pinned }
func (s *gpuSource) ring() int      { return ringSlots }

func (s *gpuSource) stage(i, off, end int64) ([]byte, error) {
	slot := s.pinned[(i%ringSlots)*Chunk:][:end-off]
	if err := s.dev.CopyDtoH(slot, s.ptr+uint64(off)); err != nil {
		return nil, fmt.Errorf("lend: chunk %d from the GPU: %w", i, err)
	}
	return slot, nil
}

func (s *gpuSource) close() {
	s.dev.FreeHost(s.pinned)
	s.gpuMemory.close()
}

// gpuSink fills GPU memory through pinned buffers, each with a stream of
// its own: chunk i is got into buffer i % sinkSlots, checked, and copied
// up while the next is on the wire. The fetcher's getter (buf) and its
// checker (put) call it from two goroutines.
type gpuSink struct {
	*gpuMemory
	pinned  []byte
	streams [sinkSlots]*cuda.Stream
	mu      sync.Mutex
	queued  [sinkSlots]int64 // the chunk each stream copies, or -1
	landed  int64            // chunks in order on the GPU
	done    map[int64]bool   // chunks on the GPU past landed
}

// sinkSlots: one chunk on the wire, one being checked, one copying up.
const sinkSlots = 3

func newGPUSink(fd int, m Memory) (*gpuSink, error) {
	g, err := openGPU(fd, m, false)
	if err != nil {
		return nil, fmt.Errorf("fetch: %w", err)
	}
	s := &gpuSink{gpuMemory: g, done: map[int64]bool{}}
	for k := range s.queued {
		s.queued[k] = -1
	}
	if s.pinned, err = g.dev.AllocHost(sinkSlots * Chunk); err != nil {
		s.close()
		return nil, fmt.Errorf("fetch: staging buffers: %w", err)
	}
	for k := range s.streams {
		if s.streams[k], err = g.dev.NewStream(); err != nil {
			s.close()
			return nil, fmt.Errorf("fetch: %w", err)
		}
	}
	return s, nil
}

// wait waits for buffer k's copy, if any, to land.
func (s *gpuSink) wait(k int) error {
	s.mu.Lock()
	i := s.queued[k]
	s.mu.Unlock()
	if i < 0 {
		return nil
	}
	if err := s.streams[k].Synchronize(); err != nil {
		return fmt.Errorf("fetch: chunk %d to the GPU: %w", i, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.queued[k] == i {
		s.queued[k] = -1
		s.done[i] = true
		for s.done[s.landed] {
			delete(s.done, s.landed)
			s.landed++
		}
	}
	return nil
}

func (s *gpuSink) buf(i, n int64) ([]byte, error) {
	// The buffer's last copy must be done before the next get writes it.
	k := int(i % sinkSlots)
	if err := s.wait(k); err != nil {
		return nil, err
	}
	return s.pinned[int64(k)*Chunk:][:n], nil
}

func (s *gpuSink) put(i, off int64, b []byte) (int64, error) {
	k := int(i % sinkSlots)
	if err := s.streams[k].CopyHtoDAsync(s.ptr+uint64(off), b); err != nil {
		return 0, fmt.Errorf("fetch: chunk %d to the GPU: %w", i, err)
	}
	s.mu.Lock()
	s.queued[k] = i
	s.mu.Unlock()
	// The one before has had a chunk's time on the wire to land.
	if err := s.wait(int((i + sinkSlots - 1) % sinkSlots)); err != nil {
		return 0, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.landed, nil
}

func (s *gpuSink) flush() (int64, error) {
	for k := range s.queued {
		if err := s.wait(k); err != nil {
			return 0, err
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.landed, nil
}

func (s *gpuSink) close() {
	for _, st := range s.streams {
		if st != nil {
			st.Synchronize()
			st.Close()
		}
	}
	if s.pinned != nil {
		s.dev.FreeHost(s.pinned)
	}
	s.gpuMemory.close()
}
