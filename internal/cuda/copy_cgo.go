//go:build linux && cgo

package cuda

// Copies between host and device, and pinned (page-locked) host memory.

// #include "driver.h"
import "C"

import (
	"fmt"
	"sync"
	"unsafe"
)

// CopyHtoD copies src to device address dst and returns once src may be
// reused.
func (d *Device) CopyHtoD(dst uint64, src []byte) error {
	if len(src) == 0 {
		return d.check()
	}
	return d.withCtx(func() error {
		return wrap("cuMemcpyHtoD", C.gs_cuMemcpyHtoD(C.CUdeviceptr(dst), unsafe.Pointer(&src[0]), C.size_t(len(src))))
	})
}

// CopyDtoH copies len(dst) bytes from device address src into dst.
func (d *Device) CopyDtoH(dst []byte, src uint64) error {
	if len(dst) == 0 {
		return d.check()
	}
	return d.withCtx(func() error {
		return wrap("cuMemcpyDtoH", C.gs_cuMemcpyDtoH(unsafe.Pointer(&dst[0]), C.CUdeviceptr(src), C.size_t(len(dst))))
	})
}

// CopyDtoD copies n bytes between device addresses; it is asynchronous with
// respect to the host, so call Synchronize before depending on the result
// from another stream or process.
func (d *Device) CopyDtoD(dst, src uint64, n int64) error {
	if n < 0 {
		return fmt.Errorf("cuda: copy of %d bytes: %w", n, ErrInvalidValue)
	}
	if n == 0 {
		return d.check()
	}
	return d.withCtx(func() error {
		return wrap("cuMemcpyDtoD", C.gs_cuMemcpyDtoD(C.CUdeviceptr(dst), C.CUdeviceptr(src), C.size_t(n)))
	})
}

// MemsetD8 sets n bytes at dst to v; like CopyDtoD it may complete after it
// returns.
func (d *Device) MemsetD8(dst uint64, v byte, n int64) error {
	if n < 0 {
		return fmt.Errorf("cuda: memset of %d bytes: %w", n, ErrInvalidValue)
	}
	if n == 0 {
		return d.check()
	}
	return d.withCtx(func() error {
		return wrap("cuMemsetD8", C.gs_cuMemsetD8(C.CUdeviceptr(dst), C.uchar(v), C.size_t(n)))
	})
}

// Synchronize waits for all work queued in d's primary context.
func (d *Device) Synchronize() error {
	return d.withCtx(func() error {
		return wrap("cuCtxSynchronize", C.gs_cuCtxSynchronize())
	})
}

// pinned records the buffers AllocHost returned, as base address to length,
// so that FreeHost only frees what AllocHost allocated and async copies can
// refuse Go memory, which the driver would read after the call returned.
var pinned struct {
	mu sync.RWMutex
	m  map[uintptr]int
}

func sliceAddr(b []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }

func isPinned(b []byte) bool {
	p, n := sliceAddr(b), uintptr(len(b))
	pinned.mu.RLock()
	defer pinned.mu.RUnlock()
	for base, size := range pinned.m {
		if p >= base && p-base <= uintptr(size) && n <= uintptr(size)-(p-base) {
			return true
		}
	}
	return false
}

// AllocHost allocates n bytes of page-locked host memory for async copies.
// The slice is backed by that memory, not by the Go heap; pass the slice
// itself (not a reslice) to FreeHost.
func (d *Device) AllocHost(n int64) ([]byte, error) {
	if n <= 0 || uint64(n) > uint64(^uint(0)>>1) {
		return nil, fmt.Errorf("cuda: pinned allocation of %d bytes: %w", n, ErrInvalidValue)
	}
	var p unsafe.Pointer
	err := d.withCtx(func() error {
		return wrap("cuMemAllocHost", C.gs_cuMemAllocHost(&p, C.size_t(n)))
	})
	if err != nil {
		return nil, err
	}
	b := unsafe.Slice((*byte)(p), int(n))
	pinned.mu.Lock()
	if pinned.m == nil {
		pinned.m = make(map[uintptr]int)
	}
	pinned.m[uintptr(p)] = int(n)
	pinned.mu.Unlock()
	return b, nil
}

// FreeHost frees a buffer returned by AllocHost; b must start where that
// buffer starts.
func (d *Device) FreeHost(b []byte) error {
	if err := d.check(); err != nil {
		return err
	}
	if len(b) == 0 {
		return fmt.Errorf("cuda: free of an empty pinned buffer: %w", ErrInvalidValue)
	}
	base := sliceAddr(b)
	pinned.mu.Lock()
	n, ok := pinned.m[base]
	if ok {
		delete(pinned.m, base)
	}
	pinned.mu.Unlock()
	if !ok {
		return fmt.Errorf("cuda: free of a buffer not returned by AllocHost: %w", ErrInvalidValue)
	}
	p := unsafe.Pointer(unsafe.SliceData(b))
	err := d.withCtx(func() error {
		return wrap("cuMemFreeHost", C.gs_cuMemFreeHost(p))
	})
	if err != nil {
		pinned.mu.Lock()
		pinned.m[base] = n
		pinned.mu.Unlock()
	}
	return err
}

// RegisterHost pins b (shared memory, say) for every context and returns
// its address on the GPUs, for stream memory operations on it.
func (d *Device) RegisterHost(b []byte) (uint64, error) {
	if len(b) == 0 {
		return 0, fmt.Errorf("cuda: register 0 bytes: %w", ErrInvalidValue)
	}
	var ptr C.CUdeviceptr
	err := d.withCtx(func() error {
		if err := wrap("cuMemHostRegister", C.gs_hostRegister(unsafe.Pointer(&b[0]), C.size_t(len(b)))); err != nil {
			return err
		}
		if err := wrap("cuMemHostGetDevicePointer", C.gs_hostDevicePointer(&ptr, unsafe.Pointer(&b[0]))); err != nil {
			C.gs_hostUnregister(unsafe.Pointer(&b[0]))
			return err
		}
		return nil
	})
	return uint64(ptr), err
}

// UnregisterHost undoes RegisterHost.
func (d *Device) UnregisterHost(b []byte) error {
	if len(b) == 0 {
		return nil
	}
	return d.withCtx(func() error {
		return wrap("cuMemHostUnregister", C.gs_hostUnregister(unsafe.Pointer(&b[0])))
	})
}
