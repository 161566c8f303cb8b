/*
 * gpushm_alloc: a CUDA allocator whose every allocation is a CUDA VMM
 * allocation with a POSIX-fd handle, so that it can be exported and
 * published through gpushm without a copy. The API is in gpushm_alloc.h;
 * docs/allocator.md says how to use it and what it cannot do.
 *
 * Builds without the CUDA toolkit: the few driver types are declared below
 * and in internal/cuda/vmm.h, which the Go package shares (checked against
 * cuda.h by `make check-cuda-h` where a toolkit is installed), and every
 * driver entry point is resolved from libcuda.so.1 on first use.
 *
 * The whole of the library's state:
 *   cu      driver entry points, and the GPUSHM_PEER_ACCESS switch, written
 *           once under load_once;
 *   devs[]  each device's retained primary context, granularity and peers,
 *           written once under dev_mu and published by a release store of
 *           .ready;
 *   tab     the live allocations sorted by base address, under tab.mu;
 *   the preload switch and the runtime's own cudaMalloc/cudaFree, once found.
 * No lock is ever taken while another is held.
 */
#define _GNU_SOURCE
#include "gpushm_alloc.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <link.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Values from cuda.h of CUDA 13.0 (the same in 12.x). */
#define GS_CONSTANTS(X)                                   \
	X(CUDA_SUCCESS, 0)                                \
	X(CUDA_ERROR_INVALID_VALUE, 1)                    \
	X(CUDA_ERROR_OUT_OF_MEMORY, 2)                    \
	X(CUDA_ERROR_INVALID_DEVICE, 101)                 \
	X(CU_MEM_ALLOCATION_TYPE_PINNED, 0x1)             \
	X(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0x1)  \
	X(CU_MEM_LOCATION_TYPE_DEVICE, 0x1)               \
	X(CU_MEM_ACCESS_FLAGS_PROT_READWRITE, 0x3)        \
	X(CU_MEM_ALLOC_GRANULARITY_MINIMUM, 0x0)

/* cudaError_t values (driver_types.h) that cudaMalloc and cudaFree return. */
#define GS_RUNTIME_ERRORS(X)                  \
	X(cudaSuccess, 0)                     \
	X(cudaErrorInvalidValue, 1)           \
	X(cudaErrorMemoryAllocation, 2)       \
	X(cudaErrorInitializationError, 3)    \
	X(cudaErrorUnknown, 999)

#ifdef GPUSHM_CHECK_CUDA_H
/* Compile-only check against a toolkit's headers: every constant, layout and
 * prototype below must agree with them. */
#include <cuda.h>
#include <driver_types.h>
#define GS_ASSERT_EQ(name, value) _Static_assert(name == value, #name " differs from the CUDA headers");
GS_CONSTANTS(GS_ASSERT_EQ)
GS_RUNTIME_ERRORS(GS_ASSERT_EQ)
#else
typedef int CUresult; /* enum cudaError_enum; an enum is int-sized */
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct CUctx_st *CUcontext;
typedef int CUmemAllocationType, CUmemAllocationHandleType, CUmemLocationType,
	CUmemAccess_flags, CUmemAllocationGranularity_flags; /* enums, int-sized */
#define GS_ENUMERATOR(name, value) name = value,
enum { GS_CONSTANTS(GS_ENUMERATOR) };
enum { GS_RUNTIME_ERRORS(GS_ENUMERATOR) };
#endif
/* The VMM structures and their layout checks, shared with the Go package. */
#include "../internal/cuda/vmm.h"

/* Driver entry points: field name (the cuda.h name), exported symbol, and
 * parameters. The _v2 symbols are the ones cuda.h maps the names to. */
