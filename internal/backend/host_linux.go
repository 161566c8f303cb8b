package backend

import (
	"errors"
	"fmt"
	"os"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/wire"
)

// Host allocates sealed memfds: device 0 is the machine's RAM.
type Host struct {
	total int64
	pool  *pool
}

var _ segment.Allocator = (*Host)(nil)

// NewHost returns the host allocator.
func NewHost() (*Host, error) {
	var si unix.Sysinfo_t
	if err := unix.Sysinfo(&si); err != nil {
		return nil, fmt.Errorf("sysinfo: %w", err)
	}
	return &Host{total: int64(si.Totalram) * int64(si.Unit)}, nil
}

// HandleType implements segment.Allocator.
func (h *Host) HandleType() string { return wire.HandleMemfd }

// Capacity implements segment.Allocator.
func (h *Host) Capacity(device int) (int64, error) {
	if device != 0 {
		return 0, fmt.Errorf("%w: %d (the host backend has device 0 only)", segment.ErrNoDevice, device)
	}
	return h.total, nil
}

// Granularity is the page size: host sizes round up to it.
func (h *Host) Granularity() int64 { return int64(os.Getpagesize()) }

// Devices describes the one host device.
func (h *Host) Devices() ([]wire.Device, error) {
	var si unix.Sysinfo_t
	if err := unix.Sysinfo(&si); err != nil {
		return nil, fmt.Errorf("sysinfo: %w", err)
	}
	return []wire.Device{{
		Index:       0,
		Name:        "host memory",
		TotalBytes:  uint64(h.total),
		FreeBytes:   uint64(si.Freeram)*uint64(si.Unit) + uint64(h.pool.ready()),
		Granularity: h.Granularity(),
	}}, nil
}

// Allocate implements segment.Allocator. The memory is committed with
// fallocate, so running out shows here as ENOMEM rather than later as a
// SIGBUS in a client; the size is sealed, so no client can shrink it under
// another's mapping.
func (h *Host) Allocate(device int, size int64) (segment.Memory, error) {
	if _, err := h.Capacity(device); err != nil {
		return nil, err
	}
	g := h.Granularity()
	alloc := (size + g - 1) / g * g
	if m := h.pool.take(alloc); m != nil {
		return m, nil
	}
	m, err := h.allocate(alloc)
	if errors.Is(err, unix.ENOMEM) && h.pool.drain() {
		m, err = h.allocate(alloc)
	}
	return m, err
}

// Pool makes allocations ahead of creates, up to limit bytes (0: none).
func (h *Host) Pool(limit int64) {
	h.pool.close()
	h.pool = newPool(limit, h.allocate)
}

// PoolStats reports what the pool holds, for info.
func (h *Host) PoolStats() wire.Pool { return h.pool.stats() }

// Refill makes what creates took from the pool; the server calls it once
// their replies are sent.
func (h *Host) Refill() { h.pool.refill() }

// allocate makes a segment's memory: committed, and growable until its
// descriptor first leaves the daemon (hostgrow_linux.go).
func (h *Host) allocate(alloc int64) (segment.Memory, error) {
	m, err := makeMemfd("gpushm", alloc, func(m *hostMemory) error {
		if err := unix.Fallocate(m.fd, 0, 0, alloc); err != nil {
			return fmt.Errorf("fallocate: %w", noMem(err))
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	m.growable, m.committed = true, alloc
	return m, nil
}

// newMemfd makes a memfd of alloc bytes named for /proc/PID/fd, has
// commit make its pages (so that running out of memory is an error here,
// not a SIGBUS in a client later), and seals its size.
func newMemfd(name string, alloc int64, commit func(*hostMemory) error) (*hostMemory, error) {
	m, err := makeMemfd(name, alloc, commit)
	if err != nil {
		return nil, err
	}
	if err := seal(m.fd); err != nil {
		m.Free()
		return nil, err
	}
	return m, nil
}

// makeMemfd is newMemfd without the seals.
func makeMemfd(name string, alloc int64, commit func(*hostMemory) error) (*hostMemory, error) {
	fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, fmt.Errorf("memfd_create: %w", err)
	}
	m := &hostMemory{fd: fd, size: alloc}
	fail := func(err error) (*hostMemory, error) {
		m.Free()
		return nil, err
	}
	if err := unix.Ftruncate(fd, alloc); err != nil {
		return fail(fmt.Errorf("ftruncate: %w", err))
	}
	if err := commit(m); err != nil {
		return fail(err)
	}
	restrict(fd)
	return m, nil
}

// seal fixes the size of the memfd fd, and the seals themselves.
func seal(fd int) error {
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_SEAL); err != nil {
		return fmt.Errorf("seal: %w", err)
	}
	return nil
}

// noMem is the errno out of memory is reported as: fallocate says ENOSPC,
// a populate EFAULT.
func noMem(err error) error {
	if err == unix.ENOSPC || err == unix.EFAULT {
		return unix.ENOMEM
	}
	return err
}

// restrict takes the memfd's permission bits away from everyone but its
// owner (the daemon's user). A memfd is made with mode 0777, and whoever
// holds any descriptor of it may open it again through /proc/self/fd/N
// with the access those bits allow: a read-only descriptor handed to a
// client (memfd.ReadOnly) would then be no barrier. Descriptors already open
// keep their access. Failing (a published memfd owned by another user,
// with the daemon not root) leaves the bits as they were: the publisher
// chose them.
func restrict(fd int) {
	unix.Fchmod(fd, 0o600)
}

type hostMemory struct {
	fd     int
	size   int64
	view   hostView // the daemon's own mapping, for the FUSE view
	pooled bool     // made ahead of the create that took it
	// recycle, for spill memory, takes it back for reuse instead of a
	// free (Spill); false: free it.
	recycle func(*hostMemory) bool

	// A segment's memory is growable until its descriptor first leaves
	// the daemon (hostgrow_linux.go). grow guards size, growable and
	// committed while it is; once sealed, size never changes.
	grow      sync.Mutex
	growable  bool  // not sealed: Resize changes the size in place
	committed int64 // the first committed bytes have pages; all of size once sealed
}

// FromPool implements segment.Pooled, for a create's trace.
func (m *hostMemory) FromPool() bool { return m.pooled }
func (m *hostMemory) setPooled()     { m.pooled = true }

func (m *hostMemory) Free() error {
	if m.recycle != nil && m.recycle(m) {
		return nil
	}
	return errors.Join(m.view.unmap(), unix.Close(m.fd))
}

// Name implements server.Backend.
func (h *Host) Name() string { return "host" }

// DefaultDevice implements server.Backend.
func (h *Host) DefaultDevice() int { return 0 }

// Close implements Backend.
func (h *Host) Close() error {
	h.pool.close()
	return nil
}
