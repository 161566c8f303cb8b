package server

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm/internal/backend"
	"github.com/gpushm/gpushm/internal/channel"
	"github.com/gpushm/gpushm/internal/epoch"
	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/wire"
)

// Backend is the allocator the daemon serves, plus what info reports.
type Backend interface {
	segment.Allocator
	Name() string
	Devices() ([]wire.Device, error)
	// DefaultDevice is where a create that names no device allocates.
	DefaultDevice() int
	// Adopt wraps memory a client published; on success it owns fd.
	Adopt(device int, fd int, size int64) (segment.Memory, error)
}

// pooler is a backend that keeps allocations made ahead of time: Refill
// makes what creates took, once their replies are sent.
type pooler interface {
	PoolStats() wire.Pool
	Refill()
}

// Server answers clients on one socket.
type Server struct {
	backend Backend
	reg     *segment.Registry
	epoch   *epoch.Page
	log     *slog.Logger
	version string
	spin    time.Duration
	obs     Observer
	gpus    func(uid uint32) *wire.GPUReport
	// uuids names each device by its GPU's UUID, which clients map by:
	// a client in a container may number the same GPU differently.
	uuids map[int]string

	copies copyLimits // fills and dumps running

	mu    sync.Mutex
	conns map[*conn]struct{} // every connection, in any state, until it ends
	live  sync.WaitGroup     // one per connection, until it ends

	// Workers and the idle set (conns.go).
	epfd       int // the idle set
	pollStop   int // eventfd in the idle set: readable while workers must exit
	byFD       map[int32]*conn
	mapsFor    int          // how many connections conns and byFD last grew to
	workers    atomic.Int32 // running; changed under mu
	waiters    atomic.Int32 // workers in epoll_wait
	maxWorkers int32
	workerSet  map[*worker]struct{} // under mu
	wg         sync.WaitGroup

	// Limits (limits.go): connections counted by uid, the refuser that
	// answers those turned away, and a spare descriptor to give up when
	// the process runs out.
	connLimits ConnLimits
	nconns     int
	userConns  map[uint32]int
	refuser    *refuser
	spare      int
	// epochRO is a read-only descriptor of the epoch page, for clients
	// (-1 until the first hello).
	epochRO int
	// trimLast and trimmed are what the process had allocated at the last
	// sweep and at the last trim (limits.go); only the sweep touches them.
	trimLast, trimmed uint64

	// Durability (park.go): who supervises this process (it may change
	// while serving: a serving process replaces a supervisor that died),
	// and the state of a handover to a successor.
	supervisorNow atomic.Pointer[supervisorInfo]
	wake          int // eventfd: readable while connections must park
	acceptWake    int // eventfd: readable when the accept loop must look at ctx or parking
	parking       bool
	resumed       chan struct{}
	// roleMu makes changes of channel roles one at a time: a claim, a
	// connection's end, its process's exit may each find the same holder.
	// It guards roleHolders, the connection holding each role taken
	// through this process, and is taken before a control block's lock.
	roleMu      sync.Mutex
	roleHolders map[roleKey]*conn
	// restoredBound are creator-bound segments restored after a restart,
	// by creator session, until their creator says hello again or its
	// process exits (or, for a creator that cannot be watched, the grace
	// period ends). Uncommitted segments are among them.
	restoredBound map[string][]restoredSeg

	// Processes watched for their exit (process.go), and what their exits
	// left to do while the server was parked.
	exits        map[segment.Process]*exitWatch
	watchers     sync.WaitGroup
	exitedParked []func()
	// waitStop is closed when opens waiting for a commit must stop: the
	// server parks or stops (commit.go).
	waitStop chan struct{}
	waiting  atomic.Int64 // opens waiting for a commit
}

