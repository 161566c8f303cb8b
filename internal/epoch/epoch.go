// Package epoch is a counter in a shared memory page that the daemon bumps
// whenever a name stops meaning the segment it meant (unlink, rename, a change
// of owner or mode). Clients map the page read-only and compare it with the
// value they saw at open time: when it has not moved, a name they already hold
// mapped still names the same segment, so a second open needs no round trip.
//
// The page is a sealed memfd; the daemon owns its descriptor and sends a copy
// with the reply to hello. It uses unsafe, as internal/cuda does and the
// root package's mapping.go (MAP_FIXED at a kept range): atomics on shared
// memory need a *uint64.
package epoch

import (
	"fmt"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

const pageSize = 4096

// Page is a mapped epoch page.
type Page struct {
	mem []byte
	v   *atomic.Uint64
	fd  int // owned, -1 for a page mapped by a client
}

// New makes a writable page for the daemon.
func New() (*Page, error) {
	fd, err := unix.MemfdCreate("gpushm-epoch", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, fmt.Errorf("epoch page: memfd_create: %w", err)
	}
	if err := unix.Ftruncate(fd, pageSize); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("epoch page: ftruncate: %w", err)
	}
	// Seals stop anyone holding a descriptor from resizing the page under
	// the daemon (a SIGBUS). Clients get a read-only descriptor of it
	// (opened again through /proc/self/fd), which cannot be mapped
	// writable.
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_SEAL); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("epoch page: seal: %w", err)
	}
	restrict(fd)
	mem, err := unix.Mmap(fd, 0, pageSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("epoch page: mmap: %w", err)
	}
	p := &Page{mem: mem, fd: fd, v: (*atomic.Uint64)(unsafe.Pointer(&mem[0]))}
	p.v.Store(1)
	return p, nil
}

// Map maps a page received from the daemon, read-only. It does not take
// ownership of fd.
func Map(fd int) (*Page, error) {
	mem, err := mapPage(fd, 8, 1<<62, unix.PROT_READ)
	if err != nil {
		return nil, err
	}
	return &Page{mem: mem, fd: -1, v: (*atomic.Uint64)(unsafe.Pointer(&mem[0]))}, nil
}

// mapPage maps the page at fd, whose size must lie between least and most.
func mapPage(fd int, least, most int64, prot int) ([]byte, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("epoch page: fstat: %w", err)
	}
	if st.Size < least || st.Size > most {
		return nil, fmt.Errorf("epoch page: %d bytes, want %d", st.Size, pageSize)
	}
	mem, err := unix.Mmap(fd, 0, pageSize, prot, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("epoch page: mmap: %w", err)
	}
	return mem, nil
}

// FD is the daemon's descriptor of the page (-1 in a client).
func (p *Page) FD() int { return p.fd }

// Load reads the current epoch.
func (p *Page) Load() uint64 { return p.v.Load() }

// Bump advances the epoch (daemon only).
func (p *Page) Bump() { p.v.Add(1) }

// Close unmaps the page and closes the daemon's descriptor.
func (p *Page) Close() error {
	err := unix.Munmap(p.mem)
	if p.fd >= 0 {
		unix.Close(p.fd)
		p.fd = -1
	}
	return err
}

// Open maps, writable, a page another process made with New and handed
// over (a daemon's supervisor keeps the page across restarts, so that
// clients' cached opens stay valid). The Page owns fd.
func Open(fd int) (*Page, error) {
	restrict(fd) // made by an older daemon, perhaps
	mem, err := mapPage(fd, pageSize, pageSize, unix.PROT_READ|unix.PROT_WRITE)
	if err != nil {
		return nil, err
	}
	return &Page{mem: mem, fd: fd, v: (*atomic.Uint64)(unsafe.Pointer(&mem[0]))}, nil
}

// restrict leaves the page's permission bits to its owner: a memfd is made
// with mode 0777, and whoever holds a read-only descriptor of it could
// open it again, writable, through /proc/self/fd/N if the bits let them.
func restrict(fd int) { unix.Fchmod(fd, 0o600) }
