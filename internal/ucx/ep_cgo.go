//go:build linux && cgo

package ucx

// Endpoints, registered regions and one-sided gets.

// #include "ucp.h"
import "C"

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"unsafe"
)

// An Endpoint is a connection to a peer's worker, made with UCX's peer
// error handling: when the peer dies, its operations fail instead of
// hanging, and the endpoint stays failed.
type Endpoint struct {
	w *Worker
	h C.ucp_ep_h // nil once closed by force (a cancelled Get) or by Close
	// st is where UCX's error handler writes the endpoint's failure; C
	// memory, since UCX keeps its address until the endpoint is gone.
	st       *C.gsucx_ep_state
	closeReq unsafe.Pointer // the force close in progress, if any
	gets     int            // Gets in flight
	closed   bool
	done     context.Context // cancelled by Close, to end Gets in flight
	cancel   context.CancelFunc
}

// Connect creates an endpoint to the worker whose Address is addr.
func (w *Worker) Connect(addr []byte) (*Endpoint, error) {
	if len(addr) == 0 {
		return nil, errors.New("ucx: connect: empty worker address")
	}
	caddr := C.CBytes(addr)
	defer C.free(caddr)
	w.c.mu.Lock()
	defer w.c.mu.Unlock()
	if w.h == nil {
		return nil, ErrClosed
	}
	e := &Endpoint{w: w, st: (*C.gsucx_ep_state)(C.calloc(1, C.sizeof_gsucx_ep_state))}
	if err := check("ucp_ep_create", C.gs_ucp_ep_create(w.h, caddr, e.st, &e.h)); err != nil {
		C.free(unsafe.Pointer(e.st))
		return nil, err
	}
	e.done, e.cancel = context.WithCancel(context.Background())
	w.eps++
	return e, nil
}

// failure returns the endpoint's error, if any, under the lock.
func (e *Endpoint) failure() error {
	switch {
	case e.closed:
		return ErrClosed
	case e.st.status != C.GSUCX_OK:
		return fmt.Errorf("endpoint failed: %w", Status(e.st.status))
	case e.h == nil:
		return errors.New("endpoint closed by a cancelled get")
	}
	return nil
}

// abort closes the endpoint by force, under the lock: UCX completes every
// request in flight on it with UCS_ERR_CANCELED. Waiters see the close
// finish through closeDone.
func (e *Endpoint) abort() {
	if e.h == nil {
		return
	}
	var req unsafe.Pointer
	s := C.gs_ucp_ep_close(e.h, 1, &req)
	e.h = nil
	if s == C.GSUCX_INPROGRESS {
		e.closeReq = req
	}
}

// closeDone reports, under the lock, whether no force close is in
// progress, releasing the one that finished.
func (e *Endpoint) closeDone() bool {
	if e.closeReq == nil {
		return true
	}
	if C.gs_ucp_request_check_status(e.closeReq) == C.GSUCX_INPROGRESS {
		return false
	}
	C.gs_ucp_request_free(e.closeReq)
	e.closeReq = nil
	return true
}

// Close ends the Gets in flight (they return ErrClosed), closes the
// endpoint by force, without waiting for the peer, and releases it.
func (e *Endpoint) Close() error {
	c := e.w.c
	c.mu.Lock()
	if e.closed {
		c.mu.Unlock()
		return ErrClosed
	}
	e.closed = true
	e.cancel()
	c.mu.Unlock()
	// The Gets' cancellation is bounded by cancelGrace; the force close by
	// UCX, which completes it without the peer.
	err := e.w.wait(context.Background(), func() bool {
		if e.gets > 0 {
			return false
		}
		e.abort()
		return e.closeDone()
	})
	c.mu.Lock()
	defer c.mu.Unlock()
	C.free(unsafe.Pointer(e.st))
	e.st = nil
	e.w.eps--
	if err != nil {
		return fmt.Errorf("ucx: close endpoint: %w", err)
	}
	return nil
}

