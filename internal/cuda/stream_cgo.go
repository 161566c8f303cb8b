//go:build linux && cgo

package cuda

// Streams and events: asynchronous copies, and the stream memory
// operations channels wait and signal with.

// #include "driver.h"
import "C"

import (
	"fmt"
	"sync"
	"unsafe"
)

var errClosed = fmt.Errorf("cuda: use of a closed or zero stream or event: %w", ErrInvalidHandle)

// Stream is a non-blocking CUDA stream of one device's primary context. Its
// methods are safe for concurrent use, Close included.
type Stream struct {
	d       *Device
	mu      sync.RWMutex // held for writing only by Close, so no call uses a destroyed stream
	s       C.CUstream
	foreign bool // made by someone else: Close leaves it alone
}

// NewStream creates a stream that does not synchronize with the legacy
// default stream, so copies queued on it can overlap other work.
func (d *Device) NewStream() (*Stream, error) {
	var s C.CUstream
	err := d.withCtx(func() error {
		return wrap("cuStreamCreate", C.gs_cuStreamCreate(&s))
	})
	if err != nil {
		return nil, err
	}
	return &Stream{d: d, s: s}, nil
}

// use runs fn with the stream's device context current and the stream
// guaranteed open.
func (s *Stream) use(fn func(C.CUstream) error) error {
	if s == nil {
		return errClosed
	}
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.s == nil {
		if err := Init(); err != nil {
			return err
		}
		return errClosed
	}
	return s.d.withCtx(func() error { return fn(s.s) })
}

// CopyHtoDAsync queues a copy of src to dst. src must lie within a buffer
// from AllocHost and must not change until the stream is synchronized.
func (s *Stream) CopyHtoDAsync(dst uint64, src []byte) error {
	if len(src) > 0 && !isPinned(src) {
		return fmt.Errorf("cuda: async copy source is not pinned memory from AllocHost: %w", ErrInvalidValue)
	}
	return s.use(func(cs C.CUstream) error {
		if len(src) == 0 {
			return nil
		}
		return wrap("cuMemcpyHtoDAsync", C.gs_cuMemcpyHtoDAsync(C.CUdeviceptr(dst), unsafe.Pointer(&src[0]), C.size_t(len(src)), cs))
	})
}

// CopyDtoDAsync queues a copy of n bytes between device addresses, run by
// the stream's device: src may be another GPU's memory mapped with access
// for this one.
func (s *Stream) CopyDtoDAsync(dst, src uint64, n int64) error {
	if n < 0 {
		return fmt.Errorf("cuda: copy of %d bytes: %w", n, ErrInvalidValue)
	}
	return s.use(func(cs C.CUstream) error {
		if n == 0 {
			return nil
		}
		return wrap("cuMemcpyDtoDAsync", C.gs_cuMemcpyDtoDAsync(C.CUdeviceptr(dst), C.CUdeviceptr(src), C.size_t(n), cs))
	})
}

// CopyPeerAsync queues cuMemcpyPeerAsync: n bytes from src on srcDev to
// dst on dstDev.
func (s *Stream) CopyPeerAsync(dst uint64, dstDev *Device, src uint64, srcDev *Device, n int64) error {
	if err := dstDev.check(); err != nil {
		return err
	}
	if err := srcDev.check(); err != nil {
		return err
	}
	return s.use(func(cs C.CUstream) error {
		return wrap("cuMemcpyPeerAsync", C.gs_cuMemcpyPeerAsync(C.CUdeviceptr(dst), dstDev.ctx, C.CUdeviceptr(src), srcDev.ctx, C.size_t(n), cs))
	})
}

// CopyDtoHAsync queues a copy from src into dst. dst must lie within a buffer
// from AllocHost and is not filled until the stream is synchronized.
func (s *Stream) CopyDtoHAsync(dst []byte, src uint64) error {
	if len(dst) > 0 && !isPinned(dst) {
		return fmt.Errorf("cuda: async copy destination is not pinned memory from AllocHost: %w", ErrInvalidValue)
	}
	return s.use(func(cs C.CUstream) error {
		if len(dst) == 0 {
			return nil
		}
		return wrap("cuMemcpyDtoHAsync", C.gs_cuMemcpyDtoHAsync(unsafe.Pointer(&dst[0]), C.CUdeviceptr(src), C.size_t(len(dst)), cs))
	})
}

// Synchronize waits for everything queued on the stream.
func (s *Stream) Synchronize() error {
	return s.use(func(cs C.CUstream) error {
		return wrap("cuStreamSynchronize", C.gs_cuStreamSynchronize(cs))
	})
}

