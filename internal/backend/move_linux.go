package backend

import (
	"fmt"

	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/xfer"
)

var (
	_ segment.Mover     = (*Host)(nil)
	_ segment.Mover     = (*CUDA)(nil)
	_ segment.Allocator = Spill{}
)

// Spill allocates the host memory that segments are evicted to: sealed,
// committed memfds as Host makes them, named gpushm-spill. Making the
// pages is most of a first eviction's time (the kernel zeroes 4 KiB pages
// one at a time: 0.77 s at 4 GiB on an H200 machine); several threads
// populating one memfd at once (MADV_POPULATE_WRITE) were slower still
// (0.95 s), the shmem allocator being what they wait on.
type Spill struct{ *Host }

// Allocate implements segment.Allocator.
func (s Spill) Allocate(device int, size int64) (segment.Memory, error) {
	g := s.Granularity()
	return s.allocateNamed("gpushm-spill", (size+g-1)/g*g)
}

// Move implements segment.Mover: both memories are memfds, copied on
// several threads.
func (h *Host) Move(dst, src segment.Memory, n int64) error {
	d, ok1 := dst.(*hostMemory)
	s, ok2 := src.(*hostMemory)
	if !ok1 || !ok2 {
		return fmt.Errorf("move from %T to %T: not host memory", src, dst)
	}
	to, err := d.span(0, n)
	if err != nil {
		return err
	}
	from, err := s.span(0, n)
	if err != nil {
		return err
	}
	_, err = xfer.Move(xfer.Target{Host: to, Size: n}, from, true, nil)
	return err
}

// Move implements segment.Mover: between a GPU allocation and host
// memory, through the daemon's pinned buffers.
func (c *CUDA) Move(dst, src segment.Memory, n int64) error {
	gpu, in := dst.(*cudaMemory)
	h, ok := src.(*hostMemory)
	if !in {
		gpu, _ = src.(*cudaMemory)
		h, ok = dst.(*hostMemory)
	}
	if gpu == nil || !ok {
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
	b, err := h.span(0, n)
	if err != nil {
		return err
	}
	_, err = xfer.Move(t, b, in, nil)
	return err
}