// Get reads len(dst) bytes at remoteAddr in the peer's memory, described by
// rkey (the peer's Region.PackKey), into dst, in chunks of which several
// are in flight. When ctx is done it returns ctx's error, but only once no
// chunk can still write into dst: UCX cannot cancel a get, so it waits
// up to a second for them and then closes the endpoint by force. A peer
// that dies makes Get fail with the error UCX reports (connection reset,
// endpoint timeout), and the endpoint stays failed.
func (e *Endpoint) Get(ctx context.Context, dst []byte, remoteAddr uint64, rkey []byte) error {
	if err := e.rma(ctx, dst, remoteAddr, rkey, false); err != nil {
		return fmt.Errorf("ucx: get %d bytes at %#x: %w", len(dst), remoteAddr, err)
	}
	return nil
}

// Put writes src to remoteAddr in the peer's memory, described by rkey, as
// Get reads, and returns once UCX is done with src (which over some
// transports is before the peer has the bytes: a peer learns of a put by
// seeing its bytes change).
func (e *Endpoint) Put(ctx context.Context, src []byte, remoteAddr uint64, rkey []byte) error {
	if err := e.rma(ctx, src, remoteAddr, rkey, true); err != nil {
		return fmt.Errorf("ucx: put %d bytes at %#x: %w", len(src), remoteAddr, err)
	}
	return nil
}

func (e *Endpoint) rma(ctx context.Context, buf []byte, raddr uint64, rkey []byte, put bool) error {
	if len(buf) == 0 {
		return nil
	}
	if len(rkey) == 0 {
		return errors.New("empty remote key")
	}
	// UCX uses buf after ucp_get_nbx or ucp_put_nbx returns, which cgo
	// allows only for pinned Go memory (memory outside Go's heap needs
	// nothing).
	var pin runtime.Pinner
	pin.Pin(&buf[0])
	defer pin.Unpin()
	ckey := C.CBytes(rkey)
	defer C.free(ckey)

	c := e.w.c
	c.mu.Lock()
	if err := e.failure(); err != nil {
		c.mu.Unlock()
		return err
	}
	var rk C.ucp_rkey_h
	if err := check("ucp_ep_rkey_unpack", C.gs_ucp_ep_rkey_unpack(e.h, ckey, &rk)); err != nil {
		c.mu.Unlock()
		return err
	}
	e.gets++
	c.mu.Unlock()

	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	stop := context.AfterFunc(e.done, func() { cancel(ErrClosed) })
	defer stop()
	op := &rmaOp{e: e, buf: buf, raddr: raddr, rkey: rk, put: put}
	err := op.run(ctx)

	c.mu.Lock()
	defer c.mu.Unlock()
	e.gets--
	// UCX wants a remote key destroyed before its endpoint; one whose
	// endpoint a cancelled Get closed by force is left to the process.
	if e.h != nil {
		C.gs_ucp_rkey_destroy(rk)
	}
	return err
}

// An rmaOp is one Get's or Put's chunks: those issued and still in
// flight, and the offset of the next.
type rmaOp struct {
	e       *Endpoint
	buf     []byte
	raddr   uint64
	rkey    C.ucp_rkey_h
	put     bool
	next    int
	pending []unsafe.Pointer
	err     error
}

func (g *rmaOp) call() string {
	if g.put {
		return "ucp_put_nbx"
	}
	return "ucp_get_nbx"
}

// run issues the chunks and waits for them, or, once ctx is done, for no
// chunk to be in flight.
func (g *rmaOp) run(ctx context.Context) error {
	w := g.e.w
	err := w.wait(ctx, func() bool {
		g.reap()
		if g.err == nil {
			g.err = g.e.failure()
		}
		g.issue()
		return len(g.pending) == 0 && (g.err != nil || g.next == len(g.buf))
	})
	if err == nil {
		return g.err
	}
	if errors.Is(err, ErrClosed) {
		return err // the worker closed; UCX released the requests with it
	}
	// Cancelled: nothing more is issued; ask UCX to cancel (which it may
	// ignore for gets), then wait a while, then close the endpoint.
	cause := context.Cause(ctx)
	g.err = cause
	w.c.mu.Lock()
	for _, r := range g.pending {
		if w.h != nil {
			C.gs_ucp_request_cancel(w.h, r)
		}
	}
	w.c.mu.Unlock()
	grace, cancel := context.WithTimeout(context.Background(), cancelGrace)
	defer cancel()
	drained := func() bool { g.reap(); return len(g.pending) == 0 }
	if w.wait(grace, drained) != nil {
		if err := w.wait(context.Background(), func() bool {
			g.e.abort()
			return drained() && g.e.closeDone()
		}); err != nil {
			return err
		}
	}
	return cause
}

