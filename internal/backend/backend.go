package backend

import (
	"errors"
	"fmt"
	"log/slog"

	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/wire"
)

// Backend is an allocator the daemon can serve.
type Backend interface {
	segment.Allocator
	// Name is "cuda" or "host".
	Name() string
	Devices() ([]wire.Device, error)
	DefaultDevice() int
	// Adopt wraps memory a client allocated and sent (see CUDA.Adopt).
	Adopt(device int, fd int, size int64) (segment.Memory, error)
	// Restore takes back memory this daemon held before a restart.
	Restore(device int, fd int, alloc int64) (segment.Memory, error)
	// Pool makes allocations ahead of creates, up to limit bytes a device
	// (pool.go); PoolStats reports what it holds, for info; Refill makes
	// what creates took, once their replies are sent.
	Pool(limit int64)
	PoolStats() wire.Pool
	Refill()
	Close() error
}

var (
	_ Backend = (*Host)(nil)
	_ Backend = (*CUDA)(nil)
)

// Open picks a backend by name: "cuda", "host", or "auto" (cuda when a
// driver and a VMM-capable device are present, else host). devices is ""
// or "all" for every GPU, or a list of ordinals and UUIDs (see NewCUDA).
func Open(name string, devices string, log *slog.Logger) (Backend, error) {
	switch name {
	case "host":
		return NewHost()
	case "cuda":
		c, err := NewCUDA(devices)
		if err != nil {
			return nil, fmt.Errorf("cuda backend: %w", err)
		}
		return c, nil
	case "auto":
		c, err := NewCUDA(devices)
		if err == nil {
			return c, nil
		}
		if devices != "" && devices != "all" && !errors.Is(err, ErrNoGPU) {
			return nil, fmt.Errorf("cuda backend: %w", err)
		}
		log.Info("no usable GPU, serving host memory", "reason", err)
		return NewHost()
	}
	return nil, fmt.Errorf("unknown backend %q (want auto, cuda or host)", name)
}

// ErrNoGPU means the cuda backend cannot run on this machine at all.
var ErrNoGPU = errors.New("no usable GPU")

// within says why n bytes at off do not lie within memory of size bytes,
// or nil when they do.
func within(off, n, size int64) error {
	if off < 0 || n < 0 || off+n > size {
		return fmt.Errorf("%d bytes at %d outside %d bytes of memory", n, off, size)
	}
	return nil
}
