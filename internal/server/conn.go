package server

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm/internal/channel"
	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/wire"
)

type lease struct {
	seg *segment.Segment
	n   int
}

type conn struct {
	s     *Server
	wc    *wire.Conn
	state connState // under s.mu
	inSet bool      // in the idle set (armed or not)
	// out are replies its client has not taken yet (it stopped reading);
	// nothing more is read until they are sent. outTemp are the
	// descriptors made for them (temp), closed once they are.
	out     []packet
	outTemp []int
	// spins counts the workers polling for its user's connections
	// (Server.userSpins); nil for a connection never admitted.
	spins   *atomic.Int32
	log     *slog.Logger // while a worker serves it
	cred    wire.Cred
	hello   bool
	session string            // the client's, from hello; survives reconnection
	leases  map[uint64]*lease // by segment ID; touched only by serve's goroutine
	// bound are the segments this connection created to end with it.
	bound []*segment.Segment
	// roles are the channel roles this connection holds, by segment ID
	// (a connection may hold both ends of one channel).
	roles map[uint64]map[channel.Role]bool
	// w is the worker serving it, while one does.
	w *worker
	// ctlFD is a channel's control block, sent in a packet of its own
	// right after the reply that announced it (-1: none).
	ctlFD int
	// trace times the steps of the request being answered, when its
	// client asked (nil otherwise).
	trace *segment.Trace
	// reclaiming: the client said hello with its session and has made
	// only reclaims since (endReclaim).
	reclaiming bool
	// proc is the process that made the connection, named as it was
	// accepted (peerProcess) or as its predecessor named it (Adopt);
	// creators, leases, channel roles and uncommitted writers are bound
	// to it. procKnown says it was named.
	proc      segment.Process
	procKnown bool
	// pending is a request read but not answered when the server parked
	// (an open waiting for a commit): it is answered before the next one
	// is read, here after Resume or by the successor.
	pending []byte
	// temp are descriptors made for the reply being answered (read-only
	// ones), closed once it is sent.
	temp []int
	// adopted: the connection was served by a predecessor, which admitted
	// it (connlimits.go).
	adopted bool
	// replied is when its last reply went out; quick says its last
	// request came within the server's spin of the reply before, so the
	// worker polls for the next one before it sleeps.
	replied time.Time
	quick   bool
}

// leaseCred is c's credential, naming its process and session, under
// which its leases are journaled.
func (c *conn) leaseCred() segment.Cred {
	return segment.Cred{UID: c.cred.UID, GID: c.cred.GID, Proc: c.proc, Session: c.session}
}

// endReclaim ends the reclaims of a client back after a restart: the
// leases journaled for its process and session that it did not take back
// end, since it does not hold them (the crash cut off their open's reply,
// or their close). A client reclaims right after hello, before any other
// request (docs/protocol.md, "Restarts").
func (c *conn) endReclaim() {
	c.reclaiming = false
	if n := c.s.reg.EndSessionHolds(c.leaseCred()); n > 0 {
		c.s.log.Debug("leases the client did not reclaim ended", "pid", c.proc.PID, "leases", n)
	}
}

// packet is a reply waiting for its client to read.
type packet struct {
	b  []byte
	fd int // borrowed: the server's, or a segment's this connection holds open
}

// end releases what c held and closes it; its owner calls it.
func (c *conn) end() {
	if c.reclaiming {
		c.endReclaim()
	}
	n := 0
	for _, l := range c.leases {
		// A role whose connection ended without a close ends as if its
		// process died: the block shows what it finished.
		c.unclaim(l.seg, "", true)
		for ; l.n > 0; l.n-- {
			if err := c.s.reg.ReleaseBy(l.seg, c.leaseCred()); err != nil {
				c.s.log.Error("release on disconnect", "err", err)
			}
			n++
		}
	}
	for _, seg := range c.bound {
		// Discard leaves a name alone that now names another segment.
		if err := c.s.reg.Discard(seg); err != nil {
			c.s.log.Error("end creator-bound segment", "err", err)
		}
	}
	c.s.mu.Lock()
	delete(c.s.conns, c)
	delete(c.s.byFD, int32(c.wc.FD()))
	c.s.shrinkMaps()
	c.s.mu.Unlock()
	c.s.leaveSet(c)
	c.wc.Close()
	c.s.leave(c)
	c.dropOut()
	c.s.log.Debug("disconnected", "pid", c.cred.PID, "uid", c.cred.UID, "released", n, "ended", len(c.bound))
	c.s.obs.Connected(-1)
	c.s.live.Done()
}

