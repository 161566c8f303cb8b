//go:build linux && cgo

package cuda

/*
#cgo LDFLAGS: -ldl

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
	CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 103
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

typedef struct CUmemLocation_st {
	CUmemLocationType type;
	int id;
} CUmemLocation;

typedef struct CUmemAllocationProp_st {
	CUmemAllocationType type;
	CUmemAllocationHandleType requestedHandleTypes;
	CUmemLocation location;
	void *win32HandleMetaData;
	struct {
		unsigned char compressionType;
		unsigned char gpuDirectRDMACapable;
		unsigned short usage;
		unsigned char reserved[4];
	} allocFlags;
} CUmemAllocationProp;

typedef struct CUmemAccessDesc_st {
	CUmemLocation location;
	CUmemAccess_flags flags;
} CUmemAccessDesc;

// A wrong layout here would make the driver read garbage properties or write
// past a descriptor array, so refuse to build if the compiler lays them out
// differently from the LP64 layout of cuda.h.
_Static_assert(sizeof(CUmemLocation) == 8, "CUmemLocation layout");
_Static_assert(sizeof(CUmemAllocationProp) == 32, "CUmemAllocationProp layout");
_Static_assert(offsetof(CUmemAllocationProp, location) == 8, "CUmemAllocationProp.location");
_Static_assert(offsetof(CUmemAllocationProp, win32HandleMetaData) == 16, "CUmemAllocationProp.win32HandleMetaData");
_Static_assert(offsetof(CUmemAllocationProp, allocFlags) == 24, "CUmemAllocationProp.allocFlags");
_Static_assert(sizeof(CUmemAccessDesc) == 12, "CUmemAccessDesc layout");
_Static_assert(offsetof(CUmemAccessDesc, flags) == 8, "CUmemAccessDesc.flags");
_Static_assert(sizeof(CUuuid) == 16, "CUuuid layout");
_Static_assert(sizeof(CUdeviceptr) == 8, "CUdeviceptr size");

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

struct gpushm_sym {
	const char *name;     // preferred symbol, the one cuda.h of CUDA 13 maps the API name to
	const char *fallback; // older symbol with the same signature, for drivers predating name; or NULL
	size_t off;           // offset of the pointer in struct gpushm_fns
};

#define GPUSHM_SYM(field, name, fallback) { name, fallback, offsetof(struct gpushm_fns, field) }

static const struct gpushm_sym gpushm_syms[] = {
	GPUSHM_SYM(cuInit, "cuInit", NULL),
	GPUSHM_SYM(cuDriverGetVersion, "cuDriverGetVersion", NULL),
	GPUSHM_SYM(cuGetErrorName, "cuGetErrorName", NULL),
	GPUSHM_SYM(cuDeviceGetCount, "cuDeviceGetCount", NULL),
	GPUSHM_SYM(cuDeviceGet, "cuDeviceGet", NULL),
	GPUSHM_SYM(cuDeviceGetName, "cuDeviceGetName", NULL),
	GPUSHM_SYM(cuDeviceGetUuid, "cuDeviceGetUuid_v2", "cuDeviceGetUuid"),
	GPUSHM_SYM(cuDeviceTotalMem, "cuDeviceTotalMem_v2", NULL),
	GPUSHM_SYM(cuDeviceGetAttribute, "cuDeviceGetAttribute", NULL),
	GPUSHM_SYM(cuDeviceCanAccessPeer, "cuDeviceCanAccessPeer", NULL),
	GPUSHM_SYM(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", NULL),
	GPUSHM_SYM(cuCtxSetCurrent, "cuCtxSetCurrent", NULL),
	GPUSHM_SYM(cuCtxSynchronize, "cuCtxSynchronize", NULL),
	GPUSHM_SYM(cuMemGetInfo, "cuMemGetInfo_v2", NULL),
	GPUSHM_SYM(cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity", NULL),
	GPUSHM_SYM(cuMemCreate, "cuMemCreate", NULL),
	GPUSHM_SYM(cuMemRelease, "cuMemRelease", NULL),
	GPUSHM_SYM(cuMemGetAllocationPropertiesFromHandle, "cuMemGetAllocationPropertiesFromHandle", NULL),
	GPUSHM_SYM(cuMemExportToShareableHandle, "cuMemExportToShareableHandle", NULL),
	GPUSHM_SYM(cuMemImportFromShareableHandle, "cuMemImportFromShareableHandle", NULL),
	GPUSHM_SYM(cuMemAddressReserve, "cuMemAddressReserve", NULL),
	GPUSHM_SYM(cuMemAddressFree, "cuMemAddressFree", NULL),
	GPUSHM_SYM(cuMemMap, "cuMemMap", NULL),
	GPUSHM_SYM(cuMemUnmap, "cuMemUnmap", NULL),
	GPUSHM_SYM(cuMemSetAccess, "cuMemSetAccess", NULL),
	GPUSHM_SYM(cuMemcpyHtoD, "cuMemcpyHtoD_v2", NULL),
	GPUSHM_SYM(cuMemcpyDtoH, "cuMemcpyDtoH_v2", NULL),
	GPUSHM_SYM(cuMemcpyDtoD, "cuMemcpyDtoD_v2", NULL),
	GPUSHM_SYM(cuMemsetD8, "cuMemsetD8_v2", NULL),
	GPUSHM_SYM(cuMemAllocHost, "cuMemAllocHost_v2", NULL),
	GPUSHM_SYM(cuMemFreeHost, "cuMemFreeHost", NULL),
	GPUSHM_SYM(cuStreamCreate, "cuStreamCreate", NULL),
	GPUSHM_SYM(cuStreamDestroy, "cuStreamDestroy_v2", NULL),
	GPUSHM_SYM(cuStreamSynchronize, "cuStreamSynchronize", NULL),
	GPUSHM_SYM(cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2", NULL),
	GPUSHM_SYM(cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2", NULL),
	GPUSHM_SYM(cuMemcpyDtoDAsync, "cuMemcpyDtoDAsync_v2", NULL),
	GPUSHM_SYM(cuMemcpyPeerAsync, "cuMemcpyPeerAsync", NULL),
	GPUSHM_SYM(cuMemHostRegister, "cuMemHostRegister_v2", "cuMemHostRegister"),
	GPUSHM_SYM(cuMemHostUnregister, "cuMemHostUnregister", NULL),
	GPUSHM_SYM(cuMemHostGetDevicePointer, "cuMemHostGetDevicePointer_v2", NULL),
	GPUSHM_SYM(cuStreamWriteValue64, "cuStreamWriteValue64_v2", "cuStreamWriteValue64"),
	GPUSHM_SYM(cuStreamWaitValue64, "cuStreamWaitValue64_v2", "cuStreamWaitValue64"),
	GPUSHM_SYM(cuEventCreate, "cuEventCreate", NULL),
	GPUSHM_SYM(cuEventRecord, "cuEventRecord", NULL),
	GPUSHM_SYM(cuEventSynchronize, "cuEventSynchronize", NULL),
	GPUSHM_SYM(cuEventElapsedTime, "cuEventElapsedTime_v2", "cuEventElapsedTime"),
	GPUSHM_SYM(cuEventDestroy, "cuEventDestroy_v2", NULL),
};

// gpushm_cu is written once, under Init's sync.Once, before any trampoline
// can run; it is read-only afterwards.
static struct gpushm_fns gpushm_cu;

enum { GPUSHM_OPEN_OK = 0, GPUSHM_OPEN_NO_LIBRARY = 1, GPUSHM_OPEN_NO_SYMBOL = 2 };

// gpushm_open loads path and resolves every symbol, installing the table only
// when install is set and nothing is missing, so that a probe of another
// library (tests) can never leave half a table behind. dlopen and dlerror run
// in this one C call: dlerror's state is per OS thread, and a goroutine cannot
// change threads in the middle of a cgo call, which is the guarantee go-nvml
// gets by locking the OS thread around its separate calls.
static int gpushm_open(const char *path, int install, char *err, size_t errlen) {
	struct gpushm_fns f;
	size_t i;
	void *h;

	memset(&f, 0, sizeof f);
	(void)dlerror();
	h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (h == NULL) {
		const char *e = dlerror();
		snprintf(err, errlen, "%s", e != NULL ? e : "dlopen failed");
		return GPUSHM_OPEN_NO_LIBRARY;
	}
	for (i = 0; i < sizeof gpushm_syms / sizeof gpushm_syms[0]; i++) {
		const struct gpushm_sym *s = &gpushm_syms[i];
		void *p = dlsym(h, s->name);
		if (p == NULL && s->fallback != NULL) {
			p = dlsym(h, s->fallback);
		}
		if (p == NULL) {
			if (s->fallback != NULL) {
				snprintf(err, errlen, "%s (or %s)", s->name, s->fallback);
			} else {
				snprintf(err, errlen, "%s", s->name);
			}
			dlclose(h);
			return GPUSHM_OPEN_NO_SYMBOL;
		}
		memcpy((char *)&f + s->off, &p, sizeof p);
	}
	// The handle stays open for the life of the process: the driver cannot be
	// unloaded safely once used, and a probe's extra reference is harmless.
	if (install) {
		gpushm_cu = f;
	}
	return GPUSHM_OPEN_OK;
}

// Trampolines: cgo cannot call through a C function pointer directly.
static CUresult gs_cuInit(unsigned int flags) { return gpushm_cu.cuInit(flags); }
static CUresult gs_cuDriverGetVersion(int *v) { return gpushm_cu.cuDriverGetVersion(v); }
static CUresult gs_cuGetErrorName(CUresult r, const char **s) { return gpushm_cu.cuGetErrorName(r, s); }
static CUresult gs_cuDeviceGetCount(int *n) { return gpushm_cu.cuDeviceGetCount(n); }
static CUresult gs_cuDeviceGet(CUdevice *d, int ordinal) { return gpushm_cu.cuDeviceGet(d, ordinal); }
static CUresult gs_cuDeviceGetName(char *name, int len, CUdevice d) { return gpushm_cu.cuDeviceGetName(name, len, d); }
static CUresult gs_cuDeviceGetUuid(CUuuid *u, CUdevice d) { return gpushm_cu.cuDeviceGetUuid(u, d); }
static CUresult gs_cuDeviceTotalMem(size_t *b, CUdevice d) { return gpushm_cu.cuDeviceTotalMem(b, d); }
static CUresult gs_cuDeviceGetAttribute(int *v, int attr, CUdevice d) { return gpushm_cu.cuDeviceGetAttribute(v, (CUdevice_attribute)attr, d); }
static CUresult gs_cuDeviceCanAccessPeer(int *v, CUdevice d, CUdevice peer) { return gpushm_cu.cuDeviceCanAccessPeer(v, d, peer); }
static CUresult gs_cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) { return gpushm_cu.cuDevicePrimaryCtxRetain(c, d); }
static CUresult gs_cuCtxSetCurrent(CUcontext c) { return gpushm_cu.cuCtxSetCurrent(c); }
static CUresult gs_cuCtxSynchronize(void) { return gpushm_cu.cuCtxSynchronize(); }
static CUresult gs_cuMemGetInfo(size_t *free, size_t *total) { return gpushm_cu.cuMemGetInfo(free, total); }

// The allocation properties are built here rather than in Go so that every
// reserved and Windows-only field is certainly zero, as the driver requires.
static void gs_prop(CUmemAllocationProp *p, int ordinal) {
	memset(p, 0, sizeof *p);
	p->type = CU_MEM_ALLOCATION_TYPE_PINNED;
	p->requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
	p->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	p->location.id = ordinal;
}

static CUresult gs_granularity(size_t *g, int ordinal) {
	CUmemAllocationProp p;
	gs_prop(&p, ordinal);
	return gpushm_cu.cuMemGetAllocationGranularity(g, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
}

static CUresult gs_cuMemCreate(CUmemGenericAllocationHandle *h, size_t size, int ordinal) {
	CUmemAllocationProp p;
	gs_prop(&p, ordinal);
	return gpushm_cu.cuMemCreate(h, size, &p, 0);
}

static CUresult gs_cuMemRelease(CUmemGenericAllocationHandle h) { return gpushm_cu.cuMemRelease(h); }

// gs_handleLocation reports where h's memory lives and which handle types
// it can be exported as.
static CUresult gs_handleLocation(CUmemGenericAllocationHandle h, int *locType, int *id, int *handleTypes) {
	CUmemAllocationProp p;
	memset(&p, 0, sizeof p);
	CUresult r = gpushm_cu.cuMemGetAllocationPropertiesFromHandle(&p, h);
	if (r == 0) {
		*locType = (int)p.location.type;
		*id = p.location.id;
		*handleTypes = (int)p.requestedHandleTypes;
	}
	return r;
}

static CUresult gs_exportFD(int *fd, CUmemGenericAllocationHandle h) {
	return gpushm_cu.cuMemExportToShareableHandle(fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
}

// For POSIX_FILE_DESCRIPTOR the driver takes the descriptor itself cast to a
// pointer, not a pointer to it; the cast is done here so Go never turns an
// integer into an unsafe.Pointer.
static CUresult gs_importFD(CUmemGenericAllocationHandle *h, int fd) {
	return gpushm_cu.cuMemImportFromShareableHandle(h, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
}

static CUresult gs_cuMemAddressReserve(CUdeviceptr *p, size_t size, size_t align) { return gpushm_cu.cuMemAddressReserve(p, size, align, 0, 0); }
static CUresult gs_cuMemAddressFree(CUdeviceptr p, size_t size) { return gpushm_cu.cuMemAddressFree(p, size); }
static CUresult gs_cuMemMap(CUdeviceptr p, size_t size, CUmemGenericAllocationHandle h) { return gpushm_cu.cuMemMap(p, size, 0, h, 0); }
static CUresult gs_cuMemUnmap(CUdeviceptr p, size_t size) { return gpushm_cu.cuMemUnmap(p, size); }

static CUresult gs_setAccess(CUdeviceptr p, size_t size, const int *ordinals, size_t n, int readOnly) {
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

static CUresult gs_cuMemcpyHtoD(CUdeviceptr dst, const void *src, size_t n) { return gpushm_cu.cuMemcpyHtoD(dst, src, n); }

// CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP: pinned for
// every context, with a device address.
static CUresult gs_hostRegister(void *p, size_t n) { return gpushm_cu.cuMemHostRegister(p, n, 0x01 | 0x02); }
static CUresult gs_hostUnregister(void *p) { return gpushm_cu.cuMemHostUnregister(p); }
static CUresult gs_hostDevicePointer(CUdeviceptr *d, void *p) { return gpushm_cu.cuMemHostGetDevicePointer(d, p, 0); }
// Flags 0: CU_STREAM_WRITE_VALUE_DEFAULT (after a system-wide fence) and
// CU_STREAM_WAIT_VALUE_GEQ.
static CUresult gs_writeValue64(CUstream s, CUdeviceptr a, unsigned long long v) { return gpushm_cu.cuStreamWriteValue64(s, a, v, 0); }
static CUresult gs_waitValue64(CUstream s, CUdeviceptr a, unsigned long long v) { return gpushm_cu.cuStreamWaitValue64(s, a, v, 0); }
static CUstream gs_stream(uintptr_t h) { return (CUstream)h; }
static CUresult gs_cuMemcpyDtoH(void *dst, CUdeviceptr src, size_t n) { return gpushm_cu.cuMemcpyDtoH(dst, src, n); }
static CUresult gs_cuMemcpyDtoD(CUdeviceptr dst, CUdeviceptr src, size_t n) { return gpushm_cu.cuMemcpyDtoD(dst, src, n); }
static CUresult gs_cuMemsetD8(CUdeviceptr dst, unsigned char v, size_t n) { return gpushm_cu.cuMemsetD8(dst, v, n); }
static CUresult gs_cuMemAllocHost(void **p, size_t n) { return gpushm_cu.cuMemAllocHost(p, n); }
static CUresult gs_cuMemFreeHost(void *p) { return gpushm_cu.cuMemFreeHost(p); }
static CUresult gs_cuStreamCreate(CUstream *s) { return gpushm_cu.cuStreamCreate(s, CU_STREAM_NON_BLOCKING); }
static CUresult gs_cuStreamDestroy(CUstream s) { return gpushm_cu.cuStreamDestroy(s); }
static CUresult gs_cuStreamSynchronize(CUstream s) { return gpushm_cu.cuStreamSynchronize(s); }
static CUresult gs_cuMemcpyHtoDAsync(CUdeviceptr dst, const void *src, size_t n, CUstream s) { return gpushm_cu.cuMemcpyHtoDAsync(dst, src, n, s); }
static CUresult gs_cuMemcpyDtoHAsync(void *dst, CUdeviceptr src, size_t n, CUstream s) { return gpushm_cu.cuMemcpyDtoHAsync(dst, src, n, s); }
static CUresult gs_cuMemcpyDtoDAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) { return gpushm_cu.cuMemcpyDtoDAsync(dst, src, n, s); }
static CUresult gs_cuMemcpyPeerAsync(CUdeviceptr dst, CUcontext dc, CUdeviceptr src, CUcontext sc, size_t n, CUstream s) { return gpushm_cu.cuMemcpyPeerAsync(dst, dc, src, sc, n, s); }
static CUresult gs_cuEventCreate(CUevent *e) { return gpushm_cu.cuEventCreate(e, CU_EVENT_DEFAULT); }
static CUresult gs_cuEventCreateSync(CUevent *e) { return gpushm_cu.cuEventCreate(e, CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING); }
static CUresult gs_cuEventRecord(CUevent e, CUstream s) { return gpushm_cu.cuEventRecord(e, s); }
static CUresult gs_cuEventSynchronize(CUevent e) { return gpushm_cu.cuEventSynchronize(e); }
static CUresult gs_cuEventElapsedTime(float *ms, CUevent a, CUevent b) { return gpushm_cu.cuEventElapsedTime(ms, a, b); }
static CUresult gs_cuEventDestroy(CUevent e) { return gpushm_cu.cuEventDestroy(e); }

// Facts about the layouts above, for comparison with a real cuda.h in tests.
static size_t gs_allocflags_off(void) { return offsetof(CUmemAllocationProp, allocFlags); }
static size_t gs_allocflags_size(void) { CUmemAllocationProp p; return sizeof p.allocFlags; }
static size_t gs_allocflags_usage_off(void) { return offsetof(CUmemAllocationProp, allocFlags.usage) - offsetof(CUmemAllocationProp, allocFlags); }
static size_t gs_allocflags_rdma_off(void) { return offsetof(CUmemAllocationProp, allocFlags.gpuDirectRDMACapable) - offsetof(CUmemAllocationProp, allocFlags); }
static size_t gs_allocflags_reserved_off(void) { return offsetof(CUmemAllocationProp, allocFlags.reserved) - offsetof(CUmemAllocationProp, allocFlags); }
*/
import "C"