// Close destroys the stream once its queued work completes. Closing twice
// returns an error.
func (s *Stream) Close() error {
	if s == nil {
		return errClosed
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.s == nil {
		if err := Init(); err != nil {
			return err
		}
		return errClosed
	}
	if s.foreign {
		s.s = nil
		return nil
	}
	err := s.d.withCtx(func() error {
		return wrap("cuStreamDestroy", C.gs_cuStreamDestroy(s.s))
	})
	s.s = nil
	return err
}

// Event is a timing event of one device's primary context. Its methods are
// safe for concurrent use, Close included.
type Event struct {
	d  *Device
	mu sync.RWMutex // held for writing only by Close
	e  C.CUevent
}

// NewEvent creates an event that records timing, for ElapsedMs.
func (d *Device) NewEvent() (*Event, error) {
	var e C.CUevent
	err := d.withCtx(func() error {
		return wrap("cuEventCreate", C.gs_cuEventCreate(&e))
	})
	if err != nil {
		return nil, err
	}
	return &Event{d: d, e: e}, nil
}

// NewSyncEvent creates an event for ordering, not timing: Synchronize on it
// sleeps until the event completes instead of spinning (CU_EVENT_BLOCKING_SYNC),
// which leaves the CPU to threads that have work, such as copiers reading
// files while their last chunk is still on its way to the GPU. ElapsedMs
// refuses it (CU_EVENT_DISABLE_TIMING), which also makes it cheaper to
// record.
func (d *Device) NewSyncEvent() (*Event, error) {
	var e C.CUevent
	err := d.withCtx(func() error {
		return wrap("cuEventCreate", C.gs_cuEventCreateSync(&e))
	})
	if err != nil {
		return nil, err
	}
	return &Event{d: d, e: e}, nil
}

func (e *Event) rlock() (C.CUevent, error) {
	if e == nil {
		return nil, errClosed
	}
	e.mu.RLock()
	if e.e == nil {
		e.mu.RUnlock()
		if err := Init(); err != nil {
			return nil, err
		}
		return nil, errClosed
	}
	return e.e, nil
}

// Record captures the point in s's queue (the legacy default stream if s is
// nil) that the event completes at. Work on a Stream does not order with
// the legacy default stream, so record on the stream whose work is timed.
func (e *Event) Record(s *Stream) error {
	ce, err := e.rlock()
	if err != nil {
		return err
	}
	defer e.mu.RUnlock()
	if s == nil {
		return e.d.withCtx(func() error {
			return wrap("cuEventRecord", C.gs_cuEventRecord(ce, nil))
		})
	}
	return s.use(func(cs C.CUstream) error {
		// s.use made s's context current; an event of another context is
		// rejected by the driver.
		return wrap("cuEventRecord", C.gs_cuEventRecord(ce, cs))
	})
}

// Synchronize waits until the event's recorded point is reached.
func (e *Event) Synchronize() error {
	ce, err := e.rlock()
	if err != nil {
		return err
	}
	defer e.mu.RUnlock()
	return e.d.withCtx(func() error {
		return wrap("cuEventSynchronize", C.gs_cuEventSynchronize(ce))
	})
}

// ElapsedMs returns the milliseconds between two recorded, completed events
// (about 0.5 microsecond resolution).
func ElapsedMs(start, end *Event) (float32, error) {
	cs, err := start.rlock()
	if err != nil {
		return 0, err
	}
	defer start.mu.RUnlock()
	ce := cs
	if end != start {
		if ce, err = end.rlock(); err != nil {
			return 0, err
		}
		defer end.mu.RUnlock()
	}
	var ms C.float
	err = start.d.withCtx(func() error {
		return wrap("cuEventElapsedTime", C.gs_cuEventElapsedTime(&ms, cs, ce))
	})
	if err != nil {
		return 0, err
	}
	return float32(ms), nil
}

// Close destroys the event. Closing twice returns an error.
func (e *Event) Close() error {
	if e == nil {
		return errClosed
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.e == nil {
		if err := Init(); err != nil {
			return err
		}
		return errClosed
	}
	err := e.d.withCtx(func() error {
		return wrap("cuEventDestroy", C.gs_cuEventDestroy(e.e))
	})
	e.e = nil
	return err
}

// ForeignStream wraps a stream another library made (torch, CuPy): h is
// its CUstream; 0 is the legacy default stream. Closing it does nothing.
func (d *Device) ForeignStream(h uintptr) *Stream {
	if h == 0 {
		h = 1 // CU_STREAM_LEGACY: the same stream, by a handle that is not nil
	}
	return &Stream{d: d, s: C.gs_stream(C.uintptr_t(h)), foreign: true}
}

// WriteValue64 queues a write of v to addr (device-visible memory), after
// a fence that makes the stream's earlier writes visible first.
func (s *Stream) WriteValue64(addr, v uint64) error {
	return s.use(func(cs C.CUstream) error {
		return wrap("cuStreamWriteValue64", C.gs_writeValue64(cs, C.CUdeviceptr(addr), C.ulonglong(v)))
	})
}

// WaitValue64 makes the stream wait until the 64-bit word at addr is at
// least v.
func (s *Stream) WaitValue64(addr, v uint64) error {
	return s.use(func(cs C.CUstream) error {
		return wrap("cuStreamWaitValue64", C.gs_waitValue64(cs, C.CUdeviceptr(addr), C.ulonglong(v)))
	})
}

// Handle is the stream's CUstream, for APIs that take one.
func (s *Stream) Handle() uintptr {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return uintptr(unsafe.Pointer(s.s))
}
