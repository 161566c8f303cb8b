// The CUDA driver API as this package uses it: the types and constants it
// needs (no CUDA headers are needed to build), the table of driver
// functions gpushm_open fills from libcuda.so.1 (driver.c), and one
// trampoline a function, since cgo cannot call through a C function
// pointer. Every cgo file of the package includes it.
#ifndef GPUSHM_DRIVER_H
#define GPUSHM_DRIVER_H
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// Types and constants copied from cuda.h of CUDA 13.0 (CUDA_VERSION 13000),
// which match CUDA 12.x for everything used here. Only what this package
// calls is declared; the CUDA headers are not needed to build. abiFacts and
// TestABIMatchesCudaHeader check these against a real cuda.h where one is
// installed.

typedef int CUresult; // enum cudaError_enum in cuda.h; an enum is int-sized.
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;

typedef struct CUuuid_st {
	char bytes[16];
} CUuuid;

typedef enum CUdevice_attribute_enum {
	CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102,
	CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 103,
	CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED = 110
} CUdevice_attribute;

typedef enum CUmemAllocationHandleType_enum {
	CU_MEM_HANDLE_TYPE_NONE = 0x0,
	CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1,
	CU_MEM_HANDLE_TYPE_WIN32 = 0x2,
	CU_MEM_HANDLE_TYPE_WIN32_KMT = 0x4,
	CU_MEM_HANDLE_TYPE_FABRIC = 0x8,
	CU_MEM_HANDLE_TYPE_MAX = 0x7FFFFFFF
} CUmemAllocationHandleType;

typedef enum CUmemAccess_flags_enum {
	CU_MEM_ACCESS_FLAGS_PROT_NONE = 0x0,
	CU_MEM_ACCESS_FLAGS_PROT_READ = 0x1,
	CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3,
	CU_MEM_ACCESS_FLAGS_PROT_MAX = 0x7FFFFFFF
} CUmemAccess_flags;

typedef enum CUmemLocationType_enum {
	CU_MEM_LOCATION_TYPE_INVALID = 0x0,
	CU_MEM_LOCATION_TYPE_DEVICE = 0x1,
	CU_MEM_LOCATION_TYPE_MAX = 0x7FFFFFFF
} CUmemLocationType;

typedef enum CUmemAllocationType_enum {
	CU_MEM_ALLOCATION_TYPE_INVALID = 0x0,
	CU_MEM_ALLOCATION_TYPE_PINNED = 0x1,
	CU_MEM_ALLOCATION_TYPE_MAX = 0x7FFFFFFF
} CUmemAllocationType;

typedef enum CUmemAllocationGranularity_flags_enum {
	CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0x0,
	CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 0x1
} CUmemAllocationGranularity_flags;

typedef enum CUstream_flags_enum {
	CU_STREAM_DEFAULT = 0x0,
	CU_STREAM_NON_BLOCKING = 0x1
} CUstream_flags;

typedef enum CUevent_flags_enum {
	CU_EVENT_DEFAULT = 0x0,
	CU_EVENT_BLOCKING_SYNC = 0x1,
	CU_EVENT_DISABLE_TIMING = 0x2
} CUevent_flags;

#include "vmm.h"

_Static_assert(sizeof(CUuuid) == 16, "CUuuid layout");

