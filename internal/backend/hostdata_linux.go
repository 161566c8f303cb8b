package backend

import (
	"fmt"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/xfer"
)

var (
	_ segment.Data    = (*hostMemory)(nil)
	_ segment.Rounder = (*Host)(nil)
)

// RoundSize implements segment.Rounder: host sizes round up to a page.
func (h *Host) RoundSize(_ int, size int64) int64 {
	g := h.Granularity()
	return (size + g - 1) / g * g
}

// hostView is the daemon's own mapping of a memfd, made on the first copy
// and kept until the memory is freed. It may be longer than the memory's
// size: a memfd of hugetlbfs is mapped in whole huge pages (munmap refuses
// a length that is not one).
type hostView struct {
	mu sync.Mutex
	b  []byte // the whole mapping
}

func (v *hostView) unmap() error {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.b == nil {
		return nil
	}
	err := unix.Munmap(v.b)
	v.b = nil
	if err != nil {
		return fmt.Errorf("munmap: %w", err)
	}
	return nil
}

func (m *hostMemory) bytes() ([]byte, error) {
	if err := m.commit(); err != nil {
		return nil, err
	}
	m.view.mu.Lock()
	defer m.view.mu.Unlock()
	if m.view.b == nil {
		b, err := unix.Mmap(m.fd, 0, int(mapLength(m.fd, m.size)), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
		if err != nil {
			return nil, fmt.Errorf("mmap: %w", err)
		}
		m.view.b = b
	}
	return m.view.b[:m.size], nil
}

// mapLength is how much of the memfd fd to map for size bytes: size, or
// size in whole huge pages on hugetlbfs (spill memory of the reserve, or
// such memory restored after a restart).
func mapLength(fd int, size int64) int64 {
	var fs unix.Statfs_t
	if unix.Fstatfs(fd, &fs) != nil || fs.Type != unix.HUGETLBFS_MAGIC || fs.Bsize <= 0 {
		return size
	}
	return (size + fs.Bsize - 1) / fs.Bsize * fs.Bsize
}

func (m *hostMemory) span(off, n int64) ([]byte, error) {
	b, err := m.bytes()
	if err != nil {
		return nil, err
	}
	if err := within(off, n, m.size); err != nil {
		return nil, err
	}
	return b[off : off+n], nil
}

// ReadAt implements segment.Data.
func (m *hostMemory) ReadAt(p []byte, off int64) error {
	if m.growing() {
		return m.pread(p, off)
	}
	b, err := m.span(off, int64(len(p)))
	if err != nil {
		return err
	}
	copy(p, b)
	return nil
}

// WriteAt implements segment.Data.
func (m *hostMemory) WriteAt(p []byte, off int64) error {
	if m.growing() {
		return m.pwrite(p, off)
	}
	b, err := m.span(off, int64(len(p)))
	if err != nil {
		return err
	}
	copy(b, p)
	return nil
}

// Zero implements segment.Data.
func (m *hostMemory) Zero(off, n int64) error {
	if m.growing() {
		return m.pzero(off, n)
	}
	b, err := m.span(off, n)
	if err != nil {
		return err
	}
	clear(b)
	return nil
}

// CopyFrom implements segment.Data.
func (m *hostMemory) CopyFrom(src segment.Memory, n int64) error {
	if p, ok := src.(*partsMemory); ok {
		to, err := m.span(0, n)
		if err != nil {
			return err
		}
		return p.ReadAt(to, 0)
	}
	s, ok := src.(*hostMemory)
	if !ok {
		return fmt.Errorf("copy from %T to host memory", src)
	}
	from, err := s.span(0, n)
	if err != nil {
		return err
	}
	to, err := m.span(0, n)
	if err != nil {
		return err
	}
	copy(to, from)
	return nil
}

// Sync implements segment.Data: a store to a shared mapping is visible to
// every other mapping at once.
func (m *hostMemory) Sync() error { return nil }

// XferTarget implements server.XferTarget: the daemon's own mapping.
func (m *hostMemory) XferTarget() (xfer.Target, error) {
	b, err := m.bytes()
	if err != nil {
		return xfer.Target{}, err
	}
	return xfer.Target{Host: b, Size: m.size}, nil
}
