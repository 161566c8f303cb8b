//go:build linux && cgo

package ucx

// Loading libucp (ucp.c, ucp.h), contexts and workers, and the progress
// loop every wait goes through. Endpoints, regions and gets are in
// ep_cgo.go; abi_cgo.go gives the layouts to the tests.

/*
#cgo LDFLAGS: -ldl
#include "ucp.h"
*/
import "C"

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// cgoBuild tells tests which implementation they run against.
const cgoBuild = true

// library is a variable only so that tests can make loading fail on a
// machine that has UCX.
var library = Library

var (
	loadOnce sync.Once
	loadErr  error
	loaded   atomic.Bool
)

// pollInterval bounds a wait on the worker's event descriptor: a wakeup
// another goroutine consumed, or a cancelled context, is noticed within it.
const pollInterval = 5 * time.Millisecond

// Load loads libucp.so.0 and resolves every symbol the package uses. It runs
// once per process; later calls return the first result. NewContext calls
// it, so calling it explicitly is only needed to learn early whether UCX is
// usable.
func Load() error {
	loadOnce.Do(func() {
		tcpDefaults()
		loadErr = openLibrary(library, true)
		loaded.Store(loadErr == nil)
	})
	return loadErr
}

func openLibrary(path string, install bool) error {
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	var msg [512]C.char
	inst := C.int(0)
	if install {
		inst = 1
	}
	switch C.gsucx_open(cpath, inst, &msg[0], C.size_t(len(msg))) {
	case C.GSUCX_OPEN_OK:
		return nil
	case C.GSUCX_OPEN_NO_LIBRARY:
		return fmt.Errorf("%w: %s", ErrNoLibrary, C.GoString(&msg[0]))
	default:
		return fmt.Errorf("ucx: %s lacks symbol %s; UCX is older than 1.10", path, C.GoString(&msg[0]))
	}
}

// probeLibrary resolves the package's symbols in path without installing
// them, so tests can check the loader's error paths.
func probeLibrary(path string) error { return openLibrary(path, false) }

func statusString(s Status) (string, bool) {
	if !loaded.Load() {
		return "", false
	}
	return C.GoString(C.gs_ucs_status_string(C.ucs_status_t(s))), true
}

func check(call string, s C.ucs_status_t) error {
	if s == C.GSUCX_OK {
		return nil
	}
	return fmt.Errorf("ucx: %s: %w", call, Status(s))
}

// Version returns the loaded library's version, "1.16.0", or "" when it is
// not loaded.
func Version() string {
	if Load() != nil {
		return ""
	}
	var major, minor, release C.uint
	C.gs_ucp_get_version(&major, &minor, &release)
	return fmt.Sprintf("%d.%d.%d", major, minor, release)
}

// A Context is a UCP context (ucp_init) with remote memory access and
// wakeups. Its lock serializes every UCX call on it and on its workers,
// endpoints, regions and requests: workers are created in UCX's serialized
// thread mode, where any thread may call but only one at a time.
type Context struct {
	mu      sync.Mutex
	h       C.ucp_context_h
	workers int
	regions int
}

// NewContext loads the library if needed and initializes a context. UCX
// reads its configuration from the environment (UCX_TLS, UCX_NET_DEVICES).
func NewContext() (*Context, error) {
	if err := Load(); err != nil {
		return nil, err
	}
	c := &Context{}
	if err := check("ucp_init", C.gs_ucp_init(C.UCP_FEATURE_RMA|C.UCP_FEATURE_WAKEUP, &c.h)); err != nil {
		return nil, err
	}
	return c, nil
}

// Close releases the context. Its workers and regions must be closed
// first: UCX would free them under their owners.
func (c *Context) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.h == nil {
		return ErrClosed
	}
	if c.workers > 0 || c.regions > 0 {
		return fmt.Errorf("ucx: close context: %d workers and %d regions still open", c.workers, c.regions)
	}
	C.gs_ucp_cleanup(c.h)
	c.h = nil
	return nil
}

