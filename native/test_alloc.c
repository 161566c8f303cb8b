/*
 * test_alloc: tests and a benchmark of libgpushm_alloc.so on a GPU machine.
 *
 *   ./test_alloc [path/to/libgpushm_alloc.so]   (default: next to this program)
 *
 * Loads the library as PyTorch does (dlopen), allocates on device 0 (and 1
 * where there is one), exports from interior pointers and has child
 * processes (fork + exec of this program, never a bare fork: CUDA does not
 * survive fork) import, map, read and write the memory; checks failure
 * paths, context restoration, the cudaMalloc/cudaFree entry points, threads,
 * and that the allocation count and the device's free memory come back.
 * Prints a benchmark table at the end. Exits 1 if anything failed.
 */
#define _GNU_SOURCE
#include "gpushm_alloc.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* ---- the driver, for the test's own calls (layouts as in gpushm_alloc.c) ---- */

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct CUctx_st *CUcontext;

typedef struct {
	int type;
	int id;
} CUmemLocation;

typedef struct {
	int type;
	int requestedHandleTypes;
	CUmemLocation location;
	void *win32HandleMetaData;
	unsigned char allocFlags[8];
} CUmemAllocationProp;

typedef struct {
	CUmemLocation location;
	int flags;
} CUmemAccessDesc;

_Static_assert(sizeof(CUmemAllocationProp) == 32, "CUmemAllocationProp layout");
_Static_assert(sizeof(CUmemAccessDesc) == 12, "CUmemAccessDesc layout");

enum {
	POSIX_FD = 1,               /* CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR */
	LOCATION_DEVICE = 1,        /* CU_MEM_LOCATION_TYPE_DEVICE */
	PROT_READWRITE = 3,         /* CU_MEM_ACCESS_FLAGS_PROT_READWRITE */
	ALLOCATION_PINNED = 1,      /* CU_MEM_ALLOCATION_TYPE_PINNED */
	ATTRIBUTE_DEVICE_ORDINAL = 9 /* CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL */
};

#define DRIVER(X)                                                                                   \
	X(cuInit, "cuInit", (unsigned int))                                                         \
	X(cuGetErrorName, "cuGetErrorName", (CUresult, const char **))                              \
	X(cuDeviceGetCount, "cuDeviceGetCount", (int *))                                            \
	X(cuDeviceGet, "cuDeviceGet", (CUdevice *, int))                                            \
	X(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", (CUcontext *, CUdevice))            \
	X(cuCtxGetCurrent, "cuCtxGetCurrent", (CUcontext *))                                        \
	X(cuCtxSetCurrent, "cuCtxSetCurrent", (CUcontext))                                          \
	X(cuCtxSynchronize, "cuCtxSynchronize", (void))                                             \
	X(cuCtxEnablePeerAccess, "cuCtxEnablePeerAccess", (CUcontext, unsigned int))                \
	X(cuMemGetInfo, "cuMemGetInfo_v2", (size_t *, size_t *))                                    \
	X(cuMemAlloc, "cuMemAlloc_v2", (CUdeviceptr *, size_t))                                     \
	X(cuMemFree, "cuMemFree_v2", (CUdeviceptr))                                                 \
	X(cuMemsetD8, "cuMemsetD8_v2", (CUdeviceptr, unsigned char, size_t))                        \
	X(cuMemcpyHtoD, "cuMemcpyHtoD_v2", (CUdeviceptr, const void *, size_t))                     \
	X(cuMemcpyDtoH, "cuMemcpyDtoH_v2", (void *, CUdeviceptr, size_t))                           \
	X(cuMemcpyDtoD, "cuMemcpyDtoD_v2", (CUdeviceptr, CUdeviceptr, size_t))                      \
	X(cuPointerGetAttribute, "cuPointerGetAttribute", (void *, int, CUdeviceptr))               \
	X(cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity",                           \
	  (size_t *, const CUmemAllocationProp *, int))                                             \
	X(cuMemImportFromShareableHandle, "cuMemImportFromShareableHandle",                         \
	  (CUmemGenericAllocationHandle *, void *, int))                                            \
	X(cuMemCreate, "cuMemCreate", (CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long)) \
	X(cuMemAddressReserve, "cuMemAddressReserve",                                               \
	  (CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long))                         \
	X(cuMemAddressFree, "cuMemAddressFree", (CUdeviceptr, size_t))                              \
	X(cuMemMap, "cuMemMap", (CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long)) \
	X(cuMemUnmap, "cuMemUnmap", (CUdeviceptr, size_t))                                          \
	X(cuMemSetAccess, "cuMemSetAccess", (CUdeviceptr, size_t, const CUmemAccessDesc *, size_t)) \
	X(cuMemRelease, "cuMemRelease", (CUmemGenericAllocationHandle))

#define FIELD(name, sym, params) CUresult (*name) params;
static struct {
	DRIVER(FIELD)
} cu;

/* ---- the library under test ---- */