// serve answers c's requests until it hangs up, goes idle, stops reading
// its replies, or the server parks its connections between two requests
// (leaving c's socket and leases as they are for the successor).
func (c *conn) serve(w *worker) outcome {
	if c.log == nil {
		c.log = c.s.log.With("pid", c.cred.PID, "uid", c.cred.UID)
	}
	if len(c.out) > 0 {
		if err := c.flush(); err != nil {
			c.log.Debug("write", "err", err)
			return endClosed
		}
		if len(c.out) > 0 {
			return endBlocked
		}
	}
	c.wc.SetWake(c.s.wake, w.nudge)
	served, woken := false, false
	for {
		if c.s.isParking() {
			return endParked
		}
		if served && c.s.busy() && c.pending == nil {
			// Every worker serves someone and connections may be waiting:
			// take a turn. A request already here makes c ready at once.
			// Not before c was served once: a worker that gave back every
			// connection it took would serve nobody, and did, stopping a
			// daemon with 20,000 connections, each ready with its hang-up.
			return endIdle
		}
		var (
			b    []byte
			inFD = -1
			err  error
		)
		if c.pending != nil {
			b, c.pending = c.pending, nil
		} else {
			// Spin right after a request only.
			b, inFD, err = c.recv(!woken)
		}
		woken = errors.Is(err, wire.ErrWoken)
		if woken {
			w.settle()
			if time.Now().UnixNano() >= w.deadline.Load() {
				return endIdle
			}
			continue
		}
		if err != nil {
			if errors.Is(err, wire.ErrProto) || errors.Is(err, wire.ErrFDDropped) {
				if o, stop := c.answerBadPacket(b, err); stop {
					return o
				}
				served = true
				continue
			}
			if !errors.Is(err, io.EOF) {
				c.log.Debug("read", "err", err)
			}
			return endClosed
		}
		if o, stop := c.answer(w, b, inFD); stop {
			return o
		}
		served = true
	}
}

// recv reads c's next request. With spin, c's worker first polls for it
// for the server's spin if c's client asked again within that of its
// last reply (a loader opening and mapping segment after segment), and if
// fewer than maxSpinners workers poll: a client that asks now and then
// would find the worker asleep anyway, and more pollers than that would
// take the cores their clients need.
func (c *conn) recv(spin bool) ([]byte, int, error) {
	if spin && c.quick && c.s.takeSpinner(c) {
		b, fd, err := c.wc.Poll(c.s.spin)
		c.s.dropSpinner(c)
		if !errors.Is(err, wire.ErrNothing) {
			return b, fd, err
		}
	}
	// The connection's own spin is 0 (Poll restores it): this sleeps.
	return c.wc.Recv()
}

// answer decodes the request in b (inFD is the descriptor that came with
// it, or -1), answers it and sends the reply. stop says that serve lets go
// of c, as o says.
func (c *conn) answer(w *worker, b []byte, inFD int) (o outcome, stop bool) {
	start := time.Now()
	w.deadline.Store(start.Add(idleAfter).UnixNano())
	c.quick = c.s.spin > 0 && start.Sub(c.replied) <= c.s.spin
	defer func() { c.replied = time.Now() }()
	req, err := decodeRequest(b, inFD)
	if err != nil {
		return c.answerInvalid(req, b, err, start)
	}
	c.ctlFD = -1
	c.trace = nil
	if req.Trace {
		c.trace = segment.NewTrace(start)
		c.trace.Mark("decode")
	}
	rep, fd := c.dispatch(req, inFD)
	if rep == nil {
		// Parked while waiting: c.pending has the request.
		return endParked, true
	}
	if c.trace != nil {
		rep.Trace = wireTrace(c.trace, time.Since(start))
		c.trace = nil
	}
	temp := c.temp
	c.temp = nil
	rep.ID = req.ID
	code := ""
	if rep.Error != nil {
		code = rep.Error.Code
		c.log.Debug(req.Op, "name", req.Name, "err", rep.Error.Message)
	}
	// Counted before the reply leaves: a client that reads the metrics
	// after the reply must find its request in them.
	c.s.obs.Observe(opLabel(req.Op), code, time.Since(start))
	err = c.send(rep, fd)
	if err == nil && rep.Control {
		err = c.send(&wire.Reply{ID: req.ID, ControlFD: true}, c.ctlFD)
	}
	if p, ok := c.s.backend.(pooler); ok {
		p.Refill()
	}
	if len(c.out) > 0 {
		// Their packets wait for the client to read: so do they.
		c.outTemp = append(c.outTemp, temp...)
	} else {
		for _, fd := range temp {
			unix.Close(fd)
		}
	}
	if err != nil {
		c.log.Debug("write", "err", err)
		if rep.FD && rep.Segment != nil {
			c.release(rep.Segment.ID)
		}
		return endClosed, true
	}
	if o, stop := c.blocked(); stop {
		return o, stop
	}
	if w.aside {
		// The request that waited is answered: the connection goes
		// back to the workers, by way of the idle set.
		return endIdle, true
	}
	return 0, false
}

// decodeRequest reads a request strictly, and checks that a descriptor
// came with it exactly when its op carries one; on an error it closes
// inFD.
func decodeRequest(b []byte, inFD int) (*wire.Request, error) {
	req, err := wire.DecodeRequest(b)
	if err == nil && inFD >= 0 && !wire.CarriesFD(req.Op) {
		err = fmt.Errorf("%w: a file descriptor came with %q; only publish, fill and dump carry one", wire.ErrProto, req.Op)
	}
	if err == nil && inFD < 0 && wire.CarriesFD(req.Op) {
		err = fmt.Errorf("%w: %s without a file descriptor", wire.ErrProto, req.Op)
	}
	if err != nil && inFD >= 0 {
		syscall.Close(inFD)
	}
	return req, err
}