#define GS_DRIVER(X)                                                                                   \
	X(cuInit, "cuInit", (unsigned int))                                                            \
	X(cuGetErrorName, "cuGetErrorName", (CUresult, const char **))                                 \
	X(cuDeviceGet, "cuDeviceGet", (CUdevice *, int))                                               \
	X(cuDeviceGetCount, "cuDeviceGetCount", (int *))                                               \
	X(cuDeviceCanAccessPeer, "cuDeviceCanAccessPeer", (int *, CUdevice, CUdevice))                 \
	X(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", (CUcontext *, CUdevice))               \
	X(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2", (CUdevice))                       \
	X(cuCtxGetCurrent, "cuCtxGetCurrent", (CUcontext *))                                           \
	X(cuCtxSetCurrent, "cuCtxSetCurrent", (CUcontext))                                             \
	X(cuCtxGetDevice, "cuCtxGetDevice", (CUdevice *))                                              \
	X(cuCtxSynchronize, "cuCtxSynchronize", (void))                                                \
	X(cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity",                              \
	  (size_t *, const CUmemAllocationProp *, CUmemAllocationGranularity_flags))                   \
	X(cuMemCreate, "cuMemCreate",                                                                  \
	  (CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long))   \
	X(cuMemRelease, "cuMemRelease", (CUmemGenericAllocationHandle))                                \
	X(cuMemRetainAllocationHandle, "cuMemRetainAllocationHandle",                                  \
	  (CUmemGenericAllocationHandle *, void *))                                                    \
	X(cuMemExportToShareableHandle, "cuMemExportToShareableHandle",                                \
	  (void *, CUmemGenericAllocationHandle, CUmemAllocationHandleType, unsigned long long))       \
	X(cuMemAddressReserve, "cuMemAddressReserve",                                                  \
	  (CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long))                            \
	X(cuMemAddressFree, "cuMemAddressFree", (CUdeviceptr, size_t))                                 \
	X(cuMemMap, "cuMemMap", (CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long)) \
	X(cuMemUnmap, "cuMemUnmap", (CUdeviceptr, size_t))                                             \
	X(cuMemSetAccess, "cuMemSetAccess", (CUdeviceptr, size_t, const CUmemAccessDesc *, size_t))

#define GS_FIELD(name, sym, params) CUresult (*name) params;
static struct {
	GS_DRIVER(GS_FIELD)
} cu;

#ifdef GPUSHM_CHECK_CUDA_H
/* Assigning each cuda.h function to its slot makes the compiler compare the
 * prototypes above with the real ones. */
#define GS_CHECK_PROTOTYPE(name, sym, params) cu.name = name;
__attribute__((unused)) static void check_prototypes(void) { GS_DRIVER(GS_CHECK_PROTOTYPE) }
#endif

/* ---- errors ---- */

static _Thread_local char last_err[256];

__attribute__((format(printf, 1, 2))) static void fail_msg(const char *fmt, ...) {
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(last_err, sizeof last_err, fmt, ap);
	va_end(ap);
}

static void format_cu(char *buf, size_t len, const char *call, CUresult r) {
	const char *name = NULL;
	if (cu.cuGetErrorName == NULL || cu.cuGetErrorName(r, &name) != CUDA_SUCCESS || name == NULL) {
		name = "unknown CUresult";
	}
	snprintf(buf, len, "%s: %s (%d)", call, name, (int)r);
}

/* Records a failed driver call as this thread's last error and returns r. */
static int fail_cu(const char *call, CUresult r) {
	format_cu(last_err, sizeof last_err, call, r);
	return (int)r;
}

/* A failure while undoing or cleaning up cannot be returned (the caller gets
 * the error that started it, or success), but it may leak memory or leave
 * the wrong context current, so it is never silent. */
static void report(const char *call, CUresult r) {
	char buf[256];
	if (r == CUDA_SUCCESS) {
		return;
	}
	format_cu(buf, sizeof buf, call, r);
	fprintf(stderr, "gpushm: %s (GPU memory or a context may be left behind)\n", buf);
}

/* ---- the driver ---- */

static pthread_once_t load_once = PTHREAD_ONCE_INIT;
static int load_rc; /* 0, -ELIBACC, or cuInit's CUresult */
static char load_msg[256];
static int grant_peers; /* see struct dev's access */

static int load_sym(void *h, const char *sym, void *slot) {
	void *p = dlsym(h, sym);
	if (p == NULL) {
		snprintf(load_msg, sizeof load_msg,
			 "libcuda.so.1 lacks %s: the NVIDIA driver is too old for CUDA VMM (need 11.0 or later)", sym);
		return 0;
	}
	memcpy(slot, &p, sizeof p);
	return 1;
}

static void load_driver(void) {
	const char *peers = getenv("GPUSHM_PEER_ACCESS");
	CUresult r;

	grant_peers = peers == NULL || strcmp(peers, "0") != 0;
	/* RTLD_LOCAL: the driver is ours to call, not to put in anyone's scope.
	 * It stays loaded for the life of the process: a driver cannot be
	 * unloaded safely once used. */
	void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
	if (h == NULL) {
		const char *e = dlerror();
		snprintf(load_msg, sizeof load_msg, "dlopen libcuda.so.1: %s (is the NVIDIA driver installed?)",
			 e != NULL ? e : "failed");
		load_rc = -ELIBACC;
		return;
	}
#define GS_LOAD(name, sym, params)              \
	if (!load_sym(h, sym, &cu.name)) {      \
		load_rc = -ELIBACC;             \
		return;                         \
	}
	GS_DRIVER(GS_LOAD)
#undef GS_LOAD
	if ((r = cu.cuInit(0)) != CUDA_SUCCESS) {
		format_cu(load_msg, sizeof load_msg, "cuInit", r);
		load_rc = (int)r;
	}
}

/* Loads and initialises the driver once; later calls return the first
 * result, copying its message into this thread's last error. */
static int load(void) {
	pthread_once(&load_once, load_driver);
	if (load_rc != 0) {
		snprintf(last_err, sizeof last_err, "%s", load_msg);
	}
	return load_rc;
}

/* ---- devices ---- */

enum { GS_MAX_DEVICES = 64 };

static struct dev {
	atomic_int ready;
	CUcontext ctx; /* the primary context, retained for the life of the process */
	size_t gran;   /* minimum granularity for POSIX-fd allocations */
	/* The ordinals given access to every allocation: this device, then,
	 * unless GPUSHM_PEER_ACCESS=0, each device that can access it as a peer.
	 * cudaMalloc memory becomes reachable from a peer once the program
	 * enables peer access, but that switch does not reach VMM allocations
	 * (docs/allocator.md): without the peers here, a copy made by another
	 * GPU from this memory fails with CUDA_ERROR_INVALID_VALUE.
	 * Granting them costs about 1 ms per allocation plus 9 ms per GiB on
	 * two H200s; a process that sees one GPU pays nothing. */
	int access[GS_MAX_DEVICES];
	int naccess;
} devs[GS_MAX_DEVICES];
static pthread_mutex_t dev_mu = PTHREAD_MUTEX_INITIALIZER;

static void prop_init(CUmemAllocationProp *p, int ordinal) {
	/* The driver requires every reserved and Windows-only field zero. */
	memset(p, 0, sizeof *p);
	p->type = CU_MEM_ALLOCATION_TYPE_PINNED;
	p->requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
	p->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	p->location.id = ordinal;
}

static int dev_init(struct dev *d, int ordinal) {
	CUmemAllocationProp prop;
	CUdevice cd, peer;
	CUcontext ctx;
	size_t gran;
	CUresult r;
	int n, i, can;

	if ((r = cu.cuDeviceGet(&cd, ordinal)) != CUDA_SUCCESS) {
		return fail_cu("cuDeviceGet", r);
	}
	if ((r = cu.cuDevicePrimaryCtxRetain(&ctx, cd)) != CUDA_SUCCESS) {
		return fail_cu("cuDevicePrimaryCtxRetain", r);
	}
	prop_init(&prop, ordinal);
	if ((r = cu.cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM)) != CUDA_SUCCESS) {
		fail_cu("cuMemGetAllocationGranularity", r);
		goto release;
	}
	d->access[0] = ordinal;
	d->naccess = 1;
	if ((r = cu.cuDeviceGetCount(&n)) != CUDA_SUCCESS) {
		fail_cu("cuDeviceGetCount", r);
		goto release;
	}
	for (i = 0; grant_peers && i < n && i < GS_MAX_DEVICES; i++) {
		if (i == ordinal) {
			continue;
		}
		if ((r = cu.cuDeviceGet(&peer, i)) != CUDA_SUCCESS) {
			fail_cu("cuDeviceGet", r);
			goto release;
		}
		if ((r = cu.cuDeviceCanAccessPeer(&can, peer, cd)) != CUDA_SUCCESS) {
			fail_cu("cuDeviceCanAccessPeer", r);
			goto release;
		}
		if (can) {
			d->access[d->naccess++] = i;
		}
	}
	d->ctx = ctx;
	d->gran = gran;
	atomic_store_explicit(&d->ready, 1, memory_order_release);
	return 0;

release:
	report("cuDevicePrimaryCtxRelease", cu.cuDevicePrimaryCtxRelease(cd));
	return (int)r;
}

