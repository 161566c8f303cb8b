//go:build linux && cgo

package cuda

// Memory: VMM allocations (cuMemCreate), their export and import as
// POSIX file descriptors, and mapping them into this process.

// #include "driver.h"
import "C"

import (
	"errors"
	"fmt"
)

// checkSize rejects sizes the driver would reject anyway, with a clearer
// message and without a round trip.
func (d *Device) checkSize(what string, size int64) (int64, error) {
	g, err := d.Granularity()
	if err != nil {
		return 0, err
	}
	if size <= 0 || size%g != 0 {
		return 0, fmt.Errorf("cuda: %s size %d is not a positive multiple of the granularity %d: %w", what, size, g, ErrInvalidValue)
	}
	return g, nil
}

// Create allocates size bytes of physical memory pinned on d, exportable as a
// POSIX file descriptor. size must be a positive multiple of Granularity.
func (d *Device) Create(size int64) (Handle, error) {
	if err := d.check(); err != nil {
		return 0, err
	}
	if _, err := d.checkSize("create", size); err != nil {
		return 0, err
	}
	var h C.CUmemGenericAllocationHandle
	err := d.withCtx(func() error {
		return wrap("cuMemCreate", C.gs_cuMemCreate(&h, C.size_t(size), C.int(d.ordinal), C.int(b2i(d.RDMACapable()))))
	})
	if err != nil {
		return 0, err
	}
	return Handle(h), nil
}

// Release drops the handle's reference to its physical memory; the memory is
// freed once every mapping of it is unmapped too.
func (d *Device) Release(h Handle) error {
	return d.withCtx(func() error {
		return wrap("cuMemRelease", C.gs_cuMemRelease(C.CUmemGenericAllocationHandle(h)))
	})
}

// HandleRDMA reports whether h's memory was made for RDMA engines to
// register (gpuDirectRDMACapable), as the driver records it.
func (d *Device) HandleRDMA(h Handle) (bool, error) {
	var locType, id, types, rdma C.int
	err := d.withCtx(func() error {
		return wrap("cuMemGetAllocationPropertiesFromHandle", C.gs_handleLocation(C.CUmemGenericAllocationHandle(h), &locType, &id, &types, &rdma))
	})
	return rdma != 0, err
}

// HandleDevice reports the ordinal of the GPU whose memory h refers to, and
// whether the memory can be exported as a POSIX file descriptor; an
// allocation that is not device memory is an ErrInvalidValue error.
func (d *Device) HandleDevice(h Handle) (ordinal int, posixFD bool, err error) {
	var locType, id, types, rdma C.int
	err = d.withCtx(func() error {
		return wrap("cuMemGetAllocationPropertiesFromHandle", C.gs_handleLocation(C.CUmemGenericAllocationHandle(h), &locType, &id, &types, &rdma))
	})
	if err != nil {
		return 0, false, err
	}
	if locType != C.CU_MEM_LOCATION_TYPE_DEVICE {
		return 0, false, fmt.Errorf("cuda: allocation is not device memory (location type %d): %w", int(locType), ErrInvalidValue)
	}
	return int(id), types&C.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR != 0, nil
}

// ExportFD returns a new file descriptor referring to h's memory, to be
// passed to another process (over a Unix socket) and imported there. The
// caller owns the descriptor and must close it.
func (d *Device) ExportFD(h Handle) (int, error) {
	var fd C.int
	err := d.withCtx(func() error {
		return wrap("cuMemExportToShareableHandle", C.gs_exportFD(&fd, C.CUmemGenericAllocationHandle(h)))
	})
	if err != nil {
		return -1, err
	}
	return int(fd), nil
}

// ImportFD returns a new handle for the memory that fd (from ExportFD, in
// this or another process) refers to. It does not close fd; the handle stays
// valid after the caller closes it. Release the handle when done.
func (d *Device) ImportFD(fd int) (Handle, error) {
	if fd < 0 || int64(fd) > int64(^uint32(0)>>1) {
		return 0, fmt.Errorf("cuda: import of fd %d: %w", fd, ErrInvalidValue)
	}
	var h C.CUmemGenericAllocationHandle
	err := d.withCtx(func() error {
		return wrap("cuMemImportFromShareableHandle", C.gs_importFD(&h, C.int(fd)))
	})
	if err != nil {
		return 0, err
	}
	return Handle(h), nil
}