// New makes a server for backend. version is reported by hello.
func New(b Backend, log *slog.Logger, version string) (*Server, error) {
	ep, err := epoch.New()
	if err != nil {
		return nil, err
	}
	if log == nil {
		log = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	wake, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
	if err != nil {
		ep.Close()
		return nil, fmt.Errorf("eventfd: %w", err)
	}
	acceptWake, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
	if err != nil {
		ep.Close()
		unix.Close(wake)
		return nil, fmt.Errorf("eventfd: %w", err)
	}
	pollStop, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
	if err != nil {
		ep.Close()
		unix.Close(wake)
		unix.Close(acceptWake)
		return nil, fmt.Errorf("eventfd: %w", err)
	}
	epfd, err := newEpoll(pollStop)
	if err != nil {
		ep.Close()
		unix.Close(wake)
		unix.Close(acceptWake)
		unix.Close(pollStop)
		return nil, err
	}
	s := &Server{
		backend:    b,
		epoch:      ep,
		log:        log,
		version:    version,
		obs:        nopObserver{},
		conns:      make(map[*conn]struct{}),
		wake:       wake,
		acceptWake: acceptWake,
		waitStop:   make(chan struct{}),
		userConns:  make(map[uint32]int),
		spare:      -1,
		epochRO:    -1,
		epfd:       epfd,
		pollStop:   pollStop,
		byFD:       make(map[int32]*conn),
		workerSet:  make(map[*worker]struct{}),
		maxWorkers: defaultWorkers(),
	}
	if devs, err := b.Devices(); err == nil {
		s.uuids = make(map[int]string, len(devs))
		for _, d := range devs {
			s.uuids[d.Index] = d.UUID
		}
	}
	s.supervisorNow.Store(&supervisorInfo{pid: os.Getpid()})
	s.reg = segment.New(b, func() { s.epoch.Bump() })
	s.reg.OnChannelRemoved(s.markRemoved)
	return s, nil
}

// SetEpoch replaces the epoch page with one that outlives this process
// (the supervisor's); call before Serve.
func (s *Server) SetEpoch(p *epoch.Page) {
	s.epoch.Close()
	s.epoch = p
}

// epochReadOnly is the descriptor of the epoch page that hello sends: one
// that cannot be mapped writable, so that no client can move the epoch
// under the others.
func (s *Server) epochReadOnly() (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.epochRO < 0 {
		fd, err := backend.ReadOnlyFD(s.epoch.FD())
		if err != nil {
			return -1, fmt.Errorf("epoch page: %w", err)
		}
		s.epochRO = fd
	}
	return s.epochRO, nil
}

// SetSupervisor records the process holding the segments for this one and
// how many serving processes it replaced, for info. It may be called while
// serving.
func (s *Server) SetSupervisor(pid, restarts int) {
	s.supervisorNow.Store(&supervisorInfo{pid: pid, restarts: restarts})
}

type supervisorInfo struct{ pid, restarts int }

// Observer is told of every answered request and every connection, for
// metrics.
type Observer interface {
	// Observe records one request: its op (or "invalid" / "unknown"), its
	// result code ("" for success) and the time from arrival to the reply.
	Observe(op, code string, d time.Duration)
	Connected(delta int)
}

type nopObserver struct{}

func (nopObserver) Observe(string, string, time.Duration) {}
func (nopObserver) Connected(int)                         {}

// SetObserver installs o; call before Serve.
func (s *Server) SetObserver(o Observer) { s.obs = o }

// SetGPUReport makes info replies carry what f reports of the node's GPUs
// to a client of the given uid; call before Serve.
func (s *Server) SetGPUReport(f func(uid uint32) *wire.GPUReport) { s.gpus = f }

// SetSpin sets how long a connection polls for its next request before it
// sleeps (see wire.Conn.SetSpin); call before Serve.
func (s *Server) SetSpin(d time.Duration) { s.spin = d }

// Registry is the server's registry, for in-process users (the FUSE view).
func (s *Server) Registry() *segment.Registry { return s.reg }

// Serve accepts connections on ln until ctx is done, then closes every
// connection, frees every segment, removes the socket file if it is still
// the one ln made, and returns nil. A server that handed its connections
// to a successor (Park) and was not resumed returns at once when ctx is
// done, freeing nothing and leaving the socket: the successor serves them.
// With keepSocket, the socket file stays in any case (a supervisor holds
// it).
func (s *Server) Serve(ctx context.Context, ln *net.UnixListener, keepSocket bool) error {
	path := ln.Addr().String()
	st, statErr := os.Stat(path)
	defer func() {
		if keepSocket || s.isParking() {
			return
		}
		if now, err := os.Stat(path); statErr == nil && err == nil && os.SameFile(st, now) {
			os.Remove(path)
		}
	}()
	// The listener is read with poll(2) and accept4(2) on its descriptor,
	// not through Go's poller: the listening socket is shared with the
	// supervisor and with a successor, whose descriptor passing can put it
	// in blocking mode under us, and then no deadline would end a blocked
	// accept. Poll does not care, and with a single acceptor at a time a
	// connection that poll saw is there for accept.
	lnf, err := ln.File()
	if err != nil {
		return fmt.Errorf("listening socket: %w", err)
	}
	defer lnf.Close()
	lnfd := int(lnf.Fd())
	stop := context.AfterFunc(ctx, s.wakeAccept)
	defer stop()
	if _, err := s.epochReadOnly(); err != nil {
		return err
	}
	ref, err := newRefuser(s.log)
	if err != nil {
		return err
	}
	refDone := make(chan struct{})
	defer func() { <-refDone }()
	go func() {
		defer close(refDone)
		ref.run(ctx)
	}()
	s.mu.Lock()
	s.refuser = ref
	s.mu.Unlock()
	s.spare = spareFD()
	defer func() {
		if s.spare >= 0 {
			unix.Close(s.spare)
		}
	}()
	sweepDone := make(chan struct{})
	defer func() { <-sweepDone }()
	go func() {
		defer close(sweepDone)
		s.sweep(ctx)
	}()
	s.startWorkers()

	var acceptErr error
	for ctx.Err() == nil {
		if s.waitUnparked(ctx) {
			continue
		}
		woken, ready, err := pollAccept(lnfd, s.acceptWake)
		if err != nil {
			acceptErr = err
			break
		}
		if woken || !ready {
			continue // parking, or ctx: the loop looks again
		}
		fd, _, err := unix.Accept4(lnfd, unix.SOCK_CLOEXEC)
		if err != nil {
			switch {
			case errors.Is(err, syscall.EAGAIN), errors.Is(err, syscall.EINTR), errors.Is(err, syscall.ECONNABORTED):
				continue
			case errors.Is(err, syscall.EMFILE), errors.Is(err, syscall.ENFILE):
				if !s.refuseAtFDLimit(lnfd) {
					s.log.Warn("out of file descriptors; refusing connections for a moment (raise the limit with 'ulimit -n')", "err", err)
					time.Sleep(100 * time.Millisecond)
				}
				continue
			}
			acceptErr = fmt.Errorf("accept: %w", err)
			break
		}
		s.startFD(fd)
	}
	if s.isParking() {
		// Handed over: the successor serves these connections and holds
		// this memory; the process exits without freeing anything.
		return nil
	}
	if !keepSocket {
		ln.Close()
	}
	s.mu.Lock()
	s.stopWaitsLocked()
	for c := range s.conns {
		// Wake the connection's worker, or make its socket ready for the
		// idle set: a worker ends it and closes the socket.
		c.wc.Shutdown()
	}
	s.mu.Unlock()
	s.live.Wait()
	s.stopWorkers()
	s.wg.Wait()
	s.stopWatching()
	err = s.reg.Close()
	if s.epochRO >= 0 {
		unix.Close(s.epochRO)
	}
	s.epoch.Close()
	unix.Close(s.wake)
	unix.Close(s.acceptWake)
	unix.Close(s.epfd)
	unix.Close(s.pollStop)
	return errors.Join(acceptErr, err)
}

// sweepEvery is how often segments with a TTL are checked: a segment
// expires at most this late.
const sweepEvery = 250 * time.Millisecond

// sweep ends expired segments until ctx is done.
func (s *Server) sweep(ctx context.Context) {
	t := time.NewTicker(sweepEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			if s.isParking() {
				continue
			}
			for _, name := range s.reg.Expire(now) {
				s.log.Info("expired", "segment", name)
			}
			s.trim()
		}
	}
}