static int dev_get(int ordinal, struct dev **out) {
	struct dev *d;
	int r = 0;

	if (ordinal < 0 || ordinal >= GS_MAX_DEVICES) {
		fail_msg("device %d: no such device (gpushm_alloc handles ordinals 0 to %d)", ordinal, GS_MAX_DEVICES - 1);
		return CUDA_ERROR_INVALID_DEVICE;
	}
	d = &devs[ordinal];
	if (!atomic_load_explicit(&d->ready, memory_order_acquire)) {
		pthread_mutex_lock(&dev_mu);
		if (!atomic_load_explicit(&d->ready, memory_order_relaxed)) {
			r = dev_init(d, ordinal);
		}
		pthread_mutex_unlock(&dev_mu);
		if (r != 0) {
			return r;
		}
	}
	*out = d;
	return 0;
}

/* The caller may be the CUDA runtime, with its own current context, on any
 * device: switch to d's primary context for the driver calls and switch
 * back afterwards, so the caller's state is as it was. */
static int ctx_enter(const struct dev *d, CUcontext *prev) {
	CUresult r;
	if ((r = cu.cuCtxGetCurrent(prev)) != CUDA_SUCCESS) {
		return fail_cu("cuCtxGetCurrent", r);
	}
	if (*prev != d->ctx && (r = cu.cuCtxSetCurrent(d->ctx)) != CUDA_SUCCESS) {
		return fail_cu("cuCtxSetCurrent", r);
	}
	return 0;
}

