// A stand-in for libcuda.so.1 that implements the calls gpushm's Python
// client makes, over host memory, so that its CUDA code path (argument
// passing, error handling, mapping lifetimes) runs on machines without a
// GPU. Device pointers are host addresses; a "cuda_fd" is a memfd, mapped
// with mmap where the driver would map device memory. It checks what the
// real driver checks about the calls' arguments that a ctypes mistake would
// get wrong, and counts what is live so tests can see leaks.
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

typedef int CUresult;
enum { OK = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, INVALID_CONTEXT = 201, INVALID_HANDLE = 400, NOT_READY = 600,
       ALREADY_REGISTERED = 712, NOT_REGISTERED = 713 };
typedef struct { int type; int id; } CUmemLocation;
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc;

static int ctx_depth;       // pushes not yet popped
static long live_handles;   // imported, not released
static long live_reserved;  // reserved ranges
static long live_mapped;    // mapped ranges
static long live_allocs;    // cuMemAlloc
static long calls_sync;

long fake_live_handles(void) { return live_handles; }
long fake_live_reserved(void) { return live_reserved; }
long fake_live_mapped(void) { return live_mapped; }
long fake_live_allocs(void) { return live_allocs; }
long fake_ctx_depth(void) { return ctx_depth; }
long fake_syncs(void) { return calls_sync; }

#define NEED_CTX() do { if (ctx_depth <= 0) return INVALID_CONTEXT; } while (0)

CUresult cuInit(unsigned flags) { return flags == 0 ? OK : INVALID_VALUE; }
CUresult cuGetErrorName(CUresult r, const char **s) {
	switch (r) {
	case INVALID_VALUE: *s = "CUDA_ERROR_INVALID_VALUE"; return OK;
	case OUT_OF_MEMORY: *s = "CUDA_ERROR_OUT_OF_MEMORY"; return OK;
	case INVALID_CONTEXT: *s = "CUDA_ERROR_INVALID_CONTEXT"; return OK;
	case INVALID_HANDLE: *s = "CUDA_ERROR_INVALID_HANDLE"; return OK;
	case NOT_READY: *s = "CUDA_ERROR_NOT_READY"; return OK;
	case ALREADY_REGISTERED: *s = "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"; return OK;
	case NOT_REGISTERED: *s = "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED"; return OK;
	}
	return INVALID_VALUE;
}
// The visible GPUs: FAKECUDA_UUIDS lists their UUIDs in this process's
// order ("GPU-…,GPU-…", as CUDA_VISIBLE_DEVICES reorders them); one GPU of
// a fixed UUID when it is unset.
static int ngpus = -1;
static char gpu_uuid[8][16];
static int parse_hex(const char *s, unsigned char *out) {
	int n = 0;
	for (; *s && *s != ',' && n < 32; s++) {
		int v = *s >= '0' && *s <= '9' ? *s - '0' : *s >= 'a' && *s <= 'f' ? *s - 'a' + 10 : *s >= 'A' && *s <= 'F' ? *s - 'A' + 10 : -1;
		if (v < 0) continue; // the dashes
		if (n % 2 == 0) out[n / 2] = v << 4; else out[n / 2] |= v;
		n++;
	}
	return n == 32;
}
static void load_gpus(void) {
	if (ngpus >= 0) return;
	const char *e = getenv("FAKECUDA_UUIDS");
	if (e == NULL) {
		ngpus = 1;
		memcpy(gpu_uuid[0], "\x5e\xed\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x01", 16);
		return;
	}
	ngpus = 0;
	for (const char *p = e; *p && ngpus < 8;) {
		if (strncmp(p, "GPU-", 4) == 0) p += 4;
		if (parse_hex(p, (unsigned char *)gpu_uuid[ngpus])) ngpus++;
		while (*p && *p != ',') p++;
		if (*p == ',') p++;
	}
}
CUresult cuDeviceGetCount(int *n) { load_gpus(); *n = ngpus; return OK; }
CUresult cuDeviceGet(int *d, int ordinal) {
	load_gpus();
	if (ordinal < 0 || ordinal >= ngpus) return 101; // CUDA_ERROR_INVALID_DEVICE
	*d = ordinal;
	return OK;
}
CUresult cuDeviceGetUuid_v2(char *u, int dev) {
	load_gpus();
	if (dev < 0 || dev >= ngpus) return 101;
	memcpy(u, gpu_uuid[dev], 16);
	return OK;
}
static int the_ctx;
static int last_access_dev = -1;
long fake_last_access_device(void) { return last_access_dev; }
static int last_ctx_dev = -1;
long fake_last_ctx_device(void) { return last_ctx_dev; }
CUresult cuDevicePrimaryCtxRetain(void **ctx, int dev) {
	load_gpus();
	*ctx = &the_ctx;
	last_ctx_dev = dev;
	return dev >= 0 && dev < ngpus ? OK : INVALID_VALUE;
}
static long calls_push;
long fake_pushes(void) { return calls_push; }
CUresult cuCtxPushCurrent_v2(void *ctx) { if (ctx != &the_ctx) return INVALID_CONTEXT; ctx_depth++; calls_push++; return OK; }
CUresult cuCtxGetCurrent(void **ctx) { if (!ctx) return INVALID_VALUE; *ctx = ctx_depth > 0 ? (void *)&the_ctx : NULL; return OK; }
CUresult cuCtxPopCurrent_v2(void **ctx) { if (ctx_depth <= 0) return INVALID_CONTEXT; ctx_depth--; if (ctx) *ctx = &the_ctx; return OK; }
CUresult cuCtxSynchronize(void) { NEED_CTX(); calls_sync++; return OK; }
CUresult cuStreamSynchronize(void *s) { NEED_CTX(); calls_sync++; return s == NULL ? OK : INVALID_HANDLE; }
CUresult cuMemGetInfo_v2(size_t *free, size_t *total) { NEED_CTX(); *free = 1000 - 10 * live_mapped; *total = 1000; return OK; }