static struct {
	__typeof__(gpushm_malloc) *malloc;
	__typeof__(gpushm_free) *free;
	__typeof__(gpushm_export) *export;
	__typeof__(gpushm_alloc_stats) *stats;
	__typeof__(gpushm_last_error) *last_error;
	int (*cudaMalloc)(void **, size_t);
	int (*cudaFree)(void *);
} lib;

static atomic_int failures;

#define CHECK(cond, ...)                                                  \
	do {                                                              \
		if (!(cond)) {                                            \
			atomic_fetch_add(&failures, 1);                   \
			printf("FAIL %s:%d: ", __FILE__, __LINE__);       \
			printf(__VA_ARGS__);                              \
			printf("\n");                                     \
		}                                                         \
	} while (0)

/* A driver call the test itself makes must work; the test cannot go on otherwise. */
#define CU(call) cu_must(#call, (call), __LINE__)

static void cu_must(const char *what, CUresult r, int line) {
	const char *name = "?";
	if (r == 0) {
		return;
	}
	cu.cuGetErrorName(r, &name);
	printf("FATAL line %d: %s: %s (%d)\n", line, what, name, r);
	exit(2);
}

static void *sym(void *h, const char *name) {
	void *p = dlsym(h, name);
	if (p == NULL) {
		printf("FATAL: dlsym %s: %s\n", name, dlerror());
		exit(2);
	}
	return p;
}

static void load_driver(void) {
	void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL), *p;
	if (h == NULL) {
		printf("FATAL: dlopen libcuda.so.1: %s\n", dlerror());
		exit(2);
	}
#define LOAD(name, s, params) p = sym(h, s), memcpy(&cu.name, &p, sizeof p);
	DRIVER(LOAD)
#undef LOAD
	CU(cu.cuInit(0));
}

static void load_library(const char *path) {
	void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL), *p;
	if (h == NULL) {
		printf("FATAL: dlopen %s: %s\n", path, dlerror());
		exit(2);
	}
#define LOAD(field, name) p = sym(h, name), memcpy(&lib.field, &p, sizeof p);
	LOAD(malloc, "gpushm_malloc")
	LOAD(free, "gpushm_free")
	LOAD(export, "gpushm_export")
	LOAD(stats, "gpushm_alloc_stats")
	LOAD(last_error, "gpushm_last_error")
	LOAD(cudaMalloc, "cudaMalloc")
	LOAD(cudaFree, "cudaFree")
#undef LOAD
}

enum { MiB = 1 << 20 };
static const uint64_t GiB = 1ull << 30;

static int ndev;
static CUcontext ctx[2];
static size_t gran;

static CUcontext current(void) {
	CUcontext c;
	CU(cu.cuCtxGetCurrent(&c));
	return c;
}

static void set_current(CUcontext c) { CU(cu.cuCtxSetCurrent(c)); }

static size_t round_up(size_t n) { return (n + gran - 1) / gran * gran; }

static uint64_t live_count(void) {
	uint64_t n, b;
	lib.stats(&n, &b);
	return n;
}

static uint64_t live_bytes(void) {
	uint64_t n, b;
	lib.stats(&n, &b);
	return b;
}

static size_t free_mem(int dev) {
	CUcontext saved = current();
	size_t free, total;
	set_current(ctx[dev]);
	CU(cu.cuMemGetInfo(&free, &total));
	set_current(saved);
	return free;
}

static int ordinal_of(CUdeviceptr p) {
	int ord = -1;
	CU(cu.cuPointerGetAttribute(&ord, ATTRIBUTE_DEVICE_ORDINAL, p));
	return ord;
}

/* Byte off of a pattern that no shift or stale copy reproduces by accident. */
static uint8_t pattern(uint64_t off, unsigned seed) { return (uint8_t)((off * 131u + seed) ^ (off >> 9)); }