static void ctx_leave(const struct dev *d, CUcontext prev) {
	if (prev != d->ctx) {
		report("cuCtxSetCurrent (restoring the caller's context)", cu.cuCtxSetCurrent(prev));
	}
}

/* ---- the allocation table ---- */

struct rec {
	CUdeviceptr base;
	size_t size; /* rounded up to the granularity: what is mapped */
	CUmemGenericAllocationHandle handle;
	int device;
};

static struct {
	pthread_mutex_t mu;
	struct rec *v; /* sorted by base; allocations never overlap */
	size_t n, cap;
	uint64_t bytes;
} tab = {.mu = PTHREAD_MUTEX_INITIALIZER};

/* The index of the first record based above p. The caller holds tab.mu. */
static size_t tab_upper(CUdeviceptr p) {
	size_t lo = 0, hi = tab.n;
	while (lo < hi) {
		size_t mid = lo + (hi - lo) / 2;
		if (tab.v[mid].base <= p) {
			lo = mid + 1;
		} else {
			hi = mid;
		}
	}
	return lo;
}

/* The record of the allocation containing p, or NULL. The caller holds tab.mu. */
static const struct rec *tab_find(CUdeviceptr p) {
	size_t i = tab_upper(p);
	if (i == 0 || p - tab.v[i - 1].base >= tab.v[i - 1].size) {
		return NULL;
	}
	return &tab.v[i - 1];
}