// A handle is a dup of the memfd, plus one so that 0 is never valid.
CUresult cuMemImportFromShareableHandle(uint64_t *h, void *os, int type) {
	NEED_CTX();
	int fd = (int)(intptr_t)os;
	struct stat st;
	if (type != 1 || fstat(fd, &st) != 0) return INVALID_VALUE;
	*h = (uint64_t)dup(fd) + 1;
	live_handles++;
	return OK;
}
CUresult cuMemRelease(uint64_t h) {
	if (h == 0 || close((int)(h - 1)) != 0) return INVALID_HANDLE;
	live_handles--;
	return OK;
}
CUresult cuMemAddressReserve(uint64_t *p, size_t size, size_t align, uint64_t addr, unsigned long long flags) {
	NEED_CTX();
	if (size == 0 || size % 4096 || align || addr || flags) return INVALID_VALUE;
	void *m = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	if (m == MAP_FAILED) return OUT_OF_MEMORY;
	*p = (uint64_t)(uintptr_t)m;
	live_reserved++;
	return OK;
}
CUresult cuMemAddressFree(uint64_t p, size_t size) {
	NEED_CTX();
	if (munmap((void *)(uintptr_t)p, size) != 0) return INVALID_VALUE;
	live_reserved--;
	return OK;
}
CUresult cuMemMap(uint64_t p, size_t size, size_t off, uint64_t h, unsigned long long flags) {
	NEED_CTX();
	if (off || flags || h == 0) return INVALID_VALUE;
	// Mapped without access until cuMemSetAccess, as on a GPU.
	void *m = mmap((void *)(uintptr_t)p, size, PROT_NONE, MAP_SHARED | MAP_FIXED, (int)(h - 1), 0);
	if (m == MAP_FAILED) return INVALID_VALUE;
	live_mapped++;
	return OK;
}
CUresult cuMemSetAccess(uint64_t p, size_t size, const CUmemAccessDesc *d, size_t n) {
	NEED_CTX();
	load_gpus();
	if (n != 1 || d->location.type != 1 || d->location.id < 0 || d->location.id >= ngpus || (d->flags != 1 && d->flags != 3)) return INVALID_VALUE;
	last_access_dev = d->location.id;
	return mprotect((void *)(uintptr_t)p, size, d->flags == 3 ? PROT_READ | PROT_WRITE : PROT_READ) ? INVALID_VALUE : OK;
}
CUresult cuMemUnmap(uint64_t p, size_t size) {
	NEED_CTX();
	void *m = mmap((void *)(uintptr_t)p, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
	if (m == MAP_FAILED) return INVALID_VALUE;
	live_mapped--;
	return OK;
}
CUresult cuMemAlloc_v2(uint64_t *p, size_t n) { NEED_CTX(); *p = (uint64_t)(uintptr_t)malloc(n); live_allocs++; return *p ? OK : OUT_OF_MEMORY; }
CUresult cuMemFree_v2(uint64_t p) { NEED_CTX(); free((void *)(uintptr_t)p); live_allocs--; return OK; }
CUresult cuMemcpyHtoD_v2(uint64_t dst, const void *src, size_t n) { NEED_CTX(); memcpy((void *)(uintptr_t)dst, src, n); return OK; }
CUresult cuMemcpyDtoH_v2(void *dst, uint64_t src, size_t n) { NEED_CTX(); memcpy(dst, (void *)(uintptr_t)src, n); return OK; }
CUresult cuMemcpy(uint64_t dst, uint64_t src, size_t n) { NEED_CTX(); memcpy((void *)(uintptr_t)dst, (void *)(uintptr_t)src, n); return OK; }

// Channels: pinned host memory and stream memory operations. A registered
// range's "device address" is its host address plus DEV_OFFSET, so that a
// client passing host addresses to stream operations fails. Streams run
// nothing asynchronously here: a write lands at once, and a wait whose
// value is not there yet can never be satisfied by a write queued before
// it, so it fails with CUDA_ERROR_NOT_READY (a real GPU would wait): in a
// channel every wait's value is written before the CPU hands the message
// over, so that failure is a protocol mistake.
#define DEV_OFFSET ((uintptr_t)1 << 46)
static struct { uintptr_t p; size_t n; } regs[64];
static long live_registered, calls_write, calls_wait, wait_unmet;
static uintptr_t last_stream;

long fake_live_registered(void) { return live_registered; }
long fake_writes(void) { return calls_write; }
long fake_waits(void) { return calls_wait; }
long fake_waits_unmet(void) { return wait_unmet; }
long fake_last_stream(void) { return (long)last_stream; }

CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned flags) {
	NEED_CTX();
	if (!p || !n || flags != 3) return INVALID_VALUE; // PORTABLE | DEVICEMAP
	int free_i = -1;
	for (int i = 0; i < 64; i++) {
		if (regs[i].n && (uintptr_t)p < regs[i].p + regs[i].n && regs[i].p < (uintptr_t)p + n) return ALREADY_REGISTERED;
		if (!regs[i].n && free_i < 0) free_i = i;
	}
	if (free_i < 0) return OUT_OF_MEMORY;
	regs[free_i].p = (uintptr_t)p;
	regs[free_i].n = n;
	live_registered++;
	return OK;
}
CUresult cuMemHostUnregister(void *p) {
	NEED_CTX();
	for (int i = 0; i < 64; i++) {
		if (regs[i].n && regs[i].p == (uintptr_t)p) {
			regs[i].n = 0;
			live_registered--;
			return OK;
		}
	}
	return NOT_REGISTERED;
}
CUresult cuMemHostGetDevicePointer_v2(uint64_t *d, void *p, unsigned flags) {
	NEED_CTX();
	if (flags != 0) return INVALID_VALUE;
	for (int i = 0; i < 64; i++) {
		if (regs[i].n && (uintptr_t)p >= regs[i].p && (uintptr_t)p < regs[i].p + regs[i].n) {
			*d = (uint64_t)((uintptr_t)p + DEV_OFFSET);
			return OK;
		}
	}
	return INVALID_VALUE;
}
// The host word behind a device address of a registered range, or NULL.
static volatile uint64_t *word(uint64_t addr) {
	uintptr_t h = (uintptr_t)addr - DEV_OFFSET;
	if (addr < DEV_OFFSET || h % 8) return NULL;
	for (int i = 0; i < 64; i++)
		if (regs[i].n && h >= regs[i].p && h + 8 <= regs[i].p + regs[i].n) return (volatile uint64_t *)h;
	return NULL;
}
CUresult cuStreamWriteValue64_v2(void *stream, uint64_t addr, uint64_t v, unsigned flags) {
	NEED_CTX();
	volatile uint64_t *w = word(addr);
	if (!stream || !w || flags != 0) return INVALID_VALUE;
	last_stream = (uintptr_t)stream;
	__atomic_store_n(w, v, __ATOMIC_RELEASE);
	calls_write++;
	return OK;
}
// cuStreamBatchMemOp: the writes and waits above, in order, in one call.
// Each operation is CUstreamBatchMemOpParams (48 bytes: the type in the
// first u32, the address at 8, the value at 16, the flags at 24).
typedef struct { uint32_t type, pad; uint64_t addr, value; uint32_t flags, pad2; uint64_t alias, pad3; } MemOp;
static long calls_batch, batch_ops;
long fake_batches(void) { return calls_batch; }
long fake_batch_ops(void) { return batch_ops; }
CUresult cuStreamWaitValue64_v2(void *stream, uint64_t addr, uint64_t v, unsigned flags);
CUresult cuStreamBatchMemOp_v2(void *stream, unsigned n, const MemOp *ops, unsigned flags) {
	NEED_CTX();
	if (sizeof(MemOp) != 48 || !stream || !ops || n == 0 || n >= 256 || flags != 0) return INVALID_VALUE;
	for (unsigned i = 0; i < n; i++) {
		if ((ops[i].type != 4 && ops[i].type != 5) || ops[i].flags != 0 || !word(ops[i].addr)) return INVALID_VALUE;
	}
	calls_batch++;
	for (unsigned i = 0; i < n; i++) {
		CUresult r = ops[i].type == 5 ? cuStreamWriteValue64_v2(stream, ops[i].addr, ops[i].value, 0)
		                              : cuStreamWaitValue64_v2(stream, ops[i].addr, ops[i].value, 0);
		batch_ops++;
		if (r) return r;
	}
	return OK;
}
CUresult cuStreamWaitValue64_v2(void *stream, uint64_t addr, uint64_t v, unsigned flags) {
	NEED_CTX();
	volatile uint64_t *w = word(addr);
	if (!stream || !w || flags != 0) return INVALID_VALUE; // flags 0: wait for >= v
	last_stream = (uintptr_t)stream;
	calls_wait++;
	if (__atomic_load_n(w, __ATOMIC_ACQUIRE) < v) {
		wait_unmet++;
		return NOT_READY;
	}
	return OK;
}