import (
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"unsafe"
)

// cgoBuild tells tests which implementation they run against.
const cgoBuild = true

// driverLibrary is a variable only so that tests can make loading fail on a
// machine that has a driver.
var driverLibrary = "libcuda.so.1"

// maxAccessDevices bounds the access list of one Map; it matches the fixed
// descriptor array in gs_setAccess, which keeps Go pointers out of C.
const maxAccessDevices = 64

var (
	initOnce sync.Once
	initErr  error
	// loaded is set once the symbol table is installed, which may be before
	// cuInit fails; it only gates driverErrorName.
	loaded atomic.Bool
)

// Init loads libcuda.so.1, resolves every symbol the package uses and calls
// cuInit(0). It runs once per process; later calls return the first result.
// Every other function and method calls it, so calling it explicitly is only
// needed to learn early whether a GPU is usable.
func Init() error {
	initOnce.Do(func() { initErr = initDriver() })
	return initErr
}

func initDriver() error {
	if err := openLibrary(driverLibrary, true); err != nil {
		return err
	}
	loaded.Store(true)
	if r := C.gs_cuInit(0); r != 0 {
		return fmt.Errorf("cuInit: %w", Result(r))
	}
	return nil
}

// openLibrary loads path and resolves the package's symbols in it, installing
// them for the trampolines only when install is set.
func openLibrary(path string, install bool) error {
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	var msg [512]C.char
	inst := C.int(0)
	if install {
		inst = 1
	}
	switch C.gpushm_open(cpath, inst, &msg[0], C.size_t(len(msg))) {
	case C.GPUSHM_OPEN_OK:
		return nil
	case C.GPUSHM_OPEN_NO_LIBRARY:
		return fmt.Errorf("%w: %s", ErrNoDriver, C.GoString(&msg[0]))
	default:
		return fmt.Errorf("cuda: %s lacks symbol %s; the NVIDIA driver is too old", path, C.GoString(&msg[0]))
	}
}

