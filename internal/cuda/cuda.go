package cuda

import (
	"errors"
	"sync/atomic"
)

// ErrNoDriver is returned, wrapped with the loader's reason, by Init and by
// everything else in the package when libcuda.so.1 cannot be loaded: no
// NVIDIA driver, a build without cgo, or a platform other than Linux.
var ErrNoDriver = errors.New("cuda: libcuda.so.1 not found")

// Handle is a CUmemGenericAllocationHandle: a reference to physical GPU
// memory created by Create or ImportFD. It carries no device; pass it back to
// the Device that produced it.
type Handle uint64

var rdmaOff atomic.Bool

// DisableRDMA makes every allocation from now on without the RDMA flag,
// whatever the device allows (gpushm daemon --rdma off).
func DisableRDMA() { rdmaOff.Store(true) }
