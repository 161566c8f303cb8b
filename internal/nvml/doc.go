// Package nvml reads what the NVIDIA Management Library knows about the
// node's GPUs: memory used and total, utilisation, and the processes using
// each GPU. It is the one package that imports github.com/NVIDIA/go-nvml.
//
// Invariants the rest of the project relies on:
//
//   - libnvidia-ml.so.1 is loaded at run time with dlopen; nothing links
//     against it, so binaries start on machines without NVIDIA's driver and
//     Open reports ErrUnavailable there. Before go-nvml loads the library,
//     Open checks that it has every symbol this package calls, so a stray or
//     partial library is an error at Open, never a crash at a call.
//   - A build without cgo, or for another platform, compiles and reports
//     ErrUnavailable: NVML is optional everywhere.
//   - A process uses one NVML library: cgo binds each call to the first
//     library loaded, so Open refuses a second path.
//   - NVML is thread-safe; an *NVML may be used from many goroutines.
//     Open initialises NVML and Close shuts it down once.
//   - Process IDs are those NVML reports, which are the host's: inside a
//     container with its own PID namespace they name other processes, or
//     none. Turning them into names is the caller's business.
package nvml