// Map reserves a virtual address range of size bytes, maps h into it and
// sets access for every device in access with one cuMemSetAccess call
// (read-only or read-write). On failure it undoes what it did.
func (d *Device) Map(h Handle, size int64, readOnly bool, access ...*Device) (uint64, error) {
	ptr, err := d.Reserve(size)
	if err != nil {
		return 0, err
	}
	if err := d.MapAt(ptr, h, size, readOnly, access...); err != nil {
		return 0, errors.Join(err, d.Free(ptr, size))
	}
	return ptr, nil
}

// Reserve reserves a virtual address range of size bytes (a positive
// multiple of Granularity), aligned to the granularity, for MapAt.
func (d *Device) Reserve(size int64) (uint64, error) {
	g, err := d.checkSize("reserve", size)
	if err != nil {
		return 0, err
	}
	var ptr C.CUdeviceptr
	err = d.withCtx(func() error {
		return wrap("cuMemAddressReserve", C.gs_cuMemAddressReserve(&ptr, C.size_t(size), C.size_t(g)))
	})
	if err != nil {
		return 0, err
	}
	return uint64(ptr), nil
}

// MapAt maps h at ptr, the start of a range from Reserve, and sets access
// for every device in access with one cuMemSetAccess call. On failure the
// range is left reserved and unmapped.
func (d *Device) MapAt(ptr uint64, h Handle, size int64, readOnly bool, access ...*Device) error {
	if _, err := d.checkSize("map", size); err != nil {
		return err
	}
	if len(access) == 0 || len(access) > maxAccessDevices {
		return fmt.Errorf("cuda: map needs 1 to %d devices to grant access to, got %d: %w", maxAccessDevices, len(access), ErrInvalidValue)
	}
	var ords [maxAccessDevices]C.int
	for i, a := range access {
		if err := a.check(); err != nil {
			return fmt.Errorf("cuda: map access list entry %d: %w", i, err)
		}
		ords[i] = C.int(a.ordinal)
	}
	ro := C.int(0)
	if readOnly {
		ro = 1
	}
	p, sz := C.CUdeviceptr(ptr), C.size_t(size)
	return d.withCtx(func() error {
		if err := wrap("cuMemMap", C.gs_cuMemMap(p, sz, C.CUmemGenericAllocationHandle(h))); err != nil {
			return err
		}
		if err := wrap("cuMemSetAccess", C.gs_setAccess(p, sz, &ords[0], C.size_t(len(access)), ro)); err != nil {
			return errors.Join(err, wrap("cuMemUnmap", C.gs_cuMemUnmap(p, sz)))
		}
		return nil
	})
}

// Unmap undoes Map. If the unmap fails the address range is left reserved
// rather than freed while possibly still mapped.
func (d *Device) Unmap(ptr uint64, size int64) error {
	if err := d.UnmapAt(ptr, size); err != nil {
		return err
	}
	return d.Free(ptr, size)
}

// UnmapAt undoes MapAt, leaving the range reserved for another MapAt.
func (d *Device) UnmapAt(ptr uint64, size int64) error {
	if size <= 0 {
		return fmt.Errorf("cuda: unmap size %d: %w", size, ErrInvalidValue)
	}
	return d.withCtx(func() error {
		return wrap("cuMemUnmap", C.gs_cuMemUnmap(C.CUdeviceptr(ptr), C.size_t(size)))
	})
}

// Free releases a range from Reserve; nothing may be mapped in it.
func (d *Device) Free(ptr uint64, size int64) error {
	if size <= 0 {
		return fmt.Errorf("cuda: free size %d: %w", size, ErrInvalidValue)
	}
	return d.withCtx(func() error {
		return wrap("cuMemAddressFree", C.gs_cuMemAddressFree(C.CUdeviceptr(ptr), C.size_t(size)))
	})
}