// Function pointers resolved from libcuda.so.1. The field names are the
// cuda.h API names; gpushm_syms gives the exported symbol for each.
struct gpushm_fns {
	CUresult (*cuInit)(unsigned int);
	CUresult (*cuDriverGetVersion)(int *);
	CUresult (*cuGetErrorName)(CUresult, const char **);
	CUresult (*cuDeviceGetCount)(int *);
	CUresult (*cuDeviceGet)(CUdevice *, int);
	CUresult (*cuDeviceGetName)(char *, int, CUdevice);
	CUresult (*cuDeviceGetUuid)(CUuuid *, CUdevice);
	CUresult (*cuDeviceTotalMem)(size_t *, CUdevice);
	CUresult (*cuDeviceGetAttribute)(int *, CUdevice_attribute, CUdevice);
	CUresult (*cuDeviceCanAccessPeer)(int *, CUdevice, CUdevice);
	CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
	CUresult (*cuCtxSetCurrent)(CUcontext);
	CUresult (*cuCtxSynchronize)(void);
	CUresult (*cuMemGetInfo)(size_t *, size_t *);
	CUresult (*cuMemGetAllocationGranularity)(size_t *, const CUmemAllocationProp *, CUmemAllocationGranularity_flags);
	CUresult (*cuMemCreate)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
	CUresult (*cuMemRelease)(CUmemGenericAllocationHandle);
	CUresult (*cuMemGetAllocationPropertiesFromHandle)(CUmemAllocationProp *, CUmemGenericAllocationHandle);
	CUresult (*cuMemExportToShareableHandle)(void *, CUmemGenericAllocationHandle, CUmemAllocationHandleType, unsigned long long);
	CUresult (*cuMemImportFromShareableHandle)(CUmemGenericAllocationHandle *, void *, CUmemAllocationHandleType);
	CUresult (*cuMemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
	CUresult (*cuMemAddressFree)(CUdeviceptr, size_t);
	CUresult (*cuMemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
	CUresult (*cuMemUnmap)(CUdeviceptr, size_t);
	CUresult (*cuMemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
	CUresult (*cuMemcpyHtoD)(CUdeviceptr, const void *, size_t);
	CUresult (*cuMemcpyDtoH)(void *, CUdeviceptr, size_t);
	CUresult (*cuMemcpyDtoD)(CUdeviceptr, CUdeviceptr, size_t);
	CUresult (*cuMemsetD8)(CUdeviceptr, unsigned char, size_t);
	CUresult (*cuMemAllocHost)(void **, size_t);
	CUresult (*cuMemFreeHost)(void *);
	CUresult (*cuStreamCreate)(CUstream *, unsigned int);
	CUresult (*cuStreamDestroy)(CUstream);
	CUresult (*cuStreamSynchronize)(CUstream);
	CUresult (*cuMemcpyHtoDAsync)(CUdeviceptr, const void *, size_t, CUstream);
	CUresult (*cuMemcpyDtoHAsync)(void *, CUdeviceptr, size_t, CUstream);
	CUresult (*cuMemcpyDtoDAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
	CUresult (*cuMemcpyPeerAsync)(CUdeviceptr, CUcontext, CUdeviceptr, CUcontext, size_t, CUstream);
	CUresult (*cuMemHostRegister)(void *, size_t, unsigned int);
	CUresult (*cuMemHostUnregister)(void *);
	CUresult (*cuMemHostGetDevicePointer)(CUdeviceptr *, void *, unsigned int);
	CUresult (*cuStreamWriteValue64)(CUstream, CUdeviceptr, unsigned long long, unsigned int);
	CUresult (*cuStreamWaitValue64)(CUstream, CUdeviceptr, unsigned long long, unsigned int);
	CUresult (*cuEventCreate)(CUevent *, unsigned int);
	CUresult (*cuEventRecord)(CUevent, CUstream);
	CUresult (*cuEventSynchronize)(CUevent);
	CUresult (*cuEventElapsedTime)(float *, CUevent, CUevent);
	CUresult (*cuEventDestroy)(CUevent);
};

// gpushm_cu is written once, under Init's sync.Once, before any trampoline
// can run; it is read-only afterwards.
extern struct gpushm_fns gpushm_cu;

enum { GPUSHM_OPEN_OK = 0, GPUSHM_OPEN_NO_LIBRARY = 1, GPUSHM_OPEN_NO_SYMBOL = 2 };

int gpushm_open(const char *path, int install, char *err, size_t errlen);

// Trampolines: cgo cannot call through a C function pointer directly.
static inline CUresult gs_cuInit(unsigned int flags) { return gpushm_cu.cuInit(flags); }
static inline CUresult gs_cuDriverGetVersion(int *v) { return gpushm_cu.cuDriverGetVersion(v); }
static inline CUresult gs_cuGetErrorName(CUresult r, const char **s) { return gpushm_cu.cuGetErrorName(r, s); }
static inline CUresult gs_cuDeviceGetCount(int *n) { return gpushm_cu.cuDeviceGetCount(n); }
static inline CUresult gs_cuDeviceGet(CUdevice *d, int ordinal) { return gpushm_cu.cuDeviceGet(d, ordinal); }
static inline CUresult gs_cuDeviceGetName(char *name, int len, CUdevice d) { return gpushm_cu.cuDeviceGetName(name, len, d); }
static inline CUresult gs_cuDeviceGetUuid(CUuuid *u, CUdevice d) { return gpushm_cu.cuDeviceGetUuid(u, d); }
static inline CUresult gs_cuDeviceTotalMem(size_t *b, CUdevice d) { return gpushm_cu.cuDeviceTotalMem(b, d); }
static inline CUresult gs_cuDeviceGetAttribute(int *v, int attr, CUdevice d) { return gpushm_cu.cuDeviceGetAttribute(v, (CUdevice_attribute)attr, d); }
static inline CUresult gs_cuDeviceCanAccessPeer(int *v, CUdevice d, CUdevice peer) { return gpushm_cu.cuDeviceCanAccessPeer(v, d, peer); }
static inline CUresult gs_cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) { return gpushm_cu.cuDevicePrimaryCtxRetain(c, d); }
static inline CUresult gs_cuCtxSetCurrent(CUcontext c) { return gpushm_cu.cuCtxSetCurrent(c); }
static inline CUresult gs_cuCtxSynchronize(void) { return gpushm_cu.cuCtxSynchronize(); }
static inline CUresult gs_cuMemGetInfo(size_t *free, size_t *total) { return gpushm_cu.cuMemGetInfo(free, total); }

// The allocation properties are built here rather than in Go so that every
// reserved and Windows-only field is certainly zero, as the driver requires.
// rdma asks for memory an RDMA engine can register (gpuDirectRDMACapable),
// which only devices that report it accept.
static inline void gs_prop(CUmemAllocationProp *p, int ordinal, int rdma) {
	memset(p, 0, sizeof *p);
	p->type = CU_MEM_ALLOCATION_TYPE_PINNED;
	p->requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
	p->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	p->location.id = ordinal;
	p->allocFlags.gpuDirectRDMACapable = rdma ? 1 : 0;
}

static inline CUresult gs_granularity(size_t *g, int ordinal) {
	CUmemAllocationProp p;
	gs_prop(&p, ordinal, 0);
	return gpushm_cu.cuMemGetAllocationGranularity(g, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
}

static inline CUresult gs_cuMemCreate(CUmemGenericAllocationHandle *h, size_t size, int ordinal, int rdma) {
	CUmemAllocationProp p;
	gs_prop(&p, ordinal, rdma);
	return gpushm_cu.cuMemCreate(h, size, &p, 0);
}

static inline CUresult gs_cuMemRelease(CUmemGenericAllocationHandle h) { return gpushm_cu.cuMemRelease(h); }

// gs_handleLocation reports where h's memory lives and which handle types
// it can be exported as.
static inline CUresult gs_handleLocation(CUmemGenericAllocationHandle h, int *locType, int *id, int *handleTypes, int *rdma) {
	CUmemAllocationProp p;
	memset(&p, 0, sizeof p);
	CUresult r = gpushm_cu.cuMemGetAllocationPropertiesFromHandle(&p, h);
	if (r == 0) {
		*locType = (int)p.location.type;
		*id = p.location.id;
		*handleTypes = (int)p.requestedHandleTypes;
		*rdma = (int)p.allocFlags.gpuDirectRDMACapable;
	}
	return r;
}

static inline CUresult gs_exportFD(int *fd, CUmemGenericAllocationHandle h) {
	return gpushm_cu.cuMemExportToShareableHandle(fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
}

// For POSIX_FILE_DESCRIPTOR the driver takes the descriptor itself cast to a
// pointer, not a pointer to it; the cast is done here so Go never turns an
// integer into an unsafe.Pointer.
static inline CUresult gs_importFD(CUmemGenericAllocationHandle *h, int fd) {
	return gpushm_cu.cuMemImportFromShareableHandle(h, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
}

static inline CUresult gs_cuMemAddressReserve(CUdeviceptr *p, size_t size, size_t align) { return gpushm_cu.cuMemAddressReserve(p, size, align, 0, 0); }
static inline CUresult gs_cuMemAddressFree(CUdeviceptr p, size_t size) { return gpushm_cu.cuMemAddressFree(p, size); }
static inline CUresult gs_cuMemMap(CUdeviceptr p, size_t size, CUmemGenericAllocationHandle h) { return gpushm_cu.cuMemMap(p, size, 0, h, 0); }
static inline CUresult gs_cuMemUnmap(CUdeviceptr p, size_t size) { return gpushm_cu.cuMemUnmap(p, size); }

static inline CUresult gs_setAccess(CUdeviceptr p, size_t size, const int *ordinals, size_t n, int readOnly) {
	CUmemAccessDesc d[64];
	size_t i;
	if (n == 0 || n > sizeof d / sizeof d[0]) {
		return 1; // CUDA_ERROR_INVALID_VALUE
	}
	memset(d, 0, sizeof d);
	for (i = 0; i < n; i++) {
		d[i].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
		d[i].location.id = ordinals[i];
		d[i].flags = readOnly ? CU_MEM_ACCESS_FLAGS_PROT_READ : CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
	}
	return gpushm_cu.cuMemSetAccess(p, size, d, n);
}

static inline CUresult gs_cuMemcpyHtoD(CUdeviceptr dst, const void *src, size_t n) { return gpushm_cu.cuMemcpyHtoD(dst, src, n); }

// CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP: pinned for
// every context, with a device address.
static inline CUresult gs_hostRegister(void *p, size_t n) { return gpushm_cu.cuMemHostRegister(p, n, 0x01 | 0x02); }
static inline CUresult gs_hostUnregister(void *p) { return gpushm_cu.cuMemHostUnregister(p); }
static inline CUresult gs_hostDevicePointer(CUdeviceptr *d, void *p) { return gpushm_cu.cuMemHostGetDevicePointer(d, p, 0); }
// Flags 0: CU_STREAM_WRITE_VALUE_DEFAULT (after a system-wide fence) and
// CU_STREAM_WAIT_VALUE_GEQ.
static inline CUresult gs_writeValue64(CUstream s, CUdeviceptr a, unsigned long long v) { return gpushm_cu.cuStreamWriteValue64(s, a, v, 0); }
static inline CUresult gs_waitValue64(CUstream s, CUdeviceptr a, unsigned long long v) { return gpushm_cu.cuStreamWaitValue64(s, a, v, 0); }
static inline CUstream gs_stream(uintptr_t h) { return (CUstream)h; }
static inline CUresult gs_cuMemcpyDtoH(void *dst, CUdeviceptr src, size_t n) { return gpushm_cu.cuMemcpyDtoH(dst, src, n); }
static inline CUresult gs_cuMemcpyDtoD(CUdeviceptr dst, CUdeviceptr src, size_t n) { return gpushm_cu.cuMemcpyDtoD(dst, src, n); }
static inline CUresult gs_cuMemsetD8(CUdeviceptr dst, unsigned char v, size_t n) { return gpushm_cu.cuMemsetD8(dst, v, n); }
static inline CUresult gs_cuMemAllocHost(void **p, size_t n) { return gpushm_cu.cuMemAllocHost(p, n); }
static inline CUresult gs_cuMemFreeHost(void *p) { return gpushm_cu.cuMemFreeHost(p); }
static inline CUresult gs_cuStreamCreate(CUstream *s) { return gpushm_cu.cuStreamCreate(s, CU_STREAM_NON_BLOCKING); }
static inline CUresult gs_cuStreamDestroy(CUstream s) { return gpushm_cu.cuStreamDestroy(s); }
static inline CUresult gs_cuStreamSynchronize(CUstream s) { return gpushm_cu.cuStreamSynchronize(s); }
static inline CUresult gs_cuMemcpyHtoDAsync(CUdeviceptr dst, const void *src, size_t n, CUstream s) { return gpushm_cu.cuMemcpyHtoDAsync(dst, src, n, s); }
static inline CUresult gs_cuMemcpyDtoHAsync(void *dst, CUdeviceptr src, size_t n, CUstream s) { return gpushm_cu.cuMemcpyDtoHAsync(dst, src, n, s); }
static inline CUresult gs_cuMemcpyDtoDAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) { return gpushm_cu.cuMemcpyDtoDAsync(dst, src, n, s); }
static inline CUresult gs_cuMemcpyPeerAsync(CUdeviceptr dst, CUcontext dc, CUdeviceptr src, CUcontext sc, size_t n, CUstream s) { return gpushm_cu.cuMemcpyPeerAsync(dst, dc, src, sc, n, s); }
static inline CUresult gs_cuEventCreate(CUevent *e) { return gpushm_cu.cuEventCreate(e, CU_EVENT_DEFAULT); }
static inline CUresult gs_cuEventCreateSync(CUevent *e) { return gpushm_cu.cuEventCreate(e, CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING); }
static inline CUresult gs_cuEventRecord(CUevent e, CUstream s) { return gpushm_cu.cuEventRecord(e, s); }
static inline CUresult gs_cuEventSynchronize(CUevent e) { return gpushm_cu.cuEventSynchronize(e); }
static inline CUresult gs_cuEventElapsedTime(float *ms, CUevent a, CUevent b) { return gpushm_cu.cuEventElapsedTime(ms, a, b); }
static inline CUresult gs_cuEventDestroy(CUevent e) { return gpushm_cu.cuEventDestroy(e); }

// Facts about the layouts above, for comparison with a real cuda.h in tests.
static inline size_t gs_allocflags_off(void) { return offsetof(CUmemAllocationProp, allocFlags); }
static inline size_t gs_allocflags_size(void) { CUmemAllocationProp p; return sizeof p.allocFlags; }
static inline size_t gs_allocflags_usage_off(void) { return offsetof(CUmemAllocationProp, allocFlags.usage) - offsetof(CUmemAllocationProp, allocFlags); }
static inline size_t gs_allocflags_rdma_off(void) { return offsetof(CUmemAllocationProp, allocFlags.gpuDirectRDMACapable) - offsetof(CUmemAllocationProp, allocFlags); }
static inline size_t gs_allocflags_reserved_off(void) { return offsetof(CUmemAllocationProp, allocFlags.reserved) - offsetof(CUmemAllocationProp, allocFlags); }

#endif
