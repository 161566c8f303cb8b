//go:build linux && cgo

package cuda

// The layouts of driver.h, for tests that compare them with a real cuda.h.

// #include "driver.h"
import "C"

import (
	"unsafe"
)

// abiFacts reports the sizes, offsets and constants of the cuda.h
// declarations copied into the preamble, keyed as testdata/abi_check.c
// prints them from a real cuda.h.
func abiFacts() map[string]int64 {
	var p C.CUmemAllocationProp
	var l C.CUmemLocation
	var a C.CUmemAccessDesc
	return map[string]int64{
		"sizeof.CUresult":                                                 int64(unsafe.Sizeof(C.CUresult(0))),
		"sizeof.CUdevice":                                                 int64(unsafe.Sizeof(C.CUdevice(0))),
		"sizeof.CUdeviceptr":                                              int64(unsafe.Sizeof(C.CUdeviceptr(0))),
		"sizeof.CUmemGenericAllocationHandle":                             int64(unsafe.Sizeof(C.CUmemGenericAllocationHandle(0))),
		"sizeof.CUuuid":                                                   int64(unsafe.Sizeof(C.CUuuid{})),
		"sizeof.CUmemLocation":                                            int64(unsafe.Sizeof(l)),
		"offsetof.CUmemLocation.type":                                     int64(unsafe.Offsetof(l._type)),
		"offsetof.CUmemLocation.id":                                       int64(unsafe.Offsetof(l.id)),
		"sizeof.CUmemAllocationProp":                                      int64(unsafe.Sizeof(p)),
		"offsetof.CUmemAllocationProp.type":                               int64(unsafe.Offsetof(p._type)),
		"offsetof.CUmemAllocationProp.requestedHandleTypes":               int64(unsafe.Offsetof(p.requestedHandleTypes)),
		"offsetof.CUmemAllocationProp.location":                           int64(unsafe.Offsetof(p.location)),
		"offsetof.CUmemAllocationProp.win32HandleMetaData":                int64(unsafe.Offsetof(p.win32HandleMetaData)),
		"offsetof.CUmemAllocationProp.allocFlags":                         int64(C.gs_allocflags_off()),
		"sizeof.CUmemAllocationProp.allocFlags":                           int64(C.gs_allocflags_size()),
		"offsetof.allocFlags.gpuDirectRDMACapable":                        int64(C.gs_allocflags_rdma_off()),
		"offsetof.allocFlags.usage":                                       int64(C.gs_allocflags_usage_off()),
		"offsetof.allocFlags.reserved":                                    int64(C.gs_allocflags_reserved_off()),
		"sizeof.CUmemAccessDesc":                                          int64(unsafe.Sizeof(a)),
		"offsetof.CUmemAccessDesc.location":                               int64(unsafe.Offsetof(a.location)),
		"offsetof.CUmemAccessDesc.flags":                                  int64(unsafe.Offsetof(a.flags)),
		"sizeof.CUmemAccess_flags":                                        int64(unsafe.Sizeof(a.flags)),
		"sizeof.CUmemAllocationHandleType":                                int64(unsafe.Sizeof(p.requestedHandleTypes)),
		"CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED":         C.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
		"CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED": C.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
		"CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR":                        C.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
		"CU_MEM_HANDLE_TYPE_FABRIC":                                       C.CU_MEM_HANDLE_TYPE_FABRIC,
		"CU_MEM_ACCESS_FLAGS_PROT_READ":                                   C.CU_MEM_ACCESS_FLAGS_PROT_READ,
		"CU_MEM_ACCESS_FLAGS_PROT_READWRITE":                              C.CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
		"CU_MEM_LOCATION_TYPE_DEVICE":                                     C.CU_MEM_LOCATION_TYPE_DEVICE,
		"CU_MEM_ALLOCATION_TYPE_PINNED":                                   C.CU_MEM_ALLOCATION_TYPE_PINNED,
		"CU_MEM_ALLOC_GRANULARITY_MINIMUM":                                C.CU_MEM_ALLOC_GRANULARITY_MINIMUM,
		"CU_STREAM_NON_BLOCKING":                                          C.CU_STREAM_NON_BLOCKING,
		"CU_EVENT_DEFAULT":                                                C.CU_EVENT_DEFAULT,
		"CU_EVENT_BLOCKING_SYNC":                                          C.CU_EVENT_BLOCKING_SYNC,
		"CU_EVENT_DISABLE_TIMING":                                         C.CU_EVENT_DISABLE_TIMING,
	}
}
