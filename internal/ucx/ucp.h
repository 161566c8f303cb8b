// The UCP API as this package uses it: the types and constants it needs (no
// UCX headers are needed to build), the table of functions gsucx_open fills
// from libucp.so.0 (ucp.c), and one trampoline a function, since cgo cannot
// call through a C function pointer. Every cgo file of the package includes
// it.
#ifndef GPUSHM_UCP_H
#define GPUSHM_UCP_H
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// Types and constants copied from ucp/api/ucp.h, ucp_def.h and
// ucs/type/status.h of UCX 1.13, unchanged in 1.16 for everything used here.
// Only the calls and fields this package uses are declared. abiFacts and
// TestABIMatchesUCXHeaders check them against real headers where installed.

// ucs_status_t is a packed enum in status.h (UCS_S_PACKED): one byte.
typedef int8_t ucs_status_t;
typedef void *ucs_status_ptr_t;

enum {
	GSUCX_OK = 0,                     // UCS_OK
	GSUCX_INPROGRESS = 1,             // UCS_INPROGRESS
	GSUCX_ERR_NO_ELEM = -12,          // UCS_ERR_NO_ELEM
	GSUCX_ERR_BUSY = -15,             // UCS_ERR_BUSY
	GSUCX_ERR_CANCELED = -16,         // UCS_ERR_CANCELED
	GSUCX_ERR_CONNECTION_RESET = -25, // UCS_ERR_CONNECTION_RESET
	GSUCX_ERR_LAST = -100             // UCS_ERR_LAST, bounds the error pointers
};

typedef struct ucp_config ucp_config_t;
typedef struct ucp_context *ucp_context_h;
typedef struct ucp_worker *ucp_worker_h;
typedef struct ucp_ep *ucp_ep_h;
typedef struct ucp_address ucp_address_t;
typedef struct ucp_mem *ucp_mem_h;
typedef struct ucp_rkey *ucp_rkey_h;

typedef void (*ucp_err_handler_cb_t)(void *arg, ucp_ep_h ep, ucs_status_t status);

typedef struct ucp_err_handler {
	ucp_err_handler_cb_t cb;
	void *arg;
} ucp_err_handler_t;

// The params structs are field_mask-based: UCX reads only the fields whose
// bit is set, so a prefix of each is declared, padded well past the real
// size so that a whole-struct copy inside UCX would still read zeroes. The
// prefix is a struct of its own because cgo sees a union as bytes.
#define GSUCX_PARAMS_SIZE 512

enum {
	UCP_PARAM_FIELD_FEATURES = 1 << 0,
	UCP_FEATURE_RMA = 1 << 1,
	UCP_FEATURE_WAKEUP = 1 << 4,
};

struct gsucx_params_prefix {
	uint64_t field_mask;
	uint64_t features;
};

typedef struct {
	struct gsucx_params_prefix p;
	char pad[GSUCX_PARAMS_SIZE - sizeof(struct gsucx_params_prefix)];
} gsucx_params_t; // ucp_params_t

enum {
	UCP_WORKER_PARAM_FIELD_THREAD_MODE = 1 << 0,
	UCS_THREAD_MODE_SERIALIZED = 1,
};

struct gsucx_worker_params_prefix {
	uint64_t field_mask;
	int thread_mode; // ucs_thread_mode_t
};

typedef struct {
	struct gsucx_worker_params_prefix p;
	char pad[GSUCX_PARAMS_SIZE - sizeof(struct gsucx_worker_params_prefix)];
} gsucx_worker_params_t; // ucp_worker_params_t

enum {
	UCP_EP_PARAM_FIELD_REMOTE_ADDRESS = 1 << 0,
	UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE = 1 << 1,
	UCP_EP_PARAM_FIELD_ERR_HANDLER = 1 << 2,
	UCP_ERR_HANDLING_MODE_PEER = 1,
};

struct gsucx_ep_params_prefix {
	uint64_t field_mask;
	const ucp_address_t *address;
	int err_mode; // ucp_err_handling_mode_t
	ucp_err_handler_t err_handler;
};

typedef struct {
	struct gsucx_ep_params_prefix p;
	char pad[GSUCX_PARAMS_SIZE - sizeof(struct gsucx_ep_params_prefix)];
} gsucx_ep_params_t; // ucp_ep_params_t

enum {
	UCP_MEM_MAP_PARAM_FIELD_ADDRESS = 1 << 0,
	UCP_MEM_MAP_PARAM_FIELD_LENGTH = 1 << 1,
};

struct gsucx_mem_map_params_prefix {
	uint64_t field_mask;
	void *address;
	size_t length;
};

typedef struct {
	struct gsucx_mem_map_params_prefix p;
	char pad[GSUCX_PARAMS_SIZE - sizeof(struct gsucx_mem_map_params_prefix)];
} gsucx_mem_map_params_t; // ucp_mem_map_params_t

enum {
	UCP_OP_ATTR_FIELD_FLAGS = 1 << 4,
	UCP_EP_CLOSE_FLAG_FORCE = 1 << 0,
};

