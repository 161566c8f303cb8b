package server

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm/internal/channel"
	"github.com/gpushm/gpushm/internal/crc32c"
	"github.com/gpushm/gpushm/internal/epoch"
	"github.com/gpushm/gpushm/internal/memfd"
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
	// spinning counts the workers polling for a request; at most
	// maxSpinners.
	spinning    atomic.Int32
	maxSpinners int32
	obs         Observer
	gpus        func(uid uint32) *wire.GPUReport
	peers       func(ctx context.Context, pull string) *wire.PeersReport
	pull        func(ctx context.Context, c segment.Cred, name, from, origin string) (segment.Info, error)
	// missing is SetPullMissing's f; atomic, since a server that resumes
	// after a failed handover serves while its daemon sets it again.
	missing atomic.Pointer[func(c segment.Cred, name string, readOnly bool)]
	// uuids names each device by its GPU's UUID, which clients map by:
	// a client in a container may number the same GPU differently.
	uuids map[int]string

	copies copyLimits // fills and dumps running

	mu    sync.Mutex
	conns map[*conn]struct{} // every connection, in any state, until it ends
	live  sync.WaitGroup     // one per connection, until it ends

	// Workers and the idle set (workers.go).
	epfd       int // the idle set
	pollStop   int // eventfd in the idle set: readable while workers must exit
	byFD       map[int32]*conn
	mapsFor    int          // how many connections conns and byFD last grew to
	workers    atomic.Int32 // running; changed under mu
	waiters    atomic.Int32 // workers in epoll_wait
	maxWorkers int32
	workerSet  map[*worker]struct{} // under mu
	wg         sync.WaitGroup

	// Limits (connlimits.go): connections counted by uid, the refuser that
	// answers those turned away, and a spare descriptor to give up when
	// the process runs out.
	connLimits ConnLimits
	nconns     int
	userConns  map[uint32]int
	// userSpins counts, by uid, the workers polling for that user's
	// connections (takeSpinner); an entry lives as long as the uid has a
	// connection, and each of them holds it (conn.spins).
	userSpins map[uint32]*atomic.Int32
	refuser   *refuser
	spare     int
	// epochRO is a read-only descriptor of the epoch page, for clients
	// (-1 until the first hello).
	epochRO int
	// trimLast and trimmed are what the process had allocated at the last
	// sweep and at the last trim (connlimits.go); only the sweep touches them.
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
		backend:     b,
		epoch:       ep,
		log:         log,
		version:     version,
		obs:         nopObserver{},
		conns:       make(map[*conn]struct{}),
		wake:        wake,
		acceptWake:  acceptWake,
		waitStop:    make(chan struct{}),
		userConns:   make(map[uint32]int),
		userSpins:   make(map[uint32]*atomic.Int32),
		spare:       -1,
		epochRO:     -1,
		epfd:        epfd,
		pollStop:    pollStop,
		byFD:        make(map[int32]*conn),
		workerSet:   make(map[*worker]struct{}),
		maxWorkers:  defaultWorkers(),
		maxSpinners: defaultSpinners(),
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
		fd, err := memfd.ReadOnly(s.epoch.FD())
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

// SetPull makes the pull operation call f (nil, the default: no peers);
// origin names the request (session/id), for a pull sent again after a
// crash to find what its first attempt committed.
func (s *Server) SetPull(f func(ctx context.Context, c segment.Cred, name, from, origin string) (segment.Info, error)) {
	s.pull = f
}

// SetPullMissing makes an open that waits for a name missing here call f
// (nil, the default: it only waits), which may start a pull of the name
// from a peer (the daemon's --pull-missing). f is called again at each
// look while the name stays missing, so it must return at once and decide
// for itself how often to act; with f set, an uncommitted segment that
// goes without its commit leaves the name missing again rather than
// ending the wait. It may be set, or unset, while the server serves.
func (s *Server) SetPullMissing(f func(c segment.Cred, name string, readOnly bool)) {
	if f == nil {
		s.missing.Store(nil)
		return
	}
	s.missing.Store(&f)
}

// SetPeers makes the peers operation answer with what f reports (nil,
// the default: the daemon has no peers); pull, when not empty, asks only
// for that name's pull in progress.
func (s *Server) SetPeers(f func(ctx context.Context, pull string) *wire.PeersReport) { s.peers = f }

// SetGPUReport makes info replies carry what f reports of the node's GPUs
// to a client of the given uid; call before Serve.
func (s *Server) SetGPUReport(f func(uid uint32) *wire.GPUReport) { s.gpus = f }

// SetSpin sets how long a worker polls for a connection's next request
// before it sleeps, for a client that asks again within that time (see
// conn.recv); call before Serve.
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

func (s *Server) toWire(inf segment.Info) *wire.Segment {
	w := &wire.Segment{
		ID: inf.ID, Name: inf.Name, Size: inf.Size, AllocSize: inf.AllocSize,
		Device: inf.Device, HandleType: inf.HandleType,
		UID: inf.UID, GID: inf.GID, Mode: inf.Mode, Opens: inf.Opens,
		Created: inf.Created.UnixNano(), Meta: inf.Meta, Orphan: inf.Orphan,
		Uncommitted: inf.Uncommitted,
		Tier:        inf.Tier.String(), LastOpen: inf.LastOpen.UnixNano(), Pinned: inf.Resident,
		Version: inf.Version, RDMA: inf.RDMA,
		Persist: inf.Persist, Stale: inf.Stale, Offer: inf.Offer,
	}
	if !inf.Synced.IsZero() {
		w.Synced = inf.Synced.UnixNano()
	}
	for _, v := range inf.Versions {
		w.Versions = append(w.Versions, wire.HeldVersion{ID: v.ID, Version: v.Version, Opens: v.Opens, PIDs: v.PIDs})
	}
	for _, src := range inf.Sources {
		w.Sources = append(w.Sources, wire.Source{Dev: src.Dev, Ino: src.Ino, Size: src.Size, MtimeNS: src.MtimeNS,
			CtimeNS: src.CtimeNS, Offset: src.Off, At: src.At, Len: src.Len, CRC32C: crc32c.Format(src.CRC32C)})
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