// probeLibrary resolves the package's symbols in path without installing
// them, so tests can check the loader's error paths.
func probeLibrary(path string) error { return openLibrary(path, false) }

// driverErrorName asks the loaded driver for names of codes newer than
// resultNames.
func driverErrorName(r Result) (string, bool) {
	if !loaded.Load() {
		return "", false
	}
	var s *C.char
	if C.gs_cuGetErrorName(C.CUresult(r), &s) != 0 || s == nil {
		return "", false
	}
	return C.GoString(s), true
}

func wrap(call string, r C.CUresult) error {
	if r == 0 {
		return nil
	}
	return fmt.Errorf("%s: %w", call, Result(r))
}

// DriverVersion returns the CUDA version the driver supports, encoded as
// 1000*major + 10*minor (13000 for CUDA 13.0).
func DriverVersion() (int, error) {
	if err := Init(); err != nil {
		return 0, err
	}
	var v C.int
	if err := wrap("cuDriverGetVersion", C.gs_cuDriverGetVersion(&v)); err != nil {
		return 0, err
	}
	return int(v), nil
}

// DeviceCount returns the number of CUDA devices visible to this process.
func DeviceCount() (int, error) {
	if err := Init(); err != nil {
		return 0, err
	}
	var n C.int
	if err := wrap("cuDeviceGetCount", C.gs_cuDeviceGetCount(&n)); err != nil {
		return 0, err
	}
	return int(n), nil
}

