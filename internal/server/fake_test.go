package server_test

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/server"
	"github.com/gpushm/gpushm/internal/wire"
)

// fakeBackend is an allocator written for the tests that need one and
// nothing of a real backend (../shared/STYLE.md, "A fake allocator"):
// one device of fakeCapacity bytes, each allocation a memfd of its size,
// rounded up to the page, handed out as the host backend's are.
type fakeBackend struct{}

const fakeCapacity = 1 << 30

var _ server.Backend = fakeBackend{}

func (fakeBackend) Allocate(device int, size int64) (segment.Memory, error) {
	if device != 0 {
		return nil, fmt.Errorf("%w: %d (the fake has device 0 only)", segment.ErrNoDevice, device)
	}
	page := int64(os.Getpagesize())
	size = (size + page - 1) / page * page
	fd, err := unix.MemfdCreate("gpushm-fake", unix.MFD_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("memfd_create: %w", err)
	}
	if err := unix.Ftruncate(fd, size); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("ftruncate: %w", err)
	}
	return fakeMemory{fd: fd, size: size}, nil
}

func (fakeBackend) Capacity(device int) (int64, error) {
	if device != 0 {
		return 0, fmt.Errorf("%w: %d", segment.ErrNoDevice, device)
	}
	return fakeCapacity, nil
}

func (fakeBackend) HandleType() string { return wire.HandleMemfd }
func (fakeBackend) Name() string       { return "fake" }
func (fakeBackend) DefaultDevice() int { return 0 }

func (fakeBackend) Devices() ([]wire.Device, error) {
	return []wire.Device{{Name: "fake", TotalBytes: fakeCapacity, FreeBytes: fakeCapacity, Granularity: int64(os.Getpagesize())}}, nil
}

// Adopt takes fd as it is: the tests that publish memory run on the host
// backend, which checks it.
func (fakeBackend) Adopt(device int, fd int, size int64) (segment.Memory, error) {
	return fakeMemory{fd: fd, size: size}, nil
}

// fakeMemory is a memfd that the fake allocated or adopted.
type fakeMemory struct {
	fd   int
	size int64
}

func (m fakeMemory) FD() (int, error) { return m.fd, nil }
func (m fakeMemory) Size() int64      { return m.size }
func (m fakeMemory) Free() error      { return unix.Close(m.fd) }