static double now_us(void) {
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

/* ---- the child: import, map, read, write ---- */

/*
 * test_alloc --child FD ALLOC_SIZE OFF LEN SEED ACCESS USE MARKER MARKER_OFF
 * maps the allocation exported as FD with access for every device in ACCESS
 * (a comma list) in one cuMemSetAccess, checks LEN bytes at OFF against the
 * pattern SEED by a copy made on device USE, and sets 4096 bytes at
 * MARKER_OFF to MARKER from device USE.
 */
static int child(char **argv) {
	int fd = atoi(argv[2]), use = atoi(argv[8]), marker = atoi(argv[9]), bad = 0, n = 0;
	uint64_t size = strtoull(argv[3], NULL, 0), off = strtoull(argv[4], NULL, 0);
	uint64_t len = strtoull(argv[5], NULL, 0), marker_off = strtoull(argv[10], NULL, 0);
	unsigned seed = (unsigned)atoi(argv[6]);
	CUmemAccessDesc desc[8];
	CUmemAllocationProp prop;
	CUmemGenericAllocationHandle h;
	CUdeviceptr p, tmp;
	CUcontext c;
	CUdevice d;
	uint8_t *buf;
	char *s, *save = NULL, access[32];
	size_t g;

	load_driver();
	CU(cu.cuDeviceGet(&d, use));
	CU(cu.cuDevicePrimaryCtxRetain(&c, d));
	set_current(c);
	memset(&prop, 0, sizeof prop);
	prop.type = ALLOCATION_PINNED;
	prop.requestedHandleTypes = POSIX_FD;
	prop.location.type = LOCATION_DEVICE;
	prop.location.id = use;
	CU(cu.cuMemGetAllocationGranularity(&g, &prop, 0));
	snprintf(access, sizeof access, "%s", argv[7]);
	memset(desc, 0, sizeof desc);
	for (s = strtok_r(argv[7], ",", &save); s != NULL && n < 8; s = strtok_r(NULL, ",", &save), n++) {
		desc[n].location.type = LOCATION_DEVICE;
		desc[n].location.id = atoi(s);
		desc[n].flags = PROT_READWRITE;
	}
	CU(cu.cuMemImportFromShareableHandle(&h, (void *)(uintptr_t)fd, POSIX_FD));
	CU(cu.cuMemAddressReserve(&p, size, g, 0, 0));
	CU(cu.cuMemMap(p, size, 0, h, 0));
	CU(cu.cuMemSetAccess(p, size, desc, (size_t)n));
	CU(cu.cuMemRelease(h)); /* the mapping keeps the memory */
	close(fd);

	/* Copy on device `use` into its own memory first, so that device (not
	 * just the host) is shown to reach the mapping. */
	buf = malloc(len);
	CU(cu.cuMemAlloc(&tmp, len));
	CU(cu.cuMemcpyDtoD(tmp, p + off, len));
	CU(cu.cuMemcpyDtoH(buf, tmp, len));
	for (uint64_t i = 0; i < len; i++) {
		if (buf[i] != pattern(off + i, seed) && bad++ < 5) {
			printf("child: byte %" PRIu64 " is %#x, want %#x\n", off + i, buf[i], pattern(off + i, seed));
		}
	}
	CU(cu.cuMemsetD8(p + marker_off, (unsigned char)marker, 4096));
	CU(cu.cuCtxSynchronize());
	CU(cu.cuMemFree(tmp));
	CU(cu.cuMemUnmap(p, size));
	CU(cu.cuMemAddressFree(p, size));
	free(buf);
	printf("  child pid %d on device %d (access %s): %" PRIu64 " bytes at offset %" PRIu64 " %s; wrote %#x at %" PRIu64 "\n",
	       (int)getpid(), use, access, len, off, bad ? "DIFFER" : "match", marker, marker_off);
	return bad ? 1 : 0;
}

/* Runs this program with argv (NULL-terminated), keeping fd (if >= 0) open
 * across exec; returns its exit status. */
static int run_self(char **argv, int fd) {
	int status;
	pid_t pid;
	fflush(stdout);
	pid = fork();
	if (pid == 0) {
		/* Only async-signal-safe calls between fork and exec. */
		if (fd >= 0) {
			fcntl(fd, F_SETFD, 0);
		}
		execv("/proc/self/exe", argv);
		_exit(127);
	}
	if (pid < 0 || waitpid(pid, &status, 0) != pid) {
		return -1;
	}
	return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

/* Runs the child with fd inherited; returns its exit status. */
static int spawn_child(int fd, uint64_t size, uint64_t off, uint64_t len, unsigned seed, const char *access, int use,
		       int marker, uint64_t marker_off) {
	char a[9][32], *argv[12];

	snprintf(a[0], 32, "%d", fd);
	snprintf(a[1], 32, "%" PRIu64, size);
	snprintf(a[2], 32, "%" PRIu64, off);
	snprintf(a[3], 32, "%" PRIu64, len);
	snprintf(a[4], 32, "%u", seed);
	snprintf(a[5], 32, "%s", access);
	snprintf(a[6], 32, "%d", use);
	snprintf(a[7], 32, "%d", marker);
	snprintf(a[8], 32, "%" PRIu64, marker_off);
	argv[0] = "test_alloc";
	argv[1] = "--child";
	for (int i = 0; i < 9; i++) {
		argv[i + 2] = a[i];
	}
	argv[11] = NULL;
	return run_self(argv, fd);
}

static const char *cu_name(CUresult r) {
	const char *name = NULL;
	if (cu.cuGetErrorName(r, &name) != 0 || name == NULL) {
		return "?";
	}
	return name;
}

/*
 * test_alloc --peer-probe ENABLE: what device 1 can do with a device-0 VMM
 * allocation mapped for device 0 only, after cuCtxEnablePeerAccess when
 * ENABLE is 1 (the runtime's cudaDeviceEnablePeerAccess). In a process of its
 * own because a fault there would poison device 1's context.
 */
static int peer_probe(int enable) {
	CUmemAllocationProp prop;
	CUmemAccessDesc desc;
	CUmemGenericAllocationHandle h;
	CUdeviceptr p, buf;
	CUresult r0 = 0, r1, r2 = -1;
	CUcontext c0, c1;
	CUdevice d0, d1;
	uint8_t b[4096];
	int ok = 0;
	size_t g;

	load_driver();
	CU(cu.cuDeviceGet(&d0, 0));
	CU(cu.cuDeviceGet(&d1, 1));
	CU(cu.cuDevicePrimaryCtxRetain(&c0, d0));
	CU(cu.cuDevicePrimaryCtxRetain(&c1, d1));
	set_current(c0);
	memset(&prop, 0, sizeof prop);
	prop.type = ALLOCATION_PINNED;
	prop.requestedHandleTypes = POSIX_FD;
	prop.location.type = LOCATION_DEVICE;
	CU(cu.cuMemGetAllocationGranularity(&g, &prop, 0));
	CU(cu.cuMemCreate(&h, g, &prop, 0));
	CU(cu.cuMemAddressReserve(&p, g, g, 0, 0));
	CU(cu.cuMemMap(p, g, 0, h, 0));
	memset(&desc, 0, sizeof desc);
	desc.location.type = LOCATION_DEVICE;
	desc.location.id = 0;
	desc.flags = PROT_READWRITE;
	CU(cu.cuMemSetAccess(p, g, &desc, 1));
	CU(cu.cuMemsetD8(p, 0x5C, g));
	CU(cu.cuCtxSynchronize());
	set_current(c1);
	if (enable) {
		r0 = cu.cuCtxEnablePeerAccess(c0, 0);
	}
	CU(cu.cuMemAlloc(&buf, sizeof b));
	r1 = cu.cuMemcpyDtoD(buf, p, sizeof b);
	if (r1 == 0) {
		r2 = cu.cuCtxSynchronize();
	}
	if (r1 == 0 && r2 == 0 && cu.cuMemcpyDtoH(b, buf, sizeof b) == 0) {
		ok = 1;
		for (size_t i = 0; i < sizeof b; i++) {
			ok &= b[i] == 0x5C;
		}
	}
	printf("  probe: device 1 copying from a device-0 VMM allocation mapped for device 0 only%s: cuMemcpyDtoD %s, "
	       "cuCtxSynchronize %s, data %s\n",
	       enable ? (r0 == 0 ? ", after cuCtxEnablePeerAccess" : ", cuCtxEnablePeerAccess FAILED") : "", cu_name(r1),
	       r1 == 0 ? cu_name(r2) : "(not reached)", ok ? "correct" : "not read");
	return 0;
}

static int all_bytes(CUdeviceptr p, size_t n, uint8_t v) {
	uint8_t *b = malloc(n);
	int ok = 1;
	CU(cu.cuMemcpyDtoH(b, p, n));
	for (size_t i = 0; i < n; i++) {
		ok &= b[i] == v;
	}
	free(b);
	return ok;
}

static void fill_pattern(CUdeviceptr p, uint64_t off, size_t len, unsigned seed) {
	uint8_t *b = malloc(len);
	for (size_t i = 0; i < len; i++) {
		b[i] = pattern(off + i, seed);
	}
	CU(cu.cuMemcpyHtoD(p + off, b, len));
	free(b);
}

/* ---- tests ---- */

static void test_sizes_and_sharing(void) {
	static const size_t sizes[] = {1, 4096, 2 * MiB, 2 * MiB + 1, 64 * MiB, 1ull << 30};
	enum { N = sizeof sizes / sizeof sizes[0], BIG = 4 };
	const uint64_t off = 3 * MiB + 12345, len = MiB;
	CUdeviceptr p[N];
	uint64_t bytes = 0, base, size;
	int fd, dev, r, rc;

	printf("== sizes, interior exports, two processes\n");
	for (int i = 0; i < N; i++) {
		p[i] = (CUdeviceptr)(uintptr_t)lib.malloc((ssize_t)sizes[i], 0, NULL);
		CHECK(p[i] != 0, "gpushm_malloc(%zu): %s", sizes[i], lib.last_error());
		if (p[i] == 0) {
			exit(2);
		}
		CHECK(p[i] % gran == 0, "gpushm_malloc(%zu) = %#llx, not aligned to %zu", sizes[i], p[i], gran);
		CHECK(current() == ctx[0], "gpushm_malloc changed the current context");
		CHECK(ordinal_of(p[i]) == 0, "gpushm_malloc(%zu, device 0) is on device %d", sizes[i], ordinal_of(p[i]));
		/* Every byte of the rounded size is mapped and writable. */
		CU(cu.cuMemsetD8(p[i], 0xA5, round_up(sizes[i])));
		bytes += round_up(sizes[i]);
	}
	CHECK(live_count() == N && live_bytes() == bytes, "stats %" PRIu64 " allocations, %" PRIu64 " bytes; want %d, %" PRIu64,
	      live_count(), live_bytes(), N, bytes);

	/* Every allocation stays shareable, not just the last one, from any
	 * address inside it. */
	for (int i = 0; i < N; i++) {
		CUdeviceptr last = p[i] + round_up(sizes[i]) - 1;
		r = lib.export(last, &fd, &base, &size, &dev);
		CHECK(r == 0 && base == p[i] && size == round_up(sizes[i]) && dev == 0,
		      "gpushm_export(last byte of %zu) = %d (%s), base %#" PRIx64 " size %" PRIu64 " device %d; want base %#llx size %zu",
		      sizes[i], r, lib.last_error(), base, size, dev, p[i], round_up(sizes[i]));
		if (r == 0) {
			CHECK(fcntl(fd, F_GETFD) == FD_CLOEXEC, "exported fd is not close-on-exec");
			close(fd);
		}
		r = lib.export(p[i] + round_up(sizes[i]), &fd, &base, &size, &dev);
		CHECK(r == -ENOENT || (r == 0 && base != p[i]), "gpushm_export(one past the end of %zu) found the allocation", sizes[i]);
		if (r == 0) {
			close(fd);
		}
	}

	fill_pattern(p[BIG], off, len, 7);
	r = lib.export(p[BIG] + off + 100, &fd, &base, &size, &dev);
	CHECK(r == 0 && base == p[BIG] && size == 64 * MiB && dev == 0, "gpushm_export(interior) = %d (%s)", r, lib.last_error());
	if (r == 0) {
		rc = spawn_child(fd, size, off, len, 7, "0", 0, 0x5A, 0);
		CHECK(rc == 0, "child on device 0 exited %d", rc);
		CHECK(all_bytes(p[BIG], 4096, 0x5A), "the child's write on device 0 is not visible to the parent");
		if (ndev >= 2) {
			rc = spawn_child(fd, size, off, len, 7, "0,1", 1, 0x77, 8192);
			CHECK(rc == 0, "child on device 1 exited %d", rc);
			CHECK(all_bytes(p[BIG] + 8192, 4096, 0x77), "the child's write from device 1 is not visible to the parent");
		}
		CHECK(all_bytes(p[BIG] + off - 1, 1, 0xA5) && all_bytes(p[BIG] + off + len, 1, 0xA5),
		      "bytes around the pattern changed");
		close(fd);
	}
	for (int i = 0; i < N; i++) {
		lib.free((void *)(uintptr_t)p[i], (ssize_t)sizes[i], 0, NULL);
	}
	CHECK(live_count() == 0 && live_bytes() == 0, "after freeing: %" PRIu64 " allocations, %" PRIu64 " bytes", live_count(),
	      live_bytes());
}

static void test_device1(void) {
	const size_t n = 8 * MiB + 5;
	uint64_t base, size;
	int fd, dev, r, rc;
	CUdeviceptr q;

	printf("== an allocation on device 1, mapped by a child on device 1\n");
	q = (CUdeviceptr)(uintptr_t)lib.malloc((ssize_t)n, 1, NULL);
	CHECK(q != 0, "gpushm_malloc(device 1): %s", lib.last_error());
	if (q == 0) {
		return;
	}
	CHECK(current() == ctx[0], "gpushm_malloc(device 1) left device 1's context current");
	CHECK(ordinal_of(q) == 1, "gpushm_malloc(device 1) is on device %d", ordinal_of(q));
	set_current(ctx[1]);
	CU(cu.cuMemsetD8(q, 0, round_up(n)));
	fill_pattern(q, MiB, MiB, 11);
	set_current(ctx[0]);
	r = lib.export(q + 4096, &fd, &base, &size, &dev);
	CHECK(r == 0 && base == q && size == round_up(n) && dev == 1, "gpushm_export(device 1) = %d (%s), device %d", r,
	      lib.last_error(), dev);
	if (r == 0) {
		rc = spawn_child(fd, size, MiB, MiB, 11, "1", 1, 0x33, 0);
		CHECK(rc == 0, "child exited %d", rc);
		set_current(ctx[1]);
		CHECK(all_bytes(q, 4096, 0x33), "the child's write is not visible");
		set_current(ctx[0]);
		close(fd);
	}
	lib.free((void *)(uintptr_t)q, (ssize_t)n, 1, NULL);
	CHECK(current() == ctx[0], "gpushm_free(device 1) left device 1's context current");
}

/* Peer access is granted at allocation: the other device reads and writes
 * gpushm memory in this process without any enabling call. */
static void test_peer_access(void) {
	uint8_t *b = malloc(MiB);
	char *argv[4] = {"test_alloc", "--peer-probe", "0", NULL};

	printf("== the other device reaches gpushm memory in this process\n");
	for (int home = 0; home < 2; home++) {
		int other = 1 - home, bad = 0;
		CUdeviceptr p = (CUdeviceptr)(uintptr_t)lib.malloc(4 * MiB, home, NULL), buf;
		CUresult r1, r2, r3;
		CHECK(p != 0, "gpushm_malloc(device %d): %s", home, lib.last_error());
		if (p == 0) {
			continue;
		}
		set_current(ctx[home]);
		fill_pattern(p, 0, MiB, 21 + home);
		set_current(ctx[other]);
		CU(cu.cuMemAlloc(&buf, MiB));
		r1 = cu.cuMemcpyDtoD(buf, p, MiB);
		r2 = cu.cuMemsetD8(p + 2 * MiB, 0x44, 4096);
		r3 = cu.cuCtxSynchronize();
		CHECK(r1 == 0 && r2 == 0 && r3 == 0, "device %d on device %d's memory: copy %s, memset %s, synchronize %s", other,
		      home, cu_name(r1), cu_name(r2), cu_name(r3));
		if (r1 == 0 && r2 == 0 && r3 == 0) {
			CU(cu.cuMemcpyDtoH(b, buf, MiB));
			for (size_t i = 0; i < MiB; i++) {
				bad += b[i] != pattern(i, 21 + (unsigned)home);
			}
			CHECK(bad == 0, "device %d read %d wrong bytes of device %d's memory", other, bad, home);
			set_current(ctx[home]);
			CHECK(all_bytes(p + 2 * MiB, 4096, 0x44), "device %d's write to device %d's memory is not there", other, home);
		}
		set_current(ctx[other]);
		CU(cu.cuMemFree(buf));
		set_current(ctx[0]);
		lib.free((void *)(uintptr_t)p, 4 * MiB, home, NULL);
		printf("  device %d copied from and wrote to gpushm memory on device %d: %s\n", other, home,
		       r1 == 0 && r2 == 0 && r3 == 0 && bad == 0 ? "ok" : "FAILED");
	}
	free(b);
	/* Why the peers are granted: without it, what does the driver do? */
	run_self(argv, -1);
	argv[2] = "1";
	run_self(argv, -1);
}

static void test_context_restored(void) {
	void *p;
	printf("== the caller's current context is left as it was\n");
	set_current(NULL);
	p = lib.malloc(MiB, 0, NULL);
	CHECK(p != NULL && current() == NULL, "with no current context: %p, current %p", p, (void *)current());
	lib.free(p, MiB, 0, NULL);
	CHECK(current() == NULL, "gpushm_free made a context current");
	if (ndev >= 2) {
		set_current(ctx[1]);
		p = lib.malloc(MiB, 0, NULL);
		CHECK(p != NULL && current() == ctx[1], "device 1 current, allocating on 0: %p", p);
		lib.free(p, MiB, 0, NULL);
		CHECK(current() == ctx[1], "gpushm_free changed the current context");
	}
	set_current(ctx[0]);
}

static void test_failures(void) {
	uint64_t n0 = live_count(), base, size;
	size_t free0 = free_mem(0);
	int fd, dev, r;
	void *p;

	printf("== failures leave nothing behind\n");
	p = lib.malloc((ssize_t)(4096 * GiB), 0, NULL);
	CHECK(p == NULL, "gpushm_malloc(4 TiB) succeeded");
	printf("  gpushm_malloc(4 TiB): %s\n", lib.last_error());
	CHECK(strstr(lib.last_error(), "CUDA_ERROR_") != NULL, "no CUDA error text: %s", lib.last_error());
	p = lib.malloc(-1, 0, NULL);
	CHECK(p == NULL, "gpushm_malloc(-1) succeeded");
	printf("  gpushm_malloc(-1): %s\n", lib.last_error());
	p = lib.malloc(4096, ndev, NULL);
	CHECK(p == NULL, "gpushm_malloc on device %d (absent) succeeded", ndev);
	printf("  gpushm_malloc(device %d): %s\n", ndev, lib.last_error());
	p = lib.malloc(4096, 1000, NULL);
	CHECK(p == NULL, "gpushm_malloc on device 1000 succeeded");
	printf("  gpushm_malloc(device 1000): %s\n", lib.last_error());
	printf("  gpushm_free(0x1234) should now complain on stderr:\n");
	fflush(stdout);
	lib.free((void *)0x1234, 1, 0, NULL);
	CHECK(strstr(lib.last_error(), "not returned by gpushm_malloc") != NULL, "gpushm_free(0x1234): %s", lib.last_error());
	r = lib.export(0x1234, &fd, &base, &size, &dev);
	CHECK(r == -ENOENT, "gpushm_export(0x1234) = %d", r);
	r = lib.export(0x1234, NULL, &base, &size, &dev);
	CHECK(r == -EINVAL, "gpushm_export(fd NULL) = %d", r);
	CHECK(live_count() == n0, "failures changed the allocation count: %" PRIu64 " -> %" PRIu64, n0, live_count());
	CHECK((long long)free0 - (long long)free_mem(0) < (long long)gran, "failures took %lld bytes of device 0's free memory",
	      (long long)free0 - (long long)free_mem(0));
	CHECK(current() == ctx[0], "failures changed the current context");
}

/* GPUSHM_PRELOAD=1 was set before the library first read it; this process
 * has no CUDA runtime, so what cudaFree forwards fails, as it should. */
static void test_runtime_entry_points(void) {
	uint64_t n0 = live_count(), b0 = live_bytes();
	void *a = NULL, *b = NULL;
	int r;

	printf("== cudaMalloc / cudaFree with GPUSHM_PRELOAD=1\n");
	r = lib.cudaMalloc(&a, 3 * MiB);
	CHECK(r == 0 && a != NULL, "cudaMalloc(3 MiB) = %d (%s)", r, lib.last_error());
	CHECK(live_count() == n0 + 1 && live_bytes() == b0 + round_up(3 * MiB), "cudaMalloc did not go through the table");
	if (a != NULL) {
		CHECK(ordinal_of((CUdeviceptr)(uintptr_t)a) == 0, "cudaMalloc with device 0 current allocated elsewhere");
	}
	if (ndev >= 2) {
		set_current(ctx[1]);
		r = lib.cudaMalloc(&b, 1);
		CHECK(r == 0 && b != NULL && ordinal_of((CUdeviceptr)(uintptr_t)b) == 1,
		      "cudaMalloc with device 1 current: %d (%s)", r, lib.last_error());
		CHECK(current() == ctx[1], "cudaMalloc changed the current context");
		set_current(ctx[0]);
	}
	CHECK(lib.cudaFree(a) == 0, "cudaFree(ours) failed: %s", lib.last_error());
	if (b != NULL) {
		CHECK(lib.cudaFree(b) == 0, "cudaFree(ours, device 1) failed: %s", lib.last_error());
	}
	set_current(NULL);
	r = lib.cudaMalloc(&a, 4096);
	CHECK(r == 0 && current() == ctx[0], "cudaMalloc with no current context: %d, current %p (want device 0's)", r,
	      (void *)current());
	CHECK(r != 0 || lib.cudaFree(a) == 0, "cudaFree failed: %s", lib.last_error());
	set_current(ctx[0]);
	CHECK(lib.cudaMalloc(NULL, 10) == 1, "cudaMalloc(NULL) is not cudaErrorInvalidValue");
	r = lib.cudaFree(NULL);
	CHECK(r == 3, "cudaFree(NULL) with no runtime loaded = %d, want 3 (forwarded, nothing to forward to)", r);
	printf("  cudaFree(NULL): %d, %s\n", r, lib.last_error());
	r = lib.cudaFree((void *)0x1234);
	CHECK(r == 3, "cudaFree(not ours) = %d, want 3 (forwarded)", r);
	CHECK(live_count() == n0 && live_bytes() == b0, "cudaMalloc/cudaFree left %" PRIu64 " allocations", live_count() - n0);
}

enum { THREADS = 8, ROUNDS = 100 };

static void *thread_main(void *arg) {
	int t = (int)(intptr_t)arg, fd, dev;
	uint64_t base, size;
	for (int i = 0; i < ROUNDS; i++) {
		size_t n = (size_t)(1 + (i * 7 + t) % 4) * 2 * MiB - 100;
		int d = t % ndev;
		char *p = lib.malloc((ssize_t)n, d, NULL);
		CHECK(p != NULL, "thread %d: gpushm_malloc: %s", t, lib.last_error());
		if (p == NULL) {
			continue;
		}
		if (i % 10 == 0) {
			int r = lib.export((uint64_t)(uintptr_t)(p + n / 2), &fd, &base, &size, &dev);
			CHECK(r == 0 && base == (uint64_t)(uintptr_t)p && dev == d, "thread %d: export = %d (%s)", t, r, lib.last_error());
			if (r == 0) {
				close(fd);
			}
		}
		lib.free(p, (ssize_t)n, d, NULL);
	}
	return NULL;
}

static void test_threads(void) {
	pthread_t th[THREADS];
	printf("== %d threads x %d allocate/export/free, over %d device(s)\n", THREADS, ROUNDS, ndev < 2 ? 1 : 2);
	for (int t = 0; t < THREADS; t++) {
		pthread_create(&th[t], NULL, thread_main, (void *)(intptr_t)t);
	}
	for (int t = 0; t < THREADS; t++) {
		pthread_join(th[t], NULL);
	}
	CHECK(live_count() == 0, "threads left %" PRIu64 " allocations", live_count());
}

/* ---- benchmark ---- */

static int cmp_double(const void *a, const void *b) {
	double x = *(const double *)a, y = *(const double *)b;
	return (x > y) - (x < y);
}

static double p50(double *v, int n) {
	qsort(v, (size_t)n, sizeof *v, cmp_double);
	return v[n / 2];
}

static void bench(void) {
	static const size_t sizes[] = {2 * MiB, 64 * MiB, 1ull << 30};
	enum { ITERS = 50, WARM = 3 };
	double m[ITERS], f[ITERS], mf[ITERS], am[ITERS], af[ITERS], amf[ITERS], ex[ITERS];

	printf("== benchmark: p50 over %d iterations (after %d warm-up), microseconds, device 0, idle GPU\n", ITERS, WARM);
	printf("| size | gpushm_malloc | gpushm_free | malloc+free | cuMemAlloc | cuMemFree | alloc+free | gpushm_export+close |\n");
	printf("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
	for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
		size_t n = sizes[s];
		uint64_t base, size;
		int fd, dev;
		for (int i = -WARM; i < ITERS; i++) {
			double t0 = now_us();
			void *p = lib.malloc((ssize_t)n, 0, NULL);
			double t1 = now_us();
			CHECK(p != NULL, "bench: %s", lib.last_error());
			lib.free(p, (ssize_t)n, 0, NULL);
			double t2 = now_us();
			if (i >= 0) {
				m[i] = t1 - t0, f[i] = t2 - t1, mf[i] = t2 - t0;
			}
		}
		for (int i = -WARM; i < ITERS; i++) {
			CUdeviceptr p;
			double t0 = now_us();
			CU(cu.cuMemAlloc(&p, n));
			double t1 = now_us();
			CU(cu.cuMemFree(p));
			double t2 = now_us();
			if (i >= 0) {
				am[i] = t1 - t0, af[i] = t2 - t1, amf[i] = t2 - t0;
			}
		}
		void *p = lib.malloc((ssize_t)n, 0, NULL);
		for (int i = -WARM; i < ITERS && p != NULL; i++) {
			double t0 = now_us();
			int r = lib.export((uint64_t)(uintptr_t)p, &fd, &base, &size, &dev);
			if (r == 0) {
				close(fd);
			}
			double t1 = now_us();
			CHECK(r == 0, "bench export: %s", lib.last_error());
			if (i >= 0) {
				ex[i] = t1 - t0;
			}
		}
		lib.free(p, (ssize_t)n, 0, NULL);
		printf("| %zu MiB | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f |\n", n / MiB, p50(m, ITERS), p50(f, ITERS),
		       p50(mf, ITERS), p50(am, ITERS), p50(af, ITERS), p50(amf, ITERS), p50(ex, ITERS));
	}
}

int main(int argc, char **argv) {
	char path[PATH_MAX], *slash;
	CUmemAllocationProp prop;
	size_t free0[2] = {0, 0};
	CUdeviceptr warm;
	char scratch[16];
	CUdevice d;

	if (argc > 1 && strcmp(argv[1], "--child") == 0) {
		return argc == 11 ? child(argv) : 2;
	}
	if (argc > 2 && strcmp(argv[1], "--peer-probe") == 0) {
		return peer_probe(atoi(argv[2]));
	}
	setvbuf(stdout, NULL, _IOLBF, 0);
	if (argc > 1) {
		snprintf(path, sizeof path, "%s", argv[1]);
	} else {
		ssize_t n = readlink("/proc/self/exe", path, sizeof path - 64);
		if (n <= 0) {
			printf("FATAL: readlink /proc/self/exe: %s\n", strerror(errno));
			return 2;
		}
		path[n] = 0;
		slash = strrchr(path, '/');
		strcpy(slash + 1, "libgpushm_alloc.so");
	}
	/* Read by the library the first time cudaMalloc or cudaFree is called. */
	setenv("GPUSHM_PRELOAD", "1", 1);
	load_library(path);
	CHECK(live_count() == 0 && live_bytes() == 0, "stats before any allocation are not zero");
	load_driver();
	CU(cu.cuDeviceGetCount(&ndev));
	printf("library %s, %d device(s)\n", path, ndev);
	for (int i = 0; i < ndev && i < 2; i++) {
		CU(cu.cuDeviceGet(&d, i));
		CU(cu.cuDevicePrimaryCtxRetain(&ctx[i], d));
		/* The driver loads its copy and memset kernels on first use, which
		 * takes device memory: do that before measuring free memory. */
		set_current(ctx[i]);
		CU(cu.cuMemAlloc(&warm, MiB));
		CU(cu.cuMemsetD8(warm, 0, MiB));
		CU(cu.cuMemcpyDtoH(scratch, warm, sizeof scratch));
		CU(cu.cuMemFree(warm));
		CU(cu.cuCtxSynchronize());
	}
	set_current(ctx[0]);
	memset(&prop, 0, sizeof prop);
	prop.type = ALLOCATION_PINNED;
	prop.requestedHandleTypes = POSIX_FD;
	prop.location.type = LOCATION_DEVICE;
	CU(cu.cuMemGetAllocationGranularity(&gran, &prop, 0));
	printf("granularity %zu bytes\n", gran);
	for (int i = 0; i < ndev && i < 2; i++) {
		free0[i] = free_mem(i);
	}

	test_sizes_and_sharing();
	if (ndev >= 2) {
		test_device1();
		test_peer_access();
	} else {
		printf("== SKIP device 1 tests: one device\n");
	}
	test_context_restored();
	test_failures();
	test_runtime_entry_points();
	test_threads();

	printf("== nothing left behind\n");
	CHECK(live_count() == 0 && live_bytes() == 0, "%" PRIu64 " allocations, %" PRIu64 " bytes still live", live_count(),
	      live_bytes());
	for (int i = 0; i < ndev && i < 2; i++) {
		long long diff = (long long)free0[i] - (long long)free_mem(i);
		printf("  device %d free memory: %zu bytes before, %zu after (%lld bytes less)\n", i, free0[i], free_mem(i), diff);
		/* Less than one granule: any allocation left behind is at least one. */
		CHECK(diff < (long long)gran, "device %d has %lld bytes less free memory than before the tests", i, diff);
	}

	bench();
	printf("%s: %d failure(s)\n", atomic_load(&failures) ? "FAIL" : "PASS", atomic_load(&failures));
	return atomic_load(&failures) ? 1 : 0;
}