// reap releases the chunks that finished, under the lock, keeping the
// first failure.
func (g *rmaOp) reap() {
	kept := g.pending[:0]
	for _, r := range g.pending {
		s := C.gs_ucp_request_check_status(r)
		if s == C.GSUCX_INPROGRESS {
			kept = append(kept, r)
			continue
		}
		C.gs_ucp_request_free(r)
		if s != C.GSUCX_OK && g.err == nil {
			g.err = fmt.Errorf("%s: %w", g.call(), Status(s))
		}
	}
	clear(g.pending[len(kept):])
	g.pending = kept
}

// issue starts chunks, under the lock, until getDepth are in flight.
func (g *rmaOp) issue() {
	for g.err == nil && len(g.pending) < getDepth && g.next < len(g.buf) {
		n := min(getChunk, len(g.buf)-g.next)
		var req unsafe.Pointer
		var s C.ucs_status_t
		if g.put {
			s = C.gs_ucp_put(g.e.h, unsafe.Pointer(&g.buf[g.next]), C.size_t(n), C.uint64_t(g.raddr+uint64(g.next)), g.rkey, &req)
		} else {
			s = C.gs_ucp_get(g.e.h, unsafe.Pointer(&g.buf[g.next]), C.size_t(n), C.uint64_t(g.raddr+uint64(g.next)), g.rkey, &req)
		}
		switch s {
		case C.GSUCX_OK:
		case C.GSUCX_INPROGRESS:
			g.pending = append(g.pending, req)
		default:
			g.err = fmt.Errorf("%s: %w", g.call(), Status(s))
		}
		g.next += n
	}
}

// A Region is memory registered with a Context (ucp_mem_map), which peers
// may read with the key PackKey gives.
type Region struct {
	c    *Context
	h    C.ucp_mem_h
	b    []byte
	pin  runtime.Pinner
	free bool
}

// Map registers b, which must stay valid until Free: memory outside Go's
// heap (a mapping), or a Go slice, which Map pins.
func (c *Context) Map(b []byte) (*Region, error) {
	if len(b) == 0 {
		return nil, errors.New("ucx: map: empty buffer")
	}
	r := &Region{c: c, b: b}
	r.pin.Pin(&b[0])
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.h == nil {
		r.pin.Unpin()
		return nil, ErrClosed
	}
	if err := check("ucp_mem_map", C.gs_ucp_mem_map(c.h, unsafe.Pointer(&b[0]), C.size_t(len(b)), &r.h)); err != nil {
		r.pin.Unpin()
		return nil, err
	}
	c.regions++
	return r, nil
}

// Addr is the region's address, which a peer's Get names.
func (r *Region) Addr() uint64 { return uint64(uintptr(unsafe.Pointer(&r.b[0]))) }

// Len is the region's length in bytes.
func (r *Region) Len() int { return len(r.b) }

// PackKey returns the remote key a peer passes to Get to read the region.
func (r *Region) PackKey() ([]byte, error) {
	r.c.mu.Lock()
	defer r.c.mu.Unlock()
	if r.free || r.c.h == nil {
		return nil, ErrClosed
	}
	var p unsafe.Pointer
	var n C.size_t
	if err := check("ucp_rkey_pack", C.gs_rkey_pack(r.c.h, r.h, &p, &n)); err != nil {
		return nil, err
	}
	defer C.free(p)
	return C.GoBytes(p, C.int(n)), nil
}

// Free unregisters the region. Peers' gets of it fail or read stale bytes
// from then on, depending on the transport: tell them first.
func (r *Region) Free() error {
	r.c.mu.Lock()
	defer r.c.mu.Unlock()
	if r.free {
		return ErrClosed
	}
	r.free = true
	err := check("ucp_mem_unmap", C.gs_ucp_mem_unmap(r.c.h, r.h))
	r.pin.Unpin()
	r.c.regions--
	return err
}
