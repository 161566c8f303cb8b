package cuda

import "errors"

// ErrNoDriver is returned, wrapped with the loader's reason, by Init and by
// everything else in the package when libcuda.so.1 cannot be loaded: no
// NVIDIA driver, a build without cgo, or a platform other than Linux.
var ErrNoDriver = errors.New("cuda: libcuda.so.1 not found")

// Handle is a CUmemGenericAllocationHandle: a reference to physical GPU
// memory created by Create or ImportFD. It carries no device; pass it back to
// the Device that produced it.
type Handle uint64
