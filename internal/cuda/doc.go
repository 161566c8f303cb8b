// Package cuda is a thin layer over the CUDA driver API, one of the
// project's two cgo packages (internal/ucx is the other), for sharing GPU
// memory between processes through the virtual memory management (VMM)
// calls cuMemCreate, cuMemExportToShareableHandle,
// cuMemImportFromShareableHandle, cuMemMap and cuMemSetAccess.
//
// Invariants the rest of the project relies on:
//
//   - The driver is loaded at run time with dlopen("libcuda.so.1"); nothing
//     links against CUDA, so binaries build and start on machines without a
//     GPU and Init reports ErrNoDriver there. The few cuda.h types and
//     constants used are copied into the cgo preamble; the versioned (_v2)
//     symbols are resolved by name, and a symbol the driver lacks fails Init
//     with an error naming it instead of crashing later. Init resolves every
//     symbol and calls cuInit(0) once; every other entry point calls Init
//     first and returns its error if it failed.
//
//   - Each device's primary context is retained once, on the first GetDevice
//     for its ordinal, and never released: it lives as long as the process.
//     Creating a primary context costs GPU memory (hundreds of MiB), so open
//     only the devices you use.
//
//   - Callers never see contexts. Each method that needs one locks the calling
//     goroutine to its OS thread, makes the device's primary context current
//     with cuCtxSetCurrent, makes the driver call and unlocks; the driver's
//     notion of "current context" is per OS thread, and without the lock the Go
//     scheduler could move the goroutine between the two calls.
//
//   - Never fork after Init: the CUDA driver does not support use from a
//     forked child. Start helper processes with os/exec (fork+exec) only.
//
//   - File descriptors: ExportFD returns a new descriptor that the caller owns
//     and must close. ImportFD does not take ownership of the descriptor it is
//     given; the caller closes it when convenient (the imported Handle stays
//     valid after the close). Handles from Create and ImportFD must each be
//     released with Release; a mapping keeps the physical memory alive until
//     Unmap even after its handle is released.
//
//   - Every driver failure is returned as an error wrapping a Result, named
//     after the call, so callers can test errors.Is(err, ErrOutOfMemory).
package cuda
