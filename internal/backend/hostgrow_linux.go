package backend

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm/internal/segment"
)

// Growable host memory. A segment's memfd is sealed against growing and
// shrinking before its descriptor first leaves the daemon (FD), so that no
// client can change the size of memory another process maps
// (docs/security.md). Until then only the daemon holds it, and a file the
// FUSE view grows is extended in place (Resize, with ftruncate) instead of
// being copied into ever larger memory.
//
// What growing adds is not committed: its pages come as the daemon writes
// them, not zeroed first, as a file of tmpfs gets them. The daemon commits
// the rest (fallocate) before the descriptor leaves it and before mapping
// the memfd itself, so that running out of memory is an error there
// (ENOMEM), never a SIGBUS in a process that maps it. While growable, the
// daemon reads and writes the memfd with pread and pwrite, not through a
// mapping, and punches out what it zeroes.
//
// The journal's copy of the descriptor (JournalFD) goes to the daemon's
// own supervisor, which keeps it for the next serving process only; it
// stays growable, and Restore takes it back so.

var (
	_ segment.Resizer   = (*hostMemory)(nil)
	_ segment.Journaled = (*hostMemory)(nil)
	_ segment.Lender    = (*hostMemory)(nil)
)

// FD implements segment.Memory. The descriptor goes to another process:
// a growable memfd is committed and sealed first.
func (m *hostMemory) FD() (int, error) {
	m.grow.Lock()
	defer m.grow.Unlock()
	if !m.growable {
		return m.fd, nil
	}
	if err := m.commitLocked(); err != nil {
		return -1, err
	}
	if err := seal(m.fd); err != nil {
		return -1, err
	}
	m.growable = false
	return m.fd, nil
}

// JournalFD implements segment.Journaled: the descriptor, left growable.
func (m *hostMemory) JournalFD() (int, error) { return m.fd, nil }

// Size implements segment.Memory.
func (m *hostMemory) Size() int64 {
	m.grow.Lock()
	defer m.grow.Unlock()
	return m.size
}

// Resize implements segment.Resizer: ftruncate, while the memfd is
// growable. The caller holds the segment's io lock exclusively, so nobody
// uses the daemon's mapping, which is of the old size: it goes, and the
// next use maps the new size.
func (m *hostMemory) Resize(size int64, commit bool) error {
	g := int64(os.Getpagesize())
	size = (size + g - 1) / g * g
	if size <= 0 {
		return fmt.Errorf("resize to %d bytes: %w", size, unix.EINVAL)
	}
	m.grow.Lock()
	defer m.grow.Unlock()
	if !m.growable {
		return segment.ErrFixed
	}
	if err := m.view.unmap(); err != nil {
		return err
	}
	if err := unix.Ftruncate(m.fd, size); err != nil {
		return fmt.Errorf("ftruncate to %d bytes: %w", size, noMem(err))
	}
	m.size = size
	m.committed = min(m.committed, size)
	if commit {
		return m.commitLocked()
	}
	return nil
}

// Lend implements segment.Lender: the daemon's own mapping, made (and a
// growable memfd committed) on first use.
func (m *hostMemory) Lend(off, n int64) ([]byte, error) { return m.span(off, n) }

// commitLocked gives every byte of a growable memfd a page. grow is held.
func (m *hostMemory) commitLocked() error {
	if !m.growable || m.committed >= m.size {
		return nil
	}
	if err := unix.Fallocate(m.fd, 0, m.committed, m.size-m.committed); err != nil {
		return fmt.Errorf("fallocate %d bytes at %d: %w", m.size-m.committed, m.committed, noMem(err))
	}
	m.committed = m.size
	return nil
}

// commit is commitLocked, before the daemon maps the memfd.
func (m *hostMemory) commit() error {
	m.grow.Lock()
	defer m.grow.Unlock()
	return m.commitLocked()
}

// growing reports whether the memfd is growable: the daemon then reads
// and writes it with pread and pwrite.
func (m *hostMemory) growing() bool {
	m.grow.Lock()
	defer m.grow.Unlock()
	return m.growable
}

// pread fills p from off.
func (m *hostMemory) pread(p []byte, off int64) error {
	if err := within(off, int64(len(p)), m.size); err != nil {
		return err
	}
	for len(p) > 0 {
		n, err := unix.Pread(m.fd, p, off)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return fmt.Errorf("pread: %w", err)
		}
		if n == 0 {
			return fmt.Errorf("pread at %d: short file: %w", off, unix.EIO)
		}
		p, off = p[n:], off+int64(n)
	}
	return nil
}

// pwrite copies p to off; a page it meets that has no memory gets it
// (ENOMEM without).
func (m *hostMemory) pwrite(p []byte, off int64) error {
	if err := within(off, int64(len(p)), m.size); err != nil {
		return err
	}
	for len(p) > 0 {
		n, err := unix.Pwrite(m.fd, p, off)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return fmt.Errorf("pwrite: %w", noMem(err))
		}
		m.wrote(off, int64(n))
		p, off = p[n:], off+int64(n)
	}
	return nil
}

// wrote notes that n bytes at off were written, so have pages: a file
// written from its start, as cp writes one, has nothing left to commit.
func (m *hostMemory) wrote(off, n int64) {
	g := int64(os.Getpagesize())
	m.grow.Lock()
	defer m.grow.Unlock()
	if off <= m.committed {
		m.committed = max(m.committed, min((off+n+g-1)/g*g, m.size))
	}
}

// zeros is what pzero writes from.
var zeros = make([]byte, 64<<10)

// pzero clears n bytes at off: it punches out the whole pages (a hole
// reads as zeros and holds no memory) and writes zeros at the ends; or
// writes zeros throughout where a hole could be mapped (the daemon maps
// the memfd, or its descriptor was handed out meanwhile).
func (m *hostMemory) pzero(off, n int64) error {
	if err := within(off, n, m.size); err != nil {
		return err
	}
	g := int64(os.Getpagesize())
	lo, hi := min((off+g-1)/g*g, off+n), max((off+n)/g*g, off)
	if hi > lo {
		punched, err := m.punch(lo, hi-lo)
		if err != nil {
			return err
		}
		if !punched {
			lo, hi = off+n, off+n
		}
	} else {
		lo, hi = off+n, off+n
	}
	for _, r := range [][2]int64{{off, lo}, {hi, off + n}} {
		for o := r[0]; o < r[1]; {
			k := min(r[1]-o, int64(len(zeros)))
			if err := m.pwrite(zeros[:k], o); err != nil {
				return err
			}
			o += k
		}
	}
	return nil
}

// punch makes n bytes at off a hole, if no mapping can meet it: the
// memfd is growable and the daemon does not map it.
func (m *hostMemory) punch(off, n int64) (bool, error) {
	m.grow.Lock()
	defer m.grow.Unlock()
	m.view.mu.Lock()
	mapped := m.view.b != nil
	m.view.mu.Unlock()
	if !m.growable || mapped {
		return false, nil
	}
	if err := unix.Fallocate(m.fd, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, off, n); err != nil {
		return false, fmt.Errorf("punch %d bytes at %d: %w", n, off, err)
	}
	m.committed = min(m.committed, off)
	return true, nil
}