func (s *Server) startFD(fd int) {
	wc, err := wire.NewConn(fd)
	if err != nil {
		s.log.Warn("dropping connection", "err", err)
		unix.Close(fd)
		return
	}
	c := &conn{s: s, wc: wc, leases: make(map[uint64]*lease), roles: make(map[uint64]map[channel.Role]bool)}
	if err := s.add(c); err != nil {
		s.log.Warn("refusing connection without credentials", "err", err)
		wc.Close()
	}
}

// pollAccept waits until the listener has a connection or the wake
// descriptor is readable.
func pollAccept(lnfd, wake int) (woken, ready bool, err error) {
	fds := []unix.PollFd{{Fd: int32(lnfd), Events: unix.POLLIN}, {Fd: int32(wake), Events: unix.POLLIN}}
	for {
		_, err := unix.Poll(fds, -1)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return false, false, fmt.Errorf("poll listener: %w", err)
		}
		if fds[0].Revents&(unix.POLLERR|unix.POLLNVAL) != 0 {
			return false, false, fmt.Errorf("listening socket failed (poll events %#x)", fds[0].Revents)
		}
		return fds[1].Revents != 0, fds[0].Revents&unix.POLLIN != 0, nil
	}
}

// wakeAccept ends a wait in the accept loop, which then looks at ctx and
// at parking.
func (s *Server) wakeAccept() {
	var one [8]byte
	one[0] = 1
	unix.Write(s.acceptWake, one[:])
}

// add serves c from now on, from the idle set: a worker takes it when its
// client asks. A connection added while the server parks waits for the
// handover.
func (s *Server) add(c *conn) error {
	cred, err := c.wc.PeerCred()
	if err != nil {
		return err
	}
	c.cred = cred
	if !c.procKnown {
		// Before the first request, and before the connection can be
		// handed over: every lifetime it makes hangs off this process.
		c.proc, c.procKnown = peerProcess(c.wc, int(cred.PID)), true
	}
	s.mu.Lock()
	if err := s.admitLocked(c); err != nil {
		ref := s.refuser
		s.mu.Unlock()
		if ref == nil {
			return err
		}
		ref.refuse(c.wc, err)
		return nil
	}
	s.live.Add(1)
	s.obs.Connected(1)
	s.log.Debug("connected", "pid", c.cred.PID, "uid", c.cred.UID)
	s.conns[c] = struct{}{}
	s.byFD[int32(c.wc.FD())] = c
	s.mapsFor = max(s.mapsFor, len(s.conns))
	parking := s.parking
	if parking {
		// Accepted as the server parked: the successor serves it.
		c.state = stateStopped
	}
	s.mu.Unlock()
	if !parking {
		s.resume(c)
	}
	return nil
}

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
	// it (limits.go).
	adopted bool
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