static int tab_insert(const struct rec *r) {
	size_t i;
	pthread_mutex_lock(&tab.mu);
	if (tab.n == tab.cap) {
		size_t cap = tab.cap != 0 ? 2 * tab.cap : 64;
		struct rec *v = realloc(tab.v, cap * sizeof *v);
		if (v == NULL) {
			pthread_mutex_unlock(&tab.mu);
			fail_msg("gpushm_alloc: out of host memory for the allocation table");
			return -ENOMEM;
		}
		tab.v = v;
		tab.cap = cap;
	}
	i = tab_upper(r->base);
	memmove(&tab.v[i + 1], &tab.v[i], (tab.n - i) * sizeof *tab.v);
	tab.v[i] = *r;
	tab.n++;
	tab.bytes += r->size;
	pthread_mutex_unlock(&tab.mu);
	return 0;
}

/* Takes the allocation based at base out of the table, into *out. */
static int tab_remove(CUdeviceptr base, struct rec *out) {
	size_t i;
	int found;
	pthread_mutex_lock(&tab.mu);
	i = tab_upper(base);
	found = i > 0 && tab.v[i - 1].base == base;
	if (found) {
		*out = tab.v[i - 1];
		memmove(&tab.v[i - 1], &tab.v[i], (tab.n - i) * sizeof *tab.v);
		tab.n--;
		tab.bytes -= out->size;
	}
	pthread_mutex_unlock(&tab.mu);
	return found;
}

/* ---- allocate, free, export ---- */