// Device is one CUDA device with its retained primary context. Obtain it from
// GetDevice; the zero value is not usable. A Device is safe for concurrent
// use.
type Device struct {
	ordinal int
	dev     C.CUdevice
	ctx     C.CUcontext
	gran    atomic.Int64 // cached Granularity; 0 until first known
}

var devices struct {
	mu sync.Mutex
	m  map[int]*Device
}

// GetDevice returns the device with that ordinal. The first call for an
// ordinal retains the device's primary context, which is kept until the
// process exits; later calls return the same *Device.
func GetDevice(ordinal int) (*Device, error) {
	if err := Init(); err != nil {
		return nil, err
	}
	devices.mu.Lock()
	defer devices.mu.Unlock()
	if d, ok := devices.m[ordinal]; ok {
		return d, nil
	}
	if ordinal < 0 || int64(ordinal) > int64(^uint32(0)>>1) {
		return nil, fmt.Errorf("cuda: device ordinal %d: %w", ordinal, ErrInvalidDevice)
	}
	var dev C.CUdevice
	if err := wrap("cuDeviceGet", C.gs_cuDeviceGet(&dev, C.int(ordinal))); err != nil {
		return nil, err
	}
	var ctx C.CUcontext
	if err := wrap("cuDevicePrimaryCtxRetain", C.gs_cuDevicePrimaryCtxRetain(&ctx, dev)); err != nil {
		return nil, err
	}
	d := &Device{ordinal: ordinal, dev: dev, ctx: ctx}
	if devices.m == nil {
		devices.m = make(map[int]*Device)
	}
	devices.m[ordinal] = d
	return d, nil
}