// maxTTL bounds ttl_seconds: a year is longer than any idle segment should
// be kept, and keeps the arithmetic far from overflow.
const maxTTL = 365 * 24 * time.Hour

// shrinkMaps copies conns and byFD into smaller maps once a crowd of
// connections has left: a Go map keeps the room it once needed, and a
// flood of idle connections would otherwise leave its memory behind for
// good. mu is held.
func (s *Server) shrinkMaps() {
	if s.mapsFor < 1024 || len(s.conns) > s.mapsFor/4 {
		return
	}
	conns := make(map[*conn]struct{}, len(s.conns))
	byFD := make(map[int32]*conn, len(s.conns))
	for c := range s.conns {
		conns[c] = struct{}{}
		byFD[int32(c.wc.FD())] = c
	}
	s.conns, s.byFD, s.mapsFor = conns, byFD, len(conns)
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
	log := c.log
	if len(c.out) > 0 {
		if err := c.flush(); err != nil {
			log.Debug("write", "err", err)
			return endClosed
		}
		if len(c.out) > 0 {
			return endBlocked
		}
	}
	c.wc.SetWake(c.s.wake, w.nudge)
	c.wc.SetSpin(c.s.spin)
	for {
		if c.s.isParking() {
			return endParked
		}
		if c.s.busy() && c.pending == nil {
			// Every worker serves someone and connections may be waiting:
			// take a turn. A request already here makes c ready at once.
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
			b, inFD, err = c.wc.Recv()
		}
		if errors.Is(err, wire.ErrWoken) {
			w.settle()
			if time.Now().UnixNano() >= w.deadline.Load() {
				return endIdle
			}
			c.wc.SetSpin(0) // spin right after a request only
			continue
		}
		c.wc.SetSpin(c.s.spin)
		if err != nil {
			if errors.Is(err, wire.ErrProto) || errors.Is(err, wire.ErrFDDropped) {
				log.Debug("bad message", "err", err)
				c.s.obs.Observe("invalid", wire.Code(err), 0)
				// Whatever is wrong with the packet, a client waits for the
				// reply with its id: answer with it if it can be read.
				id, _ := wire.RequestID(b)
				if c.send(&wire.Reply{ID: id, Error: errReply(err)}, -1) != nil {
					return endClosed
				}
				if len(c.out) > 0 {
					return endBlocked
				}
				continue
			}
			if !errors.Is(err, io.EOF) {
				log.Debug("read", "err", err)
			}
			return endClosed
		}
		start := time.Now()
		w.deadline.Store(start.Add(idleAfter).UnixNano())
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
		if err != nil {
			var id uint64
			if req != nil {
				id = req.ID
			} else {
				id, _ = wire.RequestID(b)
			}
			err = c.send(&wire.Reply{ID: id, Error: errReply(err)}, -1)
			c.s.obs.Observe("invalid", "EPROTO", time.Since(start))
			if err != nil {
				return endClosed
			}
			if len(c.out) > 0 {
				return endBlocked
			}
			continue
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
			return endParked
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
			log.Debug(req.Op, "name", req.Name, "err", rep.Error.Message)
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
			log.Debug("write", "err", err)
			if rep.FD && rep.Segment != nil {
				c.release(rep.Segment.ID)
			}
			return endClosed
		}
		if len(c.out) > 0 {
			return endBlocked
		}
		if w.aside {
			// The request that waited is answered: the connection goes
			// back to the workers, by way of the idle set.
			return endIdle
		}
	}
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
	switch op {
	case wire.OpHello, wire.OpInfo, wire.OpCreate, wire.OpOpen, wire.OpClose, wire.OpUnlink, wire.OpStat, wire.OpList,
		wire.OpChmod, wire.OpChown, wire.OpRename, wire.OpPublish, wire.OpReclaim, wire.OpCommit, wire.OpFill, wire.OpDump,
		wire.OpEvict, wire.OpLoad, wire.OpPin, wire.OpWaitVersion:
		return op
	}
	return "unknown"
}