static int vmm_alloc(int ordinal, size_t size, CUdeviceptr *out) {
	CUmemAccessDesc access[GS_MAX_DEVICES];
	CUmemAllocationProp prop;
	CUcontext prev;
	struct dev *d;
	struct rec rec;
	int r, i;

	if ((r = load()) != 0 || (r = dev_get(ordinal, &d)) != 0) {
		return r;
	}
	if (size > SIZE_MAX - d->gran) {
		fail_msg("gpushm_malloc: %zu bytes cannot be allocated", size);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	memset(&rec, 0, sizeof rec);
	rec.size = (size + d->gran - 1) / d->gran * d->gran;
	rec.device = ordinal;
	prop_init(&prop, ordinal);
	memset(access, 0, sizeof access);
	for (i = 0; i < d->naccess; i++) {
		access[i].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
		access[i].location.id = d->access[i];
		access[i].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
	}

	if ((r = ctx_enter(d, &prev)) != 0) {
		return r;
	}
	if ((r = cu.cuMemCreate(&rec.handle, rec.size, &prop, 0)) != CUDA_SUCCESS) {
		fail_cu("cuMemCreate", r);
		goto leave;
	}
	if ((r = cu.cuMemAddressReserve(&rec.base, rec.size, d->gran, 0, 0)) != CUDA_SUCCESS) {
		fail_cu("cuMemAddressReserve", r);
		goto release;
	}
	if ((r = cu.cuMemMap(rec.base, rec.size, 0, rec.handle, 0)) != CUDA_SUCCESS) {
		fail_cu("cuMemMap", r);
		goto unreserve;
	}
	/* Every device in one call, as the design notes' lessons ask. */
	if ((r = cu.cuMemSetAccess(rec.base, rec.size, access, (size_t)d->naccess)) != CUDA_SUCCESS) {
		fail_cu("cuMemSetAccess", r);
		goto unmap;
	}
	if ((r = tab_insert(&rec)) != 0) {
		goto unmap;
	}
	*out = rec.base;
	goto leave;

unmap:
	report("cuMemUnmap", cu.cuMemUnmap(rec.base, rec.size));
unreserve:
	report("cuMemAddressFree", cu.cuMemAddressFree(rec.base, rec.size));
release:
	report("cuMemRelease", cu.cuMemRelease(rec.handle));
leave:
	ctx_leave(d, prev);
	return r;
}

/* The first failure is the one returned and kept as the last error; later
 * ones go to stderr. */
static int keep_first(int err, const char *call, CUresult r) {
	if (r == CUDA_SUCCESS) {
		return err;
	}
	if (err != 0) {
		report(call, r);
		return err;
	}
	return fail_cu(call, r);
}

/* Frees the allocation based at base. Returns 0, a CUresult, or -ENOENT
 * (leaving the last error alone, since cudaFree then forwards the pointer)
 * when no live allocation is based there. */
static int vmm_free(CUdeviceptr base) {
	struct rec rec;
	struct dev *d;
	CUcontext prev;
	CUresult r;
	int err;

	if (!tab_remove(base, &rec)) {
		return -ENOENT;
	}
	d = &devs[rec.device]; /* ready: the allocation was made through it */
	if ((err = ctx_enter(d, &prev)) != 0) {
		if (tab_insert(&rec) != 0) {
			fprintf(stderr, "gpushm: %#llx lost from the allocation table\n", rec.base);
		}
		return err;
	}
	/* cudaFree waits for the device; cuMemUnmap does not, and unmapping
	 * memory that queued work still uses faults the context. */
	err = keep_first(0, "cuCtxSynchronize", cu.cuCtxSynchronize());
	if ((r = cu.cuMemUnmap(rec.base, rec.size)) != CUDA_SUCCESS) {
		err = keep_first(err, "cuMemUnmap", r);
		/* Still mapped, so still live: it stays in the table, where the
		 * stats show it and a later free may succeed. */
		if (tab_insert(&rec) != 0) {
			fprintf(stderr, "gpushm: %#llx lost from the allocation table\n", rec.base);
		}
		goto leave;
	}
	err = keep_first(err, "cuMemAddressFree", cu.cuMemAddressFree(rec.base, rec.size));
	err = keep_first(err, "cuMemRelease", cu.cuMemRelease(rec.handle));
leave:
	ctx_leave(d, prev);
	return err;
}

void *gpushm_malloc(ssize_t size, int device, void *stream) {
	CUdeviceptr p;
	(void)stream; /* the memory is ready on return, for every stream */
	if (size <= 0) {
		fail_msg("gpushm_malloc: size %zd is not positive", size);
		return NULL;
	}
	if (vmm_alloc(device, (size_t)size, &p) != 0) {
		return NULL;
	}
	return (void *)(uintptr_t)p;
}

void gpushm_free(void *ptr, ssize_t size, int device, void *stream) {
	int r;
	(void)size, (void)device, (void)stream; /* the table knows them */
	if (ptr == NULL) {
		return;
	}
	r = vmm_free((CUdeviceptr)(uintptr_t)ptr);
	if (r == -ENOENT) {
		fail_msg("gpushm_free: %p was not returned by gpushm_malloc, or was freed already", ptr);
	}
	if (r != 0) {
		/* PyTorch's free function returns nothing: say it here or nowhere. */
		fprintf(stderr, "gpushm: %s\n", last_err);
	}
}

int gpushm_export(uint64_t ptr, int *fd, uint64_t *base, uint64_t *alloc_size, int *device) {
	CUmemGenericAllocationHandle h;
	const struct rec *found;
	struct rec rec;
	struct dev *d;
	CUcontext prev;
	CUresult cr;
	int r, out = -1;

	if (fd == NULL || base == NULL || alloc_size == NULL || device == NULL) {
		fail_msg("gpushm_export: NULL output pointer");
		return -EINVAL;
	}
	pthread_mutex_lock(&tab.mu);
	found = tab_find(ptr);
	if (found == NULL) {
		pthread_mutex_unlock(&tab.mu);
		fail_msg("gpushm_export: %#" PRIx64 " is not inside a live gpushm allocation", ptr);
		return -ENOENT;
	}
	rec = *found;
	d = &devs[rec.device];
	/* A reference of our own, taken before the lock is dropped, keeps the
	 * memory valid if another thread frees the allocation during the export
	 * (which takes most of a millisecond: too long to hold the lock). */
	if ((r = ctx_enter(d, &prev)) == 0) {
		if ((cr = cu.cuMemRetainAllocationHandle(&h, (void *)(uintptr_t)rec.base)) != CUDA_SUCCESS) {
			r = fail_cu("cuMemRetainAllocationHandle", cr);
			ctx_leave(d, prev);
		}
	}
	pthread_mutex_unlock(&tab.mu);
	if (r != 0) {
		return r;
	}
	if ((cr = cu.cuMemExportToShareableHandle(&out, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)) != CUDA_SUCCESS) {
		r = fail_cu("cuMemExportToShareableHandle", cr);
	}
	report("cuMemRelease (after export)", cu.cuMemRelease(h));
	ctx_leave(d, prev);
	if (r != 0) {
		return r;
	}
	/* Like every descriptor Go and Python open: an exec'd program gets it
	 * only when handed it on purpose (pass_fds, ExtraFiles). */
	if (fcntl(out, F_SETFD, FD_CLOEXEC) == -1) {
		r = -errno;
		close(out);
		fail_msg("gpushm_export: fcntl(FD_CLOEXEC): %s", strerror(-r));
		return r;
	}
	*fd = out;
	*base = rec.base;
	*alloc_size = rec.size;
	*device = rec.device;
	return 0;
}

int gpushm_alloc_stats(uint64_t *live_allocations, uint64_t *live_bytes) {
	pthread_mutex_lock(&tab.mu);
	if (live_allocations != NULL) {
		*live_allocations = tab.n;
	}
	if (live_bytes != NULL) {
		*live_bytes = tab.bytes;
	}
	pthread_mutex_unlock(&tab.mu);
	return 0;
}

const char *gpushm_last_error(void) { return last_err; }

/* ---- LD_PRELOAD: cudaMalloc and cudaFree ---- */

static pthread_once_t preload_once = PTHREAD_ONCE_INIT;
static int preload;

static void read_preload(void) {
	const char *v = getenv("GPUSHM_PRELOAD");
	preload = v != NULL && strcmp(v, "1") == 0;
}

/* Whether cudaMalloc/cudaFree route here; loading the library for the
 * pluggable allocator must never change what they do. */
static int preload_on(void) {
	pthread_once(&preload_once, read_preload);
	return preload;
}

static int find_cudart(struct dl_phdr_info *info, size_t size, void *data) {
	const char *slash = strrchr(info->dlpi_name, '/');
	const char *name = slash != NULL ? slash + 1 : info->dlpi_name;
	(void)size;
	if (strncmp(name, "libcudart.so", strlen("libcudart.so")) != 0) {
		return 0;
	}
	*(const char **)data = info->dlpi_name;
	return 1;
}

/* The runtime's own entry point: the next definition after ours, or, for a
 * runtime loaded RTLD_LOCAL (out of RTLD_NEXT's reach, as a Python extension
 * may load it), the one in a loaded libcudart.so*. Found once, when first
 * needed: by then the caller's runtime is loaded. */
static void *runtime_sym(_Atomic(void *) *slot, const char *name) {
	const char *path = NULL;
	void *h, *f = atomic_load_explicit(slot, memory_order_acquire);

	if (f != NULL) {
		return f;
	}
	f = dlsym(RTLD_NEXT, name);
	if (f == NULL) {
		dl_iterate_phdr(find_cudart, &path);
		if (path != NULL && (h = dlopen(path, RTLD_LAZY | RTLD_NOLOAD)) != NULL) {
			f = dlsym(h, name);
			dlclose(h); /* drops only NOLOAD's reference; its loader keeps it */
		}
	}
	if (f != NULL) {
		atomic_store_explicit(slot, f, memory_order_release);
	}
	return f;
}

static _Atomic(void *) real_malloc, real_free;

static int forward_malloc(void **devPtr, size_t size) {
	int (*fn)(void **, size_t);
	void *f = runtime_sym(&real_malloc, "cudaMalloc");
	if (f == NULL) {
		fail_msg("cudaMalloc: no CUDA runtime (libcudart.so) is loaded to forward to");
		return cudaErrorInitializationError;
	}
	memcpy(&fn, &f, sizeof fn);
	return fn(devPtr, size);
}

static int forward_free(void *devPtr) {
	int (*fn)(void *);
	void *f = runtime_sym(&real_free, "cudaFree");
	if (f == NULL) {
		fail_msg("cudaFree: no CUDA runtime (libcudart.so) is loaded to forward to");
		return cudaErrorInitializationError;
	}
	memcpy(&fn, &f, sizeof fn);
	return fn(devPtr);
}

/* The cudaError_t for a failure here. The runtime's error string for it will
 * not say what happened, so anything but out-of-memory (which PyTorch handles
 * by emptying its cache and retrying) is also written to stderr. */
static int runtime_error(const char *call, int r) {
	if (r == CUDA_ERROR_OUT_OF_MEMORY || r == -ENOMEM) {
		return cudaErrorMemoryAllocation;
	}
	fprintf(stderr, "gpushm: %s: %s\n", call, last_err);
	if (r == CUDA_ERROR_INVALID_VALUE) {
		return cudaErrorInvalidValue;
	}
	if (r == -ELIBACC) {
		return cudaErrorInitializationError;
	}
	return cudaErrorUnknown;
}

/* The ordinal of the device the runtime would allocate on. */
static int current_device(int *ordinal) {
	CUcontext c;
	CUdevice cd, x;
	struct dev *d;
	CUresult cr;
	int r, n, i;

	if ((r = load()) != 0) {
		return r;
	}
	if ((cr = cu.cuCtxGetCurrent(&c)) != CUDA_SUCCESS) {
		return fail_cu("cuCtxGetCurrent", cr);
	}
	if (c == NULL) {
		/* cudaMalloc may be a program's first runtime call; the runtime
		 * would then make device 0's primary context current and leave it
		 * so, and so do we. */
		if ((r = dev_get(0, &d)) != 0) {
			return r;
		}
		if ((cr = cu.cuCtxSetCurrent(d->ctx)) != CUDA_SUCCESS) {
			return fail_cu("cuCtxSetCurrent", cr);
		}
		*ordinal = 0;
		return 0;
	}
	/* A CUdevice is not promised to equal its ordinal: look it up. */
	if ((cr = cu.cuCtxGetDevice(&cd)) != CUDA_SUCCESS) {
		return fail_cu("cuCtxGetDevice", cr);
	}
	if ((cr = cu.cuDeviceGetCount(&n)) != CUDA_SUCCESS) {
		return fail_cu("cuDeviceGetCount", cr);
	}
	for (i = 0; i < n; i++) {
		if ((cr = cu.cuDeviceGet(&x, i)) != CUDA_SUCCESS) {
			return fail_cu("cuDeviceGet", cr);
		}
		if (x == cd) {
			*ordinal = i;
			return 0;
		}
	}
	fail_msg("cudaMalloc: the current context's device %d has no ordinal", (int)cd);
	return CUDA_ERROR_INVALID_DEVICE;
}

int cudaMalloc(void **devPtr, size_t size) {
	CUdeviceptr p;
	int r, ordinal;

	/* Size 0 too: whatever the runtime does with it is what programs expect. */
	if (!preload_on() || size == 0) {
		return forward_malloc(devPtr, size);
	}
	if (devPtr == NULL) {
		fail_msg("cudaMalloc: devPtr is NULL");
		return cudaErrorInvalidValue;
	}
	if ((r = current_device(&ordinal)) != 0 || (r = vmm_alloc(ordinal, size, &p)) != 0) {
		return runtime_error("cudaMalloc", r);
	}
	*devPtr = (void *)(uintptr_t)p;
	return cudaSuccess;
}

int cudaFree(void *devPtr) {
	int r;
	/* cudaFree(NULL) is how programs initialise the runtime: it is the
	 * runtime's, as is every pointer we did not allocate. */
	if (preload_on() && devPtr != NULL) {
		r = vmm_free((CUdeviceptr)(uintptr_t)devPtr);
		if (r == 0) {
			return cudaSuccess;
		}
		if (r != -ENOENT) {
			return runtime_error("cudaFree", r);
		}
	}
	return forward_free(devPtr);
}