var errBadDevice = fmt.Errorf("cuda: device not obtained from GetDevice: %w", ErrInvalidDevice)

// check guards every method: the trampolines must never run before the
// symbol table is installed, nor with a zero Device.
func (d *Device) check() error {
	if err := Init(); err != nil {
		return err
	}
	if d == nil || d.ctx == nil {
		return errBadDevice
	}
	return nil
}

// withCtx runs fn with d's primary context current on a locked OS thread,
// because the driver's current context is a property of the OS thread and the
// Go scheduler may otherwise move the goroutine between the two C calls.
func (d *Device) withCtx(fn func() error) error {
	if err := d.check(); err != nil {
		return err
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := wrap("cuCtxSetCurrent", C.gs_cuCtxSetCurrent(d.ctx)); err != nil {
		return err
	}
	return fn()
}

// Ordinal returns the ordinal passed to GetDevice, or -1 for a nil Device.
func (d *Device) Ordinal() int {
	if d == nil {
		return -1
	}
	return d.ordinal
}

// Name returns the product name, such as "NVIDIA H100 80GB HBM3".
func (d *Device) Name() (string, error) {
	if err := d.check(); err != nil {
		return "", err
	}
	var buf [256]C.char
	if err := wrap("cuDeviceGetName", C.gs_cuDeviceGetName(&buf[0], C.int(len(buf)), d.dev)); err != nil {
		return "", err
	}
	buf[len(buf)-1] = 0
	return C.GoString(&buf[0]), nil
}

// UUID returns the device UUID in the form nvidia-smi prints,
// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx".
func (d *Device) UUID() (string, error) {
	if err := d.check(); err != nil {
		return "", err
	}
	return uuidOf(d.dev)
}

func uuidOf(dev C.CUdevice) (string, error) {
	var u C.CUuuid
	if err := wrap("cuDeviceGetUuid", C.gs_cuDeviceGetUuid(&u, dev)); err != nil {
		return "", err
	}
	var b [16]byte
	for i := range b {
		b[i] = byte(u.bytes[i])
	}
	return fmt.Sprintf("GPU-%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16]), nil
}

var uuids struct {
	once sync.Once
	m    map[string]int // UUID, lower case, to this process's ordinal
	err  error
}

// OrdinalOf returns this process's ordinal of the GPU with that UUID
// ("GPU-…", case ignored), or ErrInvalidDevice when the process cannot see
// it (CUDA_VISIBLE_DEVICES, a container given other GPUs). Another process
// may number the same GPU differently; the UUID is the same everywhere.
// No context is made.
func OrdinalOf(uuid string) (int, error) {
	uuids.once.Do(func() {
		n, err := DeviceCount()
		if err != nil {
			uuids.err = err
			return
		}
		uuids.m = make(map[string]int, n)
		for i := range n {
			var dev C.CUdevice
			if err := wrap("cuDeviceGet", C.gs_cuDeviceGet(&dev, C.int(i))); err != nil {
				uuids.err = err
				return
			}
			u, err := uuidOf(dev)
			if err != nil {
				uuids.err = err
				return
			}
			uuids.m[strings.ToLower(u)] = i
		}
	})
	if uuids.err != nil {
		return -1, uuids.err
	}
	if i, ok := uuids.m[strings.ToLower(uuid)]; ok {
		return i, nil
	}
	return -1, fmt.Errorf("cuda: GPU %s is not among the %d this process can see (CUDA_VISIBLE_DEVICES, or a container given other GPUs?): %w",
		uuid, len(uuids.m), ErrInvalidDevice)
}

// TotalMem returns the device's total memory in bytes.
func (d *Device) TotalMem() (uint64, error) {
	if err := d.check(); err != nil {
		return 0, err
	}
	var n C.size_t
	if err := wrap("cuDeviceTotalMem", C.gs_cuDeviceTotalMem(&n, d.dev)); err != nil {
		return 0, err
	}
	return uint64(n), nil
}

// MemInfo returns the free and total memory of the device as its primary
// context sees them.
func (d *Device) MemInfo() (free, total uint64, err error) {
	var f, t C.size_t
	err = d.withCtx(func() error {
		return wrap("cuMemGetInfo", C.gs_cuMemGetInfo(&f, &t))
	})
	if err != nil {
		return 0, 0, err
	}
	return uint64(f), uint64(t), nil
}

func (d *Device) attribute(attr C.int) (int, error) {
	if err := d.check(); err != nil {
		return 0, err
	}
	var v C.int
	if err := wrap("cuDeviceGetAttribute", C.gs_cuDeviceGetAttribute(&v, attr, d.dev)); err != nil {
		return 0, err
	}
	return int(v), nil
}

// VMMSupported reports whether the device supports the virtual memory
// management calls and exporting allocations as POSIX file descriptors, both
// of which the rest of the package needs.
func (d *Device) VMMSupported() (bool, error) {
	vmm, err := d.attribute(C.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)
	if err != nil {
		return false, err
	}
	fd, err := d.attribute(C.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)
	if err != nil {
		return false, err
	}
	return vmm != 0 && fd != 0, nil
}

// Granularity returns the minimum allocation granularity for pinned device
// memory exportable as a POSIX file descriptor; sizes passed to Create and
// Map must be multiples of it. The value is queried once and cached.
func (d *Device) Granularity() (int64, error) {
	if err := d.check(); err != nil {
		return 0, err
	}
	if g := d.gran.Load(); g != 0 {
		return g, nil
	}
	var g C.size_t
	if err := wrap("cuMemGetAllocationGranularity", C.gs_granularity(&g, C.int(d.ordinal))); err != nil {
		return 0, err
	}
	if g == 0 {
		return 0, fmt.Errorf("cuMemGetAllocationGranularity: driver reported 0: %w", ErrUnknown)
	}
	d.gran.Store(int64(g))
	return int64(g), nil
}

// CanAccessPeer reports cuDeviceCanAccessPeer(d, peer): whether d can map
// and access memory that resides on peer. The driver reports false for a
// device and itself (seen on driver 580), which callers need not ask about.
func (d *Device) CanAccessPeer(peer *Device) (bool, error) {
	if err := d.check(); err != nil {
		return false, err
	}
	if err := peer.check(); err != nil {
		return false, err
	}
	var v C.int
	if err := wrap("cuDeviceCanAccessPeer", C.gs_cuDeviceCanAccessPeer(&v, d.dev, peer.dev)); err != nil {
		return false, err
	}
	return v != 0, nil
}

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
		return wrap("cuMemCreate", C.gs_cuMemCreate(&h, C.size_t(size), C.int(d.ordinal)))
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

// HandleDevice reports the ordinal of the GPU whose memory h refers to, and
// whether the memory can be exported as a POSIX file descriptor; an
// allocation that is not device memory is an ErrInvalidValue error.
func (d *Device) HandleDevice(h Handle) (ordinal int, posixFD bool, err error) {
	var locType, id, types C.int
	err = d.withCtx(func() error {
		return wrap("cuMemGetAllocationPropertiesFromHandle", C.gs_handleLocation(C.CUmemGenericAllocationHandle(h), &locType, &id, &types))
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