// send sends a reply, or queues it (c.out) when the client's receive queue
// is full: a worker never waits for a client to read.
func (c *conn) send(rep *wire.Reply, fd int) error {
	b, err := wire.Encode(rep)
	if err != nil {
		b, _ = wire.Encode(&wire.Reply{ID: rep.ID, Error: errReply(err)})
		fd = -1
	}
	if len(c.out) == 0 {
		err := c.wc.TrySend(b, fd)
		if !errors.Is(err, wire.ErrWouldBlock) {
			return err
		}
	}
	c.out = append(c.out, packet{b, fd})
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

// dispatch answers req. inFD, the descriptor that came with a publish, is
// dispatch's to keep or close.
func (c *conn) dispatch(req *wire.Request, inFD int) (*wire.Reply, int) {
	if !c.hello && req.Op != wire.OpHello {
		if inFD >= 0 {
			syscall.Close(inFD)
		}
		return fail(fmt.Errorf("%w: the first message must be hello", wire.ErrProto))
	}
	switch req.Op {
	case wire.OpPublish:
		return c.publish(req, inFD)
	case wire.OpFill, wire.OpDump:
		return c.copyFile(req, inFD)
	}
	if req.Role == string(channel.Rx) {
		// A channel's consumer reads the slots and writes only its control
		// block, a descriptor of its own: it asks for read access, whether
		// it says readonly or not, and is served as a read-only open.
		req.ReadOnly = true
	}
	if c.reclaiming && req.Op != wire.OpReclaim && req.Op != wire.OpHello {
		c.endReclaim()
	}
	cred := c.leaseCred()
	switch req.Op {
	case wire.OpHello:
		if req.Version != wire.Version {
			return fail(fmt.Errorf("%w: protocol version %d not supported (this daemon speaks %d)", wire.ErrProto, req.Version, wire.Version))
		}
		if len(req.Session) > maxSession {
			return fail(fmt.Errorf("%w: session of %d bytes, limit %d", wire.ErrProto, len(req.Session), maxSession))
		}
		c.hello = true
		if req.Session != "" && c.session == "" {
			c.session = req.Session
			c.bound = append(c.bound, c.s.takeBound(req.Session, c.cred.UID, c.proc)...)
			// A client back after a restart reclaims what it holds next.
			c.reclaiming = true
		}
		fd, err := c.s.epochReadOnly()
		if err != nil {
			return fail(err)
		}
		return &wire.Reply{Version: wire.Version, Server: c.s.version, Backend: c.s.backend.Name(), Epoch: true}, fd
	case wire.OpInfo:
		devs, err := c.s.backend.Devices()
		if err != nil {
			return fail(err)
		}
		u := c.s.reg.Usage()
		sup := c.s.supervisorNow.Load()
		restarts := sup.restarts
		rep := &wire.Reply{Backend: c.s.backend.Name(), Devices: devs,
			Usage: &wire.Usage{Segments: u.Segments, Named: u.Named, Bytes: u.Bytes, Opens: u.Opens},
			PID:   os.Getpid(), SupervisorPID: sup.pid, Restarts: &restarts,
			Grace: c.s.reg.GraceLeft().Seconds()}
		if c.s.gpus != nil {
			rep.GPU = c.s.gpus(c.cred.UID)
		}
		if p, ok := c.s.backend.(pooler); ok {
			if ps := p.PoolStats(); ps != (wire.Pool{}) {
				rep.Pool = &ps
			}
		}
		rep.Tiers = wireTiers(c.s.reg.TierStats())
		rep.Users, rep.Quotas = wireUsers(c.s.reg.Users()), wireQuotas(c.s.reg.QuotasFor(cred.UID))
		return rep, -1
	case wire.OpEvict, wire.OpLoad, wire.OpPin:
		return c.tier(cred, req)
	case wire.OpReclaim:
		n := req.Count
		if n == 0 {
			n = 1
		}
		if n < 0 || n > maxReclaim {
			return fail(fmt.Errorf("reclaim: count %d (want 1 to %d): %w", n, maxReclaim, syscall.EINVAL))
		}
		if err := c.mayReclaim(req.Segment); err != nil {
			return fail(fmt.Errorf("reclaim: %w", err))
		}
		seg, err := c.s.reg.Reclaim(cred, req.Segment, n, req.ReadOnly)
		if err != nil {
			return fail(fmt.Errorf("reclaim: %w", err))
		}
		if req.Role != "" {
			role, err := parseRole(req.Role)
			if err == nil {
				err = c.claim(seg, role) // the same checks as a first claim
			}
			if err != nil {
				for range n {
					c.s.reg.ReleaseBy(seg, c.leaseCred())
				}
				return fail(fmt.Errorf("reclaim: %w", err))
			}
		}
		for range n {
			c.hold(seg)
		}
		return &wire.Reply{Segment: c.segmentInfo(seg)}, -1
	case wire.OpCreate:
		dev := c.s.backend.DefaultDevice()
		if req.Device != nil {
			dev = *req.Device
		}
		o, err := c.createOptions(req, dev)
		if err != nil {
			return fail(fmt.Errorf("create: %w", err))
		}
		c.trace.Mark("options")
		o.Trace = c.trace
		seg, created, err := c.s.reg.Create(cred, o)
		if err != nil {
			return fail(fmt.Errorf("create: %w", err))
		}
		if created && (o.Bound || o.Uncommitted) && !slices.Contains(c.bound, seg) {
			c.bound = append(c.bound, seg)
		}
		rep := &wire.Reply{Created: &created, Segment: c.segmentInfo(seg)}
		if !req.Open {
			return rep, -1
		}
		fd, err := c.handOut(seg, req)
		if err != nil {
			// A create that cannot hand out its descriptor leaves nothing.
			c.s.reg.ReleaseBy(seg, c.leaseCred())
			if created {
				c.s.reg.Discard(seg)
			}
			return fail(fmt.Errorf("create %q: %w", req.Name, err))
		}
		c.hold(seg)
		c.trace.Mark("handout")
		rep.FD, rep.Control = true, c.ctlFD >= 0
		return rep, fd
	case wire.OpOpen:
		if req.Role == string(channel.Tx) && req.ReadOnly {
			return fail(fmt.Errorf("open %q: a producer writes: role \"tx\" cannot be read-only: %w", req.Name, syscall.EINVAL))
		}
		var seg *segment.Segment
		var err error
		if req.Wait != 0 || c.s.reg.WouldRestore(req.Name) {
			// A wait, or a copy back from host memory, must not hold
			// one of the workers.
			c.s.setAside(c.w)
		}
		if req.Wait != 0 {
			seg, err = c.acquireWait(cred, req)
		} else {
			seg, err = c.s.reg.Acquire(cred, req.Name, req.ReadOnly)
		}
		if errors.Is(err, errParked) {
			return nil, -1
		}
		if err != nil {
			return fail(fmt.Errorf("open: %w", err))
		}
		c.trace.Mark("lookup")
		fd, err := c.handOut(seg, req)
		if err != nil {
			c.s.reg.ReleaseBy(seg, c.leaseCred())
			return fail(fmt.Errorf("open %q: %w", req.Name, err))
		}
		c.hold(seg)
		c.trace.Mark("handout")
		return &wire.Reply{Segment: c.segmentInfo(seg), FD: true, Control: c.ctlFD >= 0}, fd
	case wire.OpClose:
		if req.Role != "" {
			role, err := parseRole(req.Role)
			if err != nil {
				return fail(fmt.Errorf("close: %w", err))
			}
			if l := c.leases[req.Segment]; l != nil {
				c.unclaim(l.seg, role, false)
			}
		}
		if !c.release(req.Segment) {
			return fail(fmt.Errorf("close: this connection holds no open of segment %d: %w", req.Segment, syscall.EINVAL))
		}
		return &wire.Reply{}, -1
	case wire.OpUnlink:
		if err := c.s.reg.Unlink(cred, req.Name); err != nil {
			return fail(fmt.Errorf("unlink: %w", err))
		}
		return &wire.Reply{}, -1
	case wire.OpStat:
		inf, err := c.s.reg.Stat(req.Name)
		if err != nil {
			return fail(fmt.Errorf("stat: %w", err))
		}
		return &wire.Reply{Segment: c.s.toWire(inf)}, -1
	case wire.OpList:
		return c.list(req), -1
	case wire.OpChmod, wire.OpChown:
		seg, _, err := c.s.reg.Lookup(req.Name)
		if err == nil && req.Op == wire.OpChmod {
			if req.Mode == nil {
				return fail(fmt.Errorf("chmod: no mode: %w", syscall.EINVAL))
			}
			err = c.s.reg.SetMode(cred, seg, *req.Mode)
		} else if err == nil {
			var uid, gid int64
			if uid, err = ownerID("uid", req.UID); err == nil {
				gid, err = ownerID("gid", req.GID)
			}
			if err == nil {
				err = c.s.reg.SetOwner(cred, seg, uid, gid)
			}
		}
		if err != nil {
			return fail(fmt.Errorf("%s: %w", req.Op, err))
		}
		return &wire.Reply{Segment: c.segmentInfo(seg)}, -1
	case wire.OpCommit:
		return c.commit(req)
	case wire.OpWaitVersion:
		c.s.setAside(c.w) // a wait must not hold one of the workers
		inf, err := c.waitVersion(req)
		if errors.Is(err, errParked) {
			return nil, -1
		}
		if err != nil {
			return fail(fmt.Errorf("wait_version: %w", err))
		}
		return &wire.Reply{Segment: c.s.toWire(inf)}, -1
	case wire.OpRename:
		var flags uint32
		if req.NoReplace {
			flags = segment.RenameNoReplace
		}
		if err := c.s.reg.Rename(cred, req.Name, req.To, flags); err != nil {
			return fail(fmt.Errorf("rename: %w", err))
		}
		return &wire.Reply{}, -1
	}
	return fail(fmt.Errorf("unknown operation %q: %w", req.Op, syscall.ENOSYS))
}

// ownerID reads chown's uid or gid: absent is -1 (unchanged). The values a
// kernel takes as ids are 0 to 2^32-2; 2^32-1 is chown(2)'s "unchanged",
// which the protocol spells by leaving the field out.
func ownerID(field string, v *int64) (int64, error) {
	if v == nil {
		return -1, nil
	}
	if *v < 0 || *v >= 1<<32-1 {
		return 0, fmt.Errorf("%s %d out of range (0 to %d; leave it out to keep it): %w", field, *v, uint32(1<<32-2), syscall.EINVAL)
	}
	return *v, nil
}

// maxSession bounds a client's session name; maxReclaim the leases one
// reclaim may take.
const (
	maxSession = 128
	maxReclaim = 1 << 20
)

// createOptions reads the parts of a create (or publish) request that the
// registry takes.
func (c *conn) createOptions(req *wire.Request, dev int) (segment.CreateOptions, error) {
	o := segment.CreateOptions{
		Name: req.Name, Size: req.Size, Device: dev,
		Mode: deref(req.Mode), UseMode: req.Mode != nil,
		Meta: req.Meta, ExistOK: req.ExistOK, Open: req.Open, ReadOnly: req.ReadOnly,
		Resident: req.Pin,
		Session:  c.session,
		Slots:    req.Slots, SlotBytes: req.SlotBytes,
		Uncommitted: req.Uncommitted,
		NextVersion: req.NextVersion,
	}
	if len(req.Meta) > wire.MaxMeta {
		return o, fmt.Errorf("meta of %d bytes, limit %d: %w", len(req.Meta), wire.MaxMeta, syscall.EINVAL)
	}
	if req.Slots != 0 || req.SlotBytes != 0 {
		if req.Slots == 0 {
			return o, fmt.Errorf("slot_bytes without slots: %w", syscall.EINVAL)
		}
		o.Control = initControl(req.Slots, req.SlotBytes)
	}
	if req.Role != "" && !req.Open {
		return o, fmt.Errorf("a role is taken by opening: %w", syscall.EINVAL)
	}
	if req.ReadOnly && !req.Open {
		return o, fmt.Errorf("readonly applies to the open of a create with open: %w", syscall.EINVAL)
	}
	if req.Empty {
		// A name that holds no memory: there is nothing to open, fill
		// or commit, and a channel is its slots.
		if req.Size != 0 || req.Open || req.Uncommitted || req.Slots != 0 {
			return o, fmt.Errorf("an empty segment has size 0 and no memory to open, fill or commit (empty takes no size, open, uncommitted or slots): %w", syscall.EINVAL)
		}
		o.AllowEmpty = true
	}
	// A client that lost the reply resends the request, id and all, on a
	// new connection: this finds what the first attempt made.
	o.Origin = c.origin(req)
	switch req.Lifetime {
	case "":
	case wire.LifetimeConnection:
		// The creator is journaled, so that after a restart the segment
		// waits for exactly this process.
		o.Bound, o.Creator = true, c.proc
	default:
		return o, fmt.Errorf("lifetime %q (want \"connection\" or none): %w", req.Lifetime, syscall.EINVAL)
	}
	if o.Uncommitted {
		// It ends with its creator too, and waits for it across a restart.
		o.Creator = c.proc
	}
	if req.TTL < 0 || req.TTL > maxTTL.Seconds() {
		return o, fmt.Errorf("ttl_seconds %g (want 0 to %g): %w", req.TTL, maxTTL.Seconds(), syscall.EINVAL)
	}
	o.TTL = time.Duration(req.TTL * float64(time.Second))
	return o, nil
}

// origin names req across reconnections of its client ("" for a client
// without a session).
func (c *conn) origin(req *wire.Request) string {
	if c.session == "" {
		return ""
	}
	return c.session + "/" + strconv.FormatUint(req.ID, 10)
}

// publish names memory the client allocated and sent: the daemon keeps the
// descriptor, so the name stays valid after the publisher exits.
func (c *conn) publish(req *wire.Request, fd int) (*wire.Reply, int) {
	dev := c.s.backend.DefaultDevice()
	if req.Device != nil {
		dev = *req.Device
	}
	// exist_ok, open and uncommitted do not apply: DecodeRequest refused
	// them.
	o, err := c.createOptions(req, dev)
	if err == nil {
		err = segment.ValidName(req.Name)
	}
	if err != nil {
		syscall.Close(fd)
		return fail(fmt.Errorf("publish: %w", err))
	}
	mem, err := c.s.backend.Adopt(dev, fd, req.Size)
	if err != nil {
		syscall.Close(fd)
		return fail(err)
	}
	o.Memory = mem
	// A retried publish that its first attempt already made finds that
	// segment (Origin), and Create frees the memory sent again.
	seg, _, err := c.s.reg.Create(segment.Cred{UID: c.cred.UID, GID: c.cred.GID}, o)
	if err != nil {
		return fail(fmt.Errorf("publish: %w", err))
	}
	if o.Bound && !slices.Contains(c.bound, seg) {
		c.bound = append(c.bound, seg)
	}
	created := true
	return &wire.Reply{Created: &created, Segment: c.segmentInfo(seg)}, -1
}

// maxPage bounds a list page; the page shrinks further if it would not fit
// in one packet.
const maxPage = 256

func (c *conn) list(req *wire.Request) *wire.Reply {
	limit := req.Limit
	if limit <= 0 || limit > maxPage {
		limit = maxPage
	}
	infos := c.s.reg.List(req.After, limit+1)
	more := len(infos) > limit
	if more {
		infos = infos[:limit]
	}
	for {
		rep := &wire.Reply{Segments: make([]wire.Segment, len(infos))}
		for i, inf := range infos {
			rep.Segments[i] = *c.s.toWire(inf)
		}
		if more && len(infos) > 0 {
			rep.Next = infos[len(infos)-1].Name
		}
		b, err := json.Marshal(rep)
		if err == nil && len(b)+64 <= wire.MaxMessage {
			return rep
		}
		// Names are at most 255 bytes, so a handful always fits.
		infos, more = infos[:len(infos)/2], true
	}
}

func (c *conn) segmentInfo(seg *segment.Segment) *wire.Segment {
	return c.s.toWire(c.s.reg.Info(seg))
}

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

func (s *Server) toWire(inf segment.Info) *wire.Segment {
	w := &wire.Segment{
		ID: inf.ID, Name: inf.Name, Size: inf.Size, AllocSize: inf.AllocSize,
		Device: inf.Device, HandleType: inf.HandleType,
		UID: inf.UID, GID: inf.GID, Mode: inf.Mode, Opens: inf.Opens,
		Created: inf.Created.UnixNano(), Meta: inf.Meta, Orphan: inf.Orphan,
		Uncommitted: inf.Uncommitted,
		Tier:        inf.Tier.String(), LastOpen: inf.LastOpen.UnixNano(), Pinned: inf.Resident,
		Version: inf.Version, RDMA: inf.RDMA,
	}
	for _, v := range inf.Versions {
		w.Versions = append(w.Versions, wire.HeldVersion{ID: v.ID, Version: v.Version, Opens: v.Opens, PIDs: v.PIDs})
	}
	if inf.HandleType == wire.HandleCUDA {
		w.UUID = s.uuids[inf.Device]
	}
	if inf.Slots > 0 {
		w.Channel = &wire.Channel{Slots: inf.Slots, SlotBytes: inf.SlotBytes, SlotStride: inf.Stride,
			ControlBytes: segment.ControlBytes}
	}
	if inf.Bound {
		w.Lifetime = wire.LifetimeConnection
	}
	if inf.TTL > 0 {
		w.TTL = inf.TTL.Seconds()
		w.Idle = inf.Idle.UnixNano()
	}
	return w
}

func deref(p *uint32) uint32 {
	if p == nil {
		return 0
	}
	return *p
}

// handOut is the descriptor an open of seg sends, with a channel's role
// taken as req asks and its control block ready to follow (c.ctlFD).
func (c *conn) handOut(seg *segment.Segment, req *wire.Request) (int, error) {
	fd, err := seg.FD()
	if err != nil {
		return -1, err
	}
	if !seg.IsChannel() {
		if req.Role != "" {
			return -1, fmt.Errorf("%q is not a channel: no role to take: %w", req.Name, syscall.EINVAL)
		}
		if req.ReadOnly {
			return c.readOnlyData(fd)
		}
		return fd, nil
	}
	ctl := -1
	err = c.s.reg.WithControl(seg, func(fd int) error {
		ctl = fd // the caller's lease keeps it open until it is sent
		return nil
	})
	if err != nil {
		return -1, err
	}
	if req.ReadOnly || req.Role == string(channel.Rx) {
		// A consumer reads the slots; it writes only the control block.
		if fd, err = c.readOnlyData(fd); err != nil {
			return -1, err
		}
	}
	if req.Role == "" {
		// Opened to look: no end writes through this control block.
		if ctl, err = c.readOnly(ctl); err != nil {
			return -1, err
		}
	}
	if req.Role != "" {
		role, err := parseRole(req.Role)
		if err != nil {
			return -1, err
		}
		if err := c.claim(seg, role); err != nil {
			return -1, err
		}
	}
	c.ctlFD = ctl
	return fd, nil
}

// readOnlyData is the descriptor a read-only open of memory at fd sends:
// on the host backend a descriptor of the memfd that cannot be mapped
// writable or written; on cuda fd itself, since an exported CUDA handle
// carries no access mode (docs/security.md).
func (c *conn) readOnlyData(fd int) (int, error) {
	if c.s.backend.HandleType() != wire.HandleMemfd {
		return fd, nil
	}
	return c.readOnly(fd)
}

// readOnly is a read-only descriptor of the memfd fd, closed once the
// reply is sent.
func (c *conn) readOnly(fd int) (int, error) {
	ro, err := backend.ReadOnlyFD(fd)
	if err != nil {
		return -1, err
	}
	c.temp = append(c.temp, ro)
	return ro, nil
}