struct gsucx_request_param_prefix {
	uint32_t op_attr_mask;
	uint32_t flags;
};

typedef struct {
	struct gsucx_request_param_prefix p;
	char pad[GSUCX_PARAMS_SIZE - sizeof(struct gsucx_request_param_prefix)];
} gsucx_request_param_t; // ucp_request_param_t

// Function pointers resolved from libucp.so.0 (ucs_status_string from the
// libucs.so.0 it depends on). ucp_init is an inline in ucp.h that calls
// ucp_init_version with the header's API version, 1.13 here, which every
// later library accepts.
struct gsucx_fns {
	void (*ucp_get_version)(unsigned *, unsigned *, unsigned *);
	const char *(*ucs_status_string)(ucs_status_t);
	ucs_status_t (*ucp_init_version)(unsigned, unsigned, const gsucx_params_t *, const ucp_config_t *, ucp_context_h *);
	void (*ucp_cleanup)(ucp_context_h);
	ucs_status_t (*ucp_worker_create)(ucp_context_h, const gsucx_worker_params_t *, ucp_worker_h *);
	void (*ucp_worker_destroy)(ucp_worker_h);
	ucs_status_t (*ucp_worker_get_address)(ucp_worker_h, ucp_address_t **, size_t *);
	void (*ucp_worker_release_address)(ucp_worker_h, ucp_address_t *);
	unsigned (*ucp_worker_progress)(ucp_worker_h);
	ucs_status_t (*ucp_worker_get_efd)(ucp_worker_h, int *);
	ucs_status_t (*ucp_worker_arm)(ucp_worker_h);
	ucs_status_t (*ucp_ep_create)(ucp_worker_h, const gsucx_ep_params_t *, ucp_ep_h *);
	ucs_status_ptr_t (*ucp_ep_close_nbx)(ucp_ep_h, const gsucx_request_param_t *);
	ucs_status_t (*ucp_mem_map)(ucp_context_h, const gsucx_mem_map_params_t *, ucp_mem_h *);
	ucs_status_t (*ucp_mem_unmap)(ucp_context_h, ucp_mem_h);
	ucs_status_t (*ucp_rkey_pack)(ucp_context_h, ucp_mem_h, void **, size_t *);
	void (*ucp_rkey_buffer_release)(void *);
	ucs_status_t (*ucp_ep_rkey_unpack)(ucp_ep_h, const void *, ucp_rkey_h *);
	void (*ucp_rkey_destroy)(ucp_rkey_h);
	ucs_status_ptr_t (*ucp_get_nbx)(ucp_ep_h, void *, size_t, uint64_t, ucp_rkey_h, const gsucx_request_param_t *);
	ucs_status_ptr_t (*ucp_put_nbx)(ucp_ep_h, const void *, size_t, uint64_t, ucp_rkey_h, const gsucx_request_param_t *);
	ucs_status_t (*ucp_request_check_status)(void *);
	void (*ucp_request_cancel)(ucp_worker_h, void *);
	void (*ucp_request_free)(void *);
};

// gsucx is written once, under Load's sync.Once, before any trampoline can
// run; it is read-only afterwards.
extern struct gsucx_fns gsucx;

enum { GSUCX_OPEN_OK = 0, GSUCX_OPEN_NO_LIBRARY = 1, GSUCX_OPEN_NO_SYMBOL = 2 };

int gsucx_open(const char *path, int install, char *err, size_t errlen);

// An endpoint's error, written by UCX's error handler during progress and
// read under the same lock; it lives in C memory because UCX keeps its
// address.
typedef struct {
	ucs_status_t status;
} gsucx_ep_state;

void gsucx_ep_error(void *arg, ucp_ep_h ep, ucs_status_t status);

// gsucx_status_ptr splits a ucs_status_ptr_t into a status and, when the
// operation is in progress, its request.
static inline ucs_status_t gsucx_status_ptr(ucs_status_ptr_t p, void **req) {
	*req = NULL;
	if (p == NULL) {
		return GSUCX_OK;
	}
	if ((uintptr_t)p >= (uintptr_t)(intptr_t)GSUCX_ERR_LAST) {
		return (ucs_status_t)(intptr_t)p;
	}
	*req = p;
	return GSUCX_INPROGRESS;
}

static inline void gs_ucp_get_version(unsigned *a, unsigned *b, unsigned *c) { gsucx.ucp_get_version(a, b, c); }
static inline const char *gs_ucs_status_string(ucs_status_t s) { return gsucx.ucs_status_string(s); }

static inline ucs_status_t gs_ucp_init(uint64_t features, ucp_context_h *ctx) {
	gsucx_params_t p;
	memset(&p, 0, sizeof p);
	p.p.field_mask = UCP_PARAM_FIELD_FEATURES;
	p.p.features = features;
	return gsucx.ucp_init_version(1, 13, &p, NULL, ctx);
}

static inline void gs_ucp_cleanup(ucp_context_h c) { gsucx.ucp_cleanup(c); }

