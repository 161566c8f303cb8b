//go:build linux && cgo

// The loader of the driver's functions (driver.h declares them).

#include "driver.h"

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

struct gpushm_fns gpushm_cu;


// gpushm_open loads path and resolves every symbol, installing the table only
// when install is set and nothing is missing, so that a probe of another
// library (tests) can never leave half a table behind. dlopen and dlerror run
// in this one C call: dlerror's state is per OS thread, and a goroutine cannot
// change threads in the middle of a cgo call, which is the guarantee go-nvml
// gets by locking the OS thread around its separate calls.
int gpushm_open(const char *path, int install, char *err, size_t errlen) {
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
