package backend

import (
	"errors"
	"fmt"
	"sync"

	"github.com/gpushm/gpushm/internal/cuda"
	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/xfer"
)

var (
	_ segment.Data    = (*cudaMemory)(nil)
	_ segment.Rounder = (*CUDA)(nil)
)

// RoundSize implements segment.Rounder: sizes round up to the device's
// allocation granularity.
func (c *CUDA) RoundSize(device int, size int64) int64 {
	d := c.devs[device]
	if d == nil {
		return size
	}
	return (size + d.gran - 1) / d.gran * d.gran
}

// cudaView is the daemon's own mapping of an allocation, made with the
// handle from Create on the first copy and kept until the memory is freed.
type cudaView struct {
	mu  sync.Mutex
	ptr uint64 // 0 until mapped
}

func (v *cudaView) unmap(d *cuda.Device, size int64) error {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.ptr == 0 {
		return nil
	}
	err := d.Unmap(v.ptr, size)
	v.ptr = 0
	return err
}

func (m *cudaMemory) mapped(off, n int64) (uint64, error) {
	if err := within(off, n, m.size); err != nil {
		return 0, err
	}
	m.view.mu.Lock()
	defer m.view.mu.Unlock()
	if m.view.ptr == 0 {
		ptr, err := m.d.Map(m.h, m.size, false, m.d)
		if err != nil {
			return 0, fmt.Errorf("map in the daemon: %w", err)
		}
		m.view.ptr = ptr
	}
	return m.view.ptr + uint64(off), nil
}

// stagingChunk is one pinned staging buffer: the largest FUSE request
// (MaxWrite), so that a request is one DMA.
const stagingChunk = 1 << 20

// maxStaging bounds the staging buffers per device, and so the copies in
// flight; a copy waits for a free buffer.
const maxStaging = 8

// slot is a pinned buffer with a stream of its own, so that copies of
// concurrent requests run on separate streams (and copy engines) instead of
// queueing on the legacy default stream.
type slot struct {
	buf    []byte
	stream *cuda.Stream
}

// stagingPool holds one device's slots. Pools live as long as the process,
// like the primary contexts they belong to.
type stagingPool struct {
	d    *cuda.Device
	sem  chan struct{}
	mu   sync.Mutex
	free []*slot
}

var pools struct {
	mu sync.Mutex
	m  map[*cuda.Device]*stagingPool
}

func poolFor(d *cuda.Device) *stagingPool {
	pools.mu.Lock()
	defer pools.mu.Unlock()
	if pools.m == nil {
		pools.m = make(map[*cuda.Device]*stagingPool)
	}
	p := pools.m[d]
	if p == nil {
		p = &stagingPool{d: d, sem: make(chan struct{}, maxStaging)}
		pools.m[d] = p
	}
	return p
}

func (p *stagingPool) get() (*slot, error) {
	p.sem <- struct{}{}
	p.mu.Lock()
	if n := len(p.free); n > 0 {
		s := p.free[n-1]
		p.free = p.free[:n-1]
		p.mu.Unlock()
		return s, nil
	}
	p.mu.Unlock()
	buf, err := p.d.AllocHost(stagingChunk)
	if err != nil {
		<-p.sem
		return nil, fmt.Errorf("pinned staging buffer: %w", err)
	}
	st, err := p.d.NewStream()
	if err != nil {
		p.d.FreeHost(buf)
		<-p.sem
		return nil, fmt.Errorf("staging stream: %w", err)
	}
	return &slot{buf: buf, stream: st}, nil
}

// put returns a slot whose copies have all completed.
func (p *stagingPool) put(s *slot) {
	p.mu.Lock()
	p.free = append(p.free, s)
	p.mu.Unlock()
	<-p.sem
}

