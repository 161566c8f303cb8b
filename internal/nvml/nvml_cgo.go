//go:build linux && cgo

package nvml

import (
	"errors"
	"fmt"
	"strings"
	"sync"

	"github.com/NVIDIA/go-nvml/pkg/dl"
	gonvml "github.com/NVIDIA/go-nvml/pkg/nvml"
)

// symbols lists, for each NVML call this package makes, the names go-nvml
// may bind it to (it picks the newest the library has): the library must
// have one of each.
var symbols = [][]string{
	{"nvmlInit_v2", "nvmlInit"},
	{"nvmlShutdown"},
	{"nvmlErrorString"},
	{"nvmlSystemGetDriverVersion"},
	{"nvmlDeviceGetCount_v2", "nvmlDeviceGetCount"},
	{"nvmlDeviceGetHandleByIndex_v2", "nvmlDeviceGetHandleByIndex"},
	{"nvmlDeviceGetName"},
	{"nvmlDeviceGetUUID"},
	{"nvmlDeviceGetMemoryInfo"},
	{"nvmlDeviceGetUtilizationRates"},
	{"nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2", "nvmlDeviceGetComputeRunningProcesses"},
}

// loaded is the library go-nvml loaded first. cgo binds each NVML call to
// the first library that provides it, for the life of the process, so a
// second library would load but never be called.
var (
	loadedMu sync.Mutex
	loaded   string
)

// NVML is an initialised NVML.
type NVML struct {
	lib    gonvml.Interface
	driver string
}

// Open loads path (Library when empty) and initialises NVML. It fails with
// ErrUnavailable when the library cannot be loaded or lacks a call this
// package makes, and with another error when the library loads but NVML
// does not work (no driver loaded, no permission, a driver/library
// mismatch).
func Open(path string) (*NVML, error) {
	if path == "" {
		path = Library
	}
	if err := probe(path); err != nil {
		return nil, err
	}
	loadedMu.Lock()
	defer loadedMu.Unlock()
	if loaded != "" && loaded != path {
		return nil, fmt.Errorf("%w: this process already uses NVML from %s, not %s", ErrUnavailable, loaded, path)
	}
	lib := gonvml.New(gonvml.WithLibraryPath(path))
	if r := lib.Init(); r != gonvml.SUCCESS {
		if r == gonvml.ERROR_LIBRARY_NOT_FOUND {
			return nil, fmt.Errorf("%w: %s: cannot load", ErrUnavailable, path)
		}
		return nil, callError("nvmlInit", r)
	}
	loaded = path
	n := &NVML{lib: lib}
	// A library that initialises but cannot count its GPUs is broken; say
	// so now rather than at every scrape.
	if _, r := lib.DeviceGetCount(); r != gonvml.SUCCESS {
		lib.Shutdown()
		return nil, callError("nvmlDeviceGetCount", r)
	}
	if v, r := lib.SystemGetDriverVersion(); r == gonvml.SUCCESS {
		n.driver = v
	}
	return n, nil
}

// probe checks, in a private handle, that path loads and has every symbol
// in symbols: go-nvml calls through cgo, and a missing symbol would kill the
// process at the first call.
func probe(path string) error {
	lib := dl.New(path, dl.RTLD_LAZY|dl.RTLD_LOCAL)
	if err := lib.Open(); err != nil {
		return fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	defer lib.Close()
	for _, names := range symbols {
		found := false
		for _, name := range names {
			if lib.Lookup(name) == nil {
				found = true
				break
			}
		}
		if !found {
			return fmt.Errorf("%w: %s has no %s", ErrUnavailable, path, strings.Join(names, " or "))
		}
	}
	return nil
}

func callError(call string, r gonvml.Return) error {
	return fmt.Errorf("%s: %s (NVML error %d)", call, r.Error(), int32(r))
}

// Driver is the driver version NVML reports ("580.65.06"), or "".
func (n *NVML) Driver() string { return n.driver }

// GPUs reads every GPU NVML sees. A GPU that cannot be read is left out
// and its error joined into the returned one, next to the GPUs that could.
func (n *NVML) GPUs() ([]GPU, error) {
	count, r := n.lib.DeviceGetCount()
	if r != gonvml.SUCCESS {
		return nil, callError("nvmlDeviceGetCount", r)
	}
	gpus := make([]GPU, 0, count)
	var errs []error
	for i := range count {
		g, err := n.gpu(i)
		if err != nil {
			errs = append(errs, fmt.Errorf("GPU %d: %w", i, err))
			continue
		}
		gpus = append(gpus, g)
	}
	return gpus, errors.Join(errs...)
}

func (n *NVML) gpu(i int) (GPU, error) {
	g := GPU{Index: i, Utilization: -1}
	d, r := n.lib.DeviceGetHandleByIndex(i)
	if r != gonvml.SUCCESS {
		return g, callError("nvmlDeviceGetHandleByIndex", r)
	}
	if g.UUID, r = d.GetUUID(); r != gonvml.SUCCESS {
		return g, callError("nvmlDeviceGetUUID", r)
	}
	if g.Name, r = d.GetName(); r != gonvml.SUCCESS {
		return g, callError("nvmlDeviceGetName", r)
	}
	mem, r := d.GetMemoryInfo()
	if r != gonvml.SUCCESS {
		return g, callError("nvmlDeviceGetMemoryInfo", r)
	}
	g.TotalBytes, g.UsedBytes, g.FreeBytes = mem.Total, mem.Used, mem.Free
	if u, r := d.GetUtilizationRates(); r == gonvml.SUCCESS {
		g.Utilization = int(u.Gpu)
	}
	procs, r := d.GetComputeRunningProcesses()
	if r != gonvml.SUCCESS {
		g.ProcessErr = callError("nvmlDeviceGetComputeRunningProcesses", r)
		return g, nil
	}
	g.Processes = make([]Process, 0, len(procs))
	for _, p := range procs {
		used := p.UsedGpuMemory
		if used == notAvailable {
			used = 0
		}
		g.Processes = append(g.Processes, Process{PID: p.Pid, UsedBytes: used})
	}
	return g, nil
}

// notAvailable is NVML_VALUE_NOT_AVAILABLE as an unsigned long long.
const notAvailable = ^uint64(0)

// Close shuts NVML down.
func (n *NVML) Close() error {
	if r := n.lib.Shutdown(); r != gonvml.SUCCESS {
		return callError("nvmlShutdown", r)
	}
	return nil
}