// answerBadPacket answers a packet that could not be read whole (b, what
// of it came) with err.
func (c *conn) answerBadPacket(b []byte, err error) (o outcome, stop bool) {
	c.log.Debug("bad message", "err", err)
	c.s.obs.Observe("invalid", wire.Code(err), 0)
	// Whatever is wrong with the packet, a client waits for the
	// reply with its id: answer with it if it can be read.
	id, _ := wire.RequestID(b)
	if c.send(&wire.Reply{ID: id, Error: errReply(err)}, -1) != nil {
		return endClosed, true
	}
	return c.blocked()
}

// answerInvalid answers a request that decodeRequest refused with err.
func (c *conn) answerInvalid(req *wire.Request, b []byte, err error, start time.Time) (o outcome, stop bool) {
	var id uint64
	if req != nil {
		id = req.ID
	} else {
		id, _ = wire.RequestID(b)
	}
	err = c.send(&wire.Reply{ID: id, Error: errReply(err)}, -1)
	c.s.obs.Observe("invalid", "EPROTO", time.Since(start))
	if err != nil {
		return endClosed, true
	}
	return c.blocked()
}

// blocked stops serve while replies wait for the client to read them:
// nothing more is read until they are sent.
func (c *conn) blocked() (o outcome, stop bool) {
	if len(c.out) > 0 {
		return endBlocked, true
	}
	return 0, false
}

// wireTrace is a trace as the protocol sends it.
func wireTrace(t *segment.Trace, total time.Duration) *wire.Trace {
	w := &wire.Trace{TotalNS: total.Nanoseconds(), Steps: make([]wire.TraceStep, len(t.Steps))}
	for i, st := range t.Steps {
		w.Steps[i] = wire.TraceStep{Step: st.Name, NS: st.D.Nanoseconds()}
	}
	return w
}

// opLabel keeps metric labels to the known operations: op comes from the
// client, and a label per unknown string would grow without bound.
func opLabel(op string) string {
	if wire.Known(op) {
		return op
	}
	return "unknown"
}

// send sends a reply, or queues it (c.out) when the client's receive queue
// is full: a worker never waits for a client to read.
func (c *conn) send(rep *wire.Reply, fd int) error {
	// The worker's buffer, when a worker serves c: every reply would
	// otherwise be garbage, and the collector's cycles showed in the
	// round trip's tail.
	var buf []byte
	if c.w != nil {
		buf = c.w.enc[:0]
	}
	b, err := wire.AppendEncode(buf, rep)
	if err != nil {
		b, _ = wire.Encode(&wire.Reply{ID: rep.ID, Error: errReply(err)})
		fd = -1
	} else if c.w != nil && cap(b) <= wire.KeepBuffer {
		c.w.enc = b
	}
	if len(c.out) == 0 {
		err := c.wc.TrySend(b, fd)
		if !errors.Is(err, wire.ErrWouldBlock) {
			return err
		}
	}
	c.out = append(c.out, packet{bytes.Clone(b), fd})
	return nil
}

// flush sends what c.out holds, as far as the client takes it.
func (c *conn) flush() error {
	for len(c.out) > 0 {
		err := c.wc.TrySend(c.out[0].b, c.out[0].fd)
		if errors.Is(err, wire.ErrWouldBlock) {
			return nil
		}
		if err != nil {
			return err
		}
		c.out[0] = packet{}
		c.out = c.out[1:]
	}
	c.dropOut()
	return nil
}

// dropOut forgets replies not sent, and closes the descriptors made for
// them.
func (c *conn) dropOut() {
	for _, fd := range c.outTemp {
		unix.Close(fd)
	}
	c.out, c.outTemp = nil, nil
}

func errReply(err error) *wire.Error {
	return &wire.Error{Code: wire.Code(err), Message: err.Error()}
}

func fail(err error) (*wire.Reply, int) { return &wire.Reply{Error: errReply(err)}, -1 }

func (c *conn) hold(seg *segment.Segment) {
	l := c.leases[seg.ID()]
	if l == nil {
		l = &lease{seg: seg}
		c.leases[seg.ID()] = l
	}
	l.n++
}

func (c *conn) release(id uint64) bool {
	l := c.leases[id]
	if l == nil {
		return false
	}
	if l.n == 1 {
		c.unclaim(l.seg, "", false)
	}
	l.n--
	if l.n == 0 {
		delete(c.leases, id)
	}
	if err := c.s.reg.ReleaseBy(l.seg, c.leaseCred()); err != nil {
		c.s.log.Error("release", "segment", id, "err", err)
	}
	c.endUncommitted(l.seg)
	return true
}
