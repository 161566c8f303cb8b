//go:build linux && cgo

// The loader of UCP's functions (ucp.h declares them).

#include "ucp.h"

struct gsucx_sym {
	const char *name;
	size_t off; // offset of the pointer in struct gsucx_fns
};

#define GSUCX_SYM(name) { #name, offsetof(struct gsucx_fns, name) }

static const struct gsucx_sym gsucx_syms[] = {
	GSUCX_SYM(ucp_get_version),
	GSUCX_SYM(ucs_status_string),
	GSUCX_SYM(ucp_init_version),
	GSUCX_SYM(ucp_cleanup),
	GSUCX_SYM(ucp_worker_create),
	GSUCX_SYM(ucp_worker_destroy),
	GSUCX_SYM(ucp_worker_get_address),
	GSUCX_SYM(ucp_worker_release_address),
	GSUCX_SYM(ucp_worker_progress),
	GSUCX_SYM(ucp_worker_get_efd),
	GSUCX_SYM(ucp_worker_arm),
	GSUCX_SYM(ucp_ep_create),
	GSUCX_SYM(ucp_ep_close_nbx),
	GSUCX_SYM(ucp_mem_map),
	GSUCX_SYM(ucp_mem_unmap),
	GSUCX_SYM(ucp_rkey_pack),
	GSUCX_SYM(ucp_rkey_buffer_release),
	GSUCX_SYM(ucp_ep_rkey_unpack),
	GSUCX_SYM(ucp_rkey_destroy),
	GSUCX_SYM(ucp_get_nbx),
	GSUCX_SYM(ucp_put_nbx),
	GSUCX_SYM(ucp_request_check_status),
	GSUCX_SYM(ucp_request_cancel),
	GSUCX_SYM(ucp_request_free),
};

struct gsucx_fns gsucx;

// gsucx_ep_error is every endpoint's error handler: UCX calls it from
// ucp_worker_progress, which the package calls only under the worker's
// lock, so the plain store is seen by the next reader under that lock.
void gsucx_ep_error(void *arg, ucp_ep_h ep, ucs_status_t status) {
	(void)ep;
	((gsucx_ep_state *)arg)->status = status;
}

// gsucx_open loads path and resolves every symbol, installing the table
// only when install is set and nothing is missing, so that a probe of
// another library (tests) never leaves half a table behind. dlopen and
// dlerror run in this one C call: dlerror's state is per OS thread, and a
// goroutine cannot change threads in the middle of a cgo call.
int gsucx_open(const char *path, int install, char *err, size_t errlen) {
	struct gsucx_fns f;
	size_t i;
	void *h;

	memset(&f, 0, sizeof f);
	(void)dlerror();
	h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (h == NULL) {
		const char *e = dlerror();
		snprintf(err, errlen, "%s", e != NULL ? e : "dlopen failed");
		return GSUCX_OPEN_NO_LIBRARY;
	}
	for (i = 0; i < sizeof gsucx_syms / sizeof gsucx_syms[0]; i++) {
		// dlsym on the handle searches libucp and the libraries it
		// depends on, which is where ucs_status_string lives.
		void *p = dlsym(h, gsucx_syms[i].name);
		if (p == NULL) {
			snprintf(err, errlen, "%s", gsucx_syms[i].name);
			dlclose(h);
			return GSUCX_OPEN_NO_SYMBOL;
		}
		memcpy((char *)&f + gsucx_syms[i].off, &p, sizeof p);
	}
	// The handle stays open for the life of the process: UCX starts
	// threads and registers memory hooks that outlive any one context.
	if (install) {
		gsucx = f;
	}
	return GSUCX_OPEN_OK;
}