// A Worker is a UCP worker: it owns endpoints and makes progress on them.
// A worker whose memory peers read must be served (Serve): over transports
// without remote access in hardware, tcp among them, the owner of the
// memory answers each get as it progresses.
type Worker struct {
	c   *Context
	h   C.ucp_worker_h
	efd int32 // the worker's event descriptor, or -1: poll with backoff
	eps int
}

// NewWorker creates a worker on c.
func (c *Context) NewWorker() (*Worker, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.h == nil {
		return nil, ErrClosed
	}
	w := &Worker{c: c, efd: -1}
	if err := check("ucp_worker_create", C.gs_ucp_worker_create(c.h, &w.h)); err != nil {
		return nil, err
	}
	var fd C.int
	if C.gs_ucp_worker_get_efd(w.h, &fd) == C.GSUCX_OK {
		w.efd = int32(fd)
	}
	c.workers++
	return w, nil
}

// Address returns the worker's address, which a peer passes to Connect.
func (w *Worker) Address() ([]byte, error) {
	w.c.mu.Lock()
	defer w.c.mu.Unlock()
	if w.h == nil {
		return nil, ErrClosed
	}
	var p unsafe.Pointer
	var n C.size_t
	if err := check("ucp_worker_get_address", C.gs_worker_address(w.h, &p, &n)); err != nil {
		return nil, err
	}
	defer C.free(p)
	return C.GoBytes(p, C.int(n)), nil
}

// Close destroys the worker. Its endpoints must be closed first, and Serve
// stopped: a Serve still running returns ErrClosed.
func (w *Worker) Close() error {
	w.c.mu.Lock()
	defer w.c.mu.Unlock()
	if w.h == nil {
		return ErrClosed
	}
	if w.eps > 0 {
		return fmt.Errorf("ucx: close worker: %d endpoints still open", w.eps)
	}
	C.gs_ucp_worker_destroy(w.h)
	w.h = nil
	w.c.workers--
	return nil
}

// Serve makes progress on the worker until ctx is done, sleeping on the
// worker's event descriptor while there is nothing to do, and returns nil
// then; it returns ErrClosed if the worker is closed under it.
func (w *Worker) Serve(ctx context.Context) error {
	err := w.wait(ctx, func() bool { return false })
	if ctx.Err() != nil && !errors.Is(err, ErrClosed) {
		return nil
	}
	return err
}

// wait makes progress on the worker until step, called under the lock
// after each round of progress, reports true, or ctx is done. Between
// rounds it sleeps on the worker's event descriptor (ucp_worker_arm, then
// poll), or, where the transports give none, for a backoff that grows to a
// millisecond.
func (w *Worker) wait(ctx context.Context, step func() bool) error {
	idle := 0
	for {
		w.c.mu.Lock()
		if w.h == nil {
			w.c.mu.Unlock()
			return ErrClosed
		}
		n := 0
		for C.gs_ucp_worker_progress(w.h) != 0 {
			n++
		}
		if step() {
			w.c.mu.Unlock()
			return nil
		}
		armed, busy := false, false
		if n == 0 && w.efd >= 0 {
			// UCS_ERR_BUSY: events arrived since the last progress.
			s := C.gs_ucp_worker_arm(w.h)
			armed, busy = s == C.GSUCX_OK, s == C.GSUCX_ERR_BUSY
		}
		efd := w.efd
		w.c.mu.Unlock()
		if err := ctx.Err(); err != nil {
			return err
		}
		switch {
		case n > 0 || busy:
			idle = 0
		case armed:
			fds := []unix.PollFd{{Fd: efd, Events: unix.POLLIN}}
			_, _ = unix.Poll(fds, int(pollInterval/time.Millisecond))
		default:
			idle++
			time.Sleep(min(time.Microsecond<<min(idle, 10), time.Millisecond))
		}
	}
}
