package nvml

import "errors"

// Library is the name Open loads when given none.
const Library = "libnvidia-ml.so.1"

// ErrUnavailable means NVML cannot be loaded here: no library, a build
// without cgo, or a library that lacks the calls this package makes. Other
// errors from Open mean the library loaded but NVML failed.
var ErrUnavailable = errors.New("nvml unavailable")

// GPU is one GPU as NVML reports it.
type GPU struct {
	Index int // NVML's index, in PCI bus order; not necessarily CUDA's ordinal
	Name  string
	UUID  string // "GPU-..."
	// Memory in bytes, as nvmlDeviceGetMemoryInfo reports it: Used counts
	// every process's allocations and the driver's own reservations.
	TotalBytes, UsedBytes, FreeBytes uint64
	// Utilization is the percentage of the last sample period in which a
	// kernel ran, or -1 where NVML cannot say (MIG, some virtual GPUs).
	Utilization int
	// Processes are the compute processes holding memory on the GPU, or nil
	// with ProcessErr set when NVML could not list them.
	Processes  []Process
	ProcessErr error
}

// Process is one process with memory on a GPU.
type Process struct {
	PID uint32
	// UsedBytes is the GPU memory NVML charges to the process, or 0 where it
	// cannot tell (NVML_VALUE_NOT_AVAILABLE, e.g. under some virtual GPUs).
	UsedBytes uint64
}