static inline ucs_status_t gs_ucp_worker_create(ucp_context_h c, ucp_worker_h *w) {
	gsucx_worker_params_t p;
	memset(&p, 0, sizeof p);
	p.p.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
	p.p.thread_mode = UCS_THREAD_MODE_SERIALIZED;
	return gsucx.ucp_worker_create(c, &p, w);
}

static inline void gs_ucp_worker_destroy(ucp_worker_h w) { gsucx.ucp_worker_destroy(w); }

// gs_worker_address copies the worker's address into malloc'd memory, which
// the caller frees, so that Go never holds memory UCX must release.
static inline ucs_status_t gs_worker_address(ucp_worker_h w, void **out, size_t *len) {
	ucp_address_t *a;
	ucs_status_t s = gsucx.ucp_worker_get_address(w, &a, len);
	if (s != GSUCX_OK) {
		return s;
	}
	*out = malloc(*len);
	if (*out != NULL) {
		memcpy(*out, a, *len);
	}
	gsucx.ucp_worker_release_address(w, a);
	return *out != NULL ? GSUCX_OK : -4; // UCS_ERR_NO_MEMORY
}

static inline unsigned gs_ucp_worker_progress(ucp_worker_h w) { return gsucx.ucp_worker_progress(w); }
static inline ucs_status_t gs_ucp_worker_get_efd(ucp_worker_h w, int *fd) { return gsucx.ucp_worker_get_efd(w, fd); }
static inline ucs_status_t gs_ucp_worker_arm(ucp_worker_h w) { return gsucx.ucp_worker_arm(w); }

static inline ucs_status_t gs_ucp_ep_create(ucp_worker_h w, const void *addr, gsucx_ep_state *st, ucp_ep_h *ep) {
	gsucx_ep_params_t p;
	memset(&p, 0, sizeof p);
	p.p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
		UCP_EP_PARAM_FIELD_ERR_HANDLER;
	p.p.address = (const ucp_address_t *)addr;
	p.p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
	p.p.err_handler.cb = gsucx_ep_error;
	p.p.err_handler.arg = st;
	return gsucx.ucp_ep_create(w, &p, ep);
}

static inline ucs_status_t gs_ucp_ep_close(ucp_ep_h ep, int force, void **req) {
	gsucx_request_param_t p;
	memset(&p, 0, sizeof p);
	if (force) {
		p.p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
		p.p.flags = UCP_EP_CLOSE_FLAG_FORCE;
	}
	return gsucx_status_ptr(gsucx.ucp_ep_close_nbx(ep, &p), req);
}

static inline ucs_status_t gs_ucp_mem_map(ucp_context_h c, void *addr, size_t len, ucp_mem_h *m) {
	gsucx_mem_map_params_t p;
	memset(&p, 0, sizeof p);
	p.p.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
	p.p.address = addr;
	p.p.length = len;
	return gsucx.ucp_mem_map(c, &p, m);
}

static inline ucs_status_t gs_ucp_mem_unmap(ucp_context_h c, ucp_mem_h m) { return gsucx.ucp_mem_unmap(c, m); }

// gs_rkey_pack copies the packed key into malloc'd memory, as
// gs_worker_address does.
static inline ucs_status_t gs_rkey_pack(ucp_context_h c, ucp_mem_h m, void **out, size_t *len) {
	void *k;
	ucs_status_t s = gsucx.ucp_rkey_pack(c, m, &k, len);
	if (s != GSUCX_OK) {
		return s;
	}
	*out = malloc(*len);
	if (*out != NULL) {
		memcpy(*out, k, *len);
	}
	gsucx.ucp_rkey_buffer_release(k);
	return *out != NULL ? GSUCX_OK : -4; // UCS_ERR_NO_MEMORY
}

static inline ucs_status_t gs_ucp_ep_rkey_unpack(ucp_ep_h ep, const void *buf, ucp_rkey_h *k) { return gsucx.ucp_ep_rkey_unpack(ep, buf, k); }
static inline void gs_ucp_rkey_destroy(ucp_rkey_h k) { gsucx.ucp_rkey_destroy(k); }

static inline ucs_status_t gs_ucp_get(ucp_ep_h ep, void *buf, size_t len, uint64_t raddr, ucp_rkey_h k, void **req) {
	gsucx_request_param_t p;
	memset(&p, 0, sizeof p);
	return gsucx_status_ptr(gsucx.ucp_get_nbx(ep, buf, len, raddr, k, &p), req);
}

static inline ucs_status_t gs_ucp_put(ucp_ep_h ep, const void *buf, size_t len, uint64_t raddr, ucp_rkey_h k, void **req) {
	gsucx_request_param_t p;
	memset(&p, 0, sizeof p);
	return gsucx_status_ptr(gsucx.ucp_put_nbx(ep, buf, len, raddr, k, &p), req);
}

static inline ucs_status_t gs_ucp_request_check_status(void *r) { return gsucx.ucp_request_check_status(r); }
static inline void gs_ucp_request_cancel(ucp_worker_h w, void *r) { gsucx.ucp_request_cancel(w, r); }
static inline void gs_ucp_request_free(void *r) { gsucx.ucp_request_free(r); }

#endif
