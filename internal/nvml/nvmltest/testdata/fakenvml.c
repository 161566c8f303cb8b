// A stand-in for libnvidia-ml.so.1 with the calls gpushm makes, so that the
// NVML code path (loading, symbol checks, go-nvml's calling conventions,
// errors) runs on machines without a GPU. GPUSHM_FAKE_NVML picks its
// behaviour, read at every call:
//
//   ok (or unset)  two GPUs; GPU 0 lists the processes in
//                  GPUSHM_FAKE_NVML_PIDS ("pid:bytes,pid:bytes"), GPU 1 has no
//                  utilisation (NOT_SUPPORTED) and no processes
//   init-fails     nvmlInit fails: DRIVER_NOT_LOADED, as on a node whose
//                  kernel module is not loaded
//   gpu-lost       GPU 1 fails every query with GPU_IS_LOST
//
// Build: gcc -shared -fPIC -o libnvidia-ml.so.1 fakenvml.c
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int nvmlReturn_t;
enum {
	SUCCESS = 0, UNINITIALIZED = 1, INVALID_ARGUMENT = 2, NOT_SUPPORTED = 3,
	INSUFFICIENT_SIZE = 7, DRIVER_NOT_LOADED = 9, GPU_IS_LOST = 15, UNKNOWN = 999,
};
typedef struct nvmlDevice_st { int index; } *nvmlDevice_t;
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned int gpu, memory; } nvmlUtilization_t;
typedef struct {
	unsigned int pid;
	unsigned long long usedGpuMemory;
	unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t;

static struct nvmlDevice_st devices[2] = {{0}, {1}};
static int inits;

static int mode(const char *m) {
	const char *v = getenv("GPUSHM_FAKE_NVML");
	if (v == NULL || *v == 0) v = "ok";
	return strcmp(v, m) == 0;
}

#define NEED_INIT() do { if (inits <= 0) return UNINITIALIZED; } while (0)
#define NEED_DEVICE(d) do { \
	NEED_INIT(); \
	if ((d) != &devices[0] && (d) != &devices[1]) return INVALID_ARGUMENT; \
	if ((d)->index == 1 && mode("gpu-lost")) return GPU_IS_LOST; \
} while (0)

const char *nvmlErrorString(nvmlReturn_t r) {
	switch (r) {
	case SUCCESS: return "Success";
	case UNINITIALIZED: return "Uninitialized";
	case INVALID_ARGUMENT: return "Invalid Argument";
	case NOT_SUPPORTED: return "Not Supported";
	case INSUFFICIENT_SIZE: return "Insufficient Size";
	case DRIVER_NOT_LOADED: return "Driver Not Loaded";
	case GPU_IS_LOST: return "GPU is lost";
	}
	return "Unknown Error";
}

nvmlReturn_t nvmlInit_v2(void) {
	if (mode("init-fails")) return DRIVER_NOT_LOADED;
	inits++;
	return SUCCESS;
}

nvmlReturn_t nvmlShutdown(void) {
	NEED_INIT();
	inits--;
	return SUCCESS;
}

static nvmlReturn_t copy(char *dst, unsigned int n, const char *src) {
	if (dst == NULL) return INVALID_ARGUMENT;
	if (strlen(src) + 1 > n) return INSUFFICIENT_SIZE;
	strcpy(dst, src);
	return SUCCESS;
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *v, unsigned int n) {
	NEED_INIT();
	return copy(v, n, "999.99.99-fake");
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *n) {
	NEED_INIT();
	*n = 2;
	return SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int i, nvmlDevice_t *d) {
	NEED_INIT();
	if (i > 1) return INVALID_ARGUMENT;
	*d = &devices[i];
	return SUCCESS;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *name, unsigned int n) {
	NEED_DEVICE(d);
	return copy(name, n, d->index == 0 ? "Fake GPU A" : "Fake GPU B");
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *uuid, unsigned int n) {
	NEED_DEVICE(d);
	return copy(uuid, n, d->index == 0 ? "GPU-fa4e0000-0000-0000-0000-000000000000" : "GPU-fa4e0001-0000-0000-0000-000000000001");
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m) {
	NEED_DEVICE(d);
	m->total = 80ULL << 30;
	m->used = d->index == 0 ? 3ULL << 30 : 1ULL << 29;
	m->free = m->total - m->used;
	return SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t d, nvmlUtilization_t *u) {
	NEED_DEVICE(d);
	if (d->index == 1) return NOT_SUPPORTED;
	u->gpu = 42;
	u->memory = 7;
	return SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *count, nvmlProcessInfo_t *infos) {
	NEED_DEVICE(d);
	nvmlProcessInfo_t found[64];
	unsigned int n = 0;
	const char *s = d->index == 0 ? getenv("GPUSHM_FAKE_NVML_PIDS") : NULL;
	while (s != NULL && *s != 0 && n < 64) {
		unsigned int pid;
		unsigned long long used;
		if (sscanf(s, "%u:%llu", &pid, &used) != 2) return UNKNOWN;
		found[n].pid = pid;
		found[n].usedGpuMemory = used;
		found[n].gpuInstanceId = found[n].computeInstanceId = 0xFFFFFFFF;
		n++;
		s = strchr(s, ',');
		if (s != NULL) s++;
	}
	if (*count < n) {
		*count = n;
		return INSUFFICIENT_SIZE;
	}
	memcpy(infos, found, n * sizeof found[0]);
	*count = n;
	return SUCCESS;
}