// ReadAt implements segment.Data: device to pinned buffer, then to p, a
// chunk at a time.
func (m *cudaMemory) ReadAt(p []byte, off int64) error {
	ptr, err := m.mapped(off, int64(len(p)))
	if err != nil || len(p) == 0 {
		return err
	}
	pool := poolFor(m.d)
	s, err := pool.get()
	if err != nil {
		return err
	}
	defer pool.put(s)
	for done := 0; done < len(p); {
		n := min(len(p)-done, len(s.buf))
		if err := s.stream.CopyDtoHAsync(s.buf[:n], ptr+uint64(done)); err != nil {
			s.stream.Synchronize()
			return err
		}
		if err := s.stream.Synchronize(); err != nil {
			return err
		}
		copy(p[done:], s.buf[:n])
		done += n
	}
	return nil
}

// WriteAt implements segment.Data: p to a pinned buffer, then to the
// device, a chunk at a time; it returns when the last DMA has completed, so
// nothing is left in flight for Sync.
func (m *cudaMemory) WriteAt(p []byte, off int64) error {
	ptr, err := m.mapped(off, int64(len(p)))
	if err != nil || len(p) == 0 {
		return err
	}
	pool := poolFor(m.d)
	s, err := pool.get()
	if err != nil {
		return err
	}
	defer pool.put(s)
	for done := 0; done < len(p); {
		n := copy(s.buf, p[done:])
		if err := s.stream.CopyHtoDAsync(ptr+uint64(done), s.buf[:n]); err != nil {
			s.stream.Synchronize()
			return err
		}
		// The buffer is refilled next: the DMA must have read it.
		if err := s.stream.Synchronize(); err != nil {
			return err
		}
		done += n
	}
	return nil
}

// Zero implements segment.Data. cuMemsetD8 runs on the legacy default
// stream, which the staging streams do not wait for: synchronize before a
// later copy can overtake it.
func (m *cudaMemory) Zero(off, n int64) error {
	ptr, err := m.mapped(off, n)
	if err != nil || n == 0 {
		return err
	}
	return errors.Join(m.d.MemsetD8(ptr, 0, n), m.d.Synchronize())
}

// CopyFrom implements segment.Data: a device-to-device copy between the
// daemon's mappings of the two allocations.
func (m *cudaMemory) CopyFrom(src segment.Memory, n int64) error {
	s, ok := src.(*cudaMemory)
	if !ok || s.d != m.d {
		return fmt.Errorf("copy from %T on another device to cuda memory", src)
	}
	from, err := s.mapped(0, n)
	if err != nil {
		return err
	}
	to, err := m.mapped(0, n)
	if err != nil {
		return err
	}
	return errors.Join(m.d.CopyDtoD(to, from, n), m.d.Synchronize())
}

// Sync implements segment.Data: every copy above completes before it
// returns, so there is nothing to wait for.
func (m *cudaMemory) Sync() error { return nil }

// copyKits lends the copy engine's copiers (fill, dump) their pinned
// buffers and streams, one pool a device for the life of the process.
var copyKits struct {
	mu sync.Mutex
	m  map[*cuda.Device]*xfer.Pool
}

// maxCopyKits bounds the daemon's pinned memory for copies: 32 kits of
// two 8 MiB buffers, 512 MiB, made as copies first ask. A copy takes at
// most half (xfer.Pool), as many as its copiers (16 at most): one alone
// runs at full width, and so does one beside a copy stuck in its reads.
const maxCopyKits = 32

// XferTarget implements server.XferTarget: the daemon's own mapping.
func (m *cudaMemory) XferTarget() (xfer.Target, error) {
	ptr, err := m.mapped(0, m.size)
	if err != nil {
		return xfer.Target{}, err
	}
	copyKits.mu.Lock()
	defer copyKits.mu.Unlock()
	if copyKits.m == nil {
		copyKits.m = make(map[*cuda.Device]*xfer.Pool)
	}
	p := copyKits.m[m.d]
	if p == nil {
		p = xfer.NewPool(m.d, maxCopyKits)
		copyKits.m[m.d] = p
	}
	return xfer.Target{Dev: m.d, Ptr: ptr, Size: m.size, Buffers: p}, nil
}
