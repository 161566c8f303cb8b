package server

import (
	"errors"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm/internal/fairshare"
)

// Connections and threads.
//
// A connection that sent a request lately is active: a worker goroutine
// serves it, waiting for the next request in poll and recvmsg on its own
// OS thread (wire.Conn), which is what keeps a round trip fast. After
// idleAfter without a request, the connection goes idle: it joins one
// epoll set (EPOLLONESHOT) and holds no goroutine, no thread and no
// receive buffer. The wait for a request has no timeout (a timed wait
// costs a round trip a few microseconds on a virtual machine); a timer of
// the worker's writes its eventfd, which ends the wait, once the
// connection was quiet for idleAfter. Workers without a connection wait in
// epoll_wait on that set, one event each; the one the kernel wakes for a
// connection serves it at once, so waking an idle connection costs one
// thread wake-up, as a blocked recvmsg does.
//
// At most maxWorkers workers run. When a worker leaves epoll_wait to serve
// a connection and none is left waiting, it starts another, up to the
// limit. At the limit, nobody waits: a worker then lets its connection go
// back to the set after each request, so that ready connections take
// turns (the set's ready list is first in, first out) rather than wait
// for a busy client to pause; and a worker that takes a connection from
// the set while nobody else waits there nudges the others, so that one of
// them lets a quiet connection go and watches the set. A worker that saw
// no event for workerLinger exits while another waits, and ends a thread
// on its way out (reapThread): Go keeps every thread it made, idle, for
// ever, so the thread count would otherwise stay at the highest load ever
// seen.
//
// A connection is in one state at a time, changed under Server.mu:
//
//	running  owned by one goroutine: a worker, or whoever is adding it
//	idle     armed in the epoll set; the worker that gets its event owns it
//	stopped  left by its worker for a handover (Park); Resume arms it
//
// Only the owner of a running connection touches its fields other than
// state; Park owns every connection once the workers have stopped. A
// request that may wait long (an open waiting for a commit) is answered
// by a goroutine outside the workers (setAside, serveAside), which then
// arms its connection and exits.

type connState uint8

const (
	stateRunning connState = iota
	stateIdle
	stateStopped
)

const (
	// idleAfter is how long a worker waits for a connection's next
	// request before it hands the connection to the epoll set. A client
	// that asks more often than this keeps its thread, and the round trip
	// of a blocking recvmsg.
	idleAfter = 5 * time.Millisecond
	// workerLinger is how long a worker waits for an event before it
	// exits with its thread (if another one waits).
	workerLinger = time.Second
	// parkDrain bounds how long Park waits for clients to read replies
	// queued for them; a connection whose client does not read by then is
	// not handed over (it ends as if the serving process had crashed).
	parkDrain = 2 * time.Second
)

// defaultWorkers bounds the connections served at once, and so the threads
// they hold: enough for every core to wait on a few clients.
func defaultWorkers() int32 { return int32(min(max(16, 4*runtime.GOMAXPROCS(0)), 64)) }

// outcome is how serve let go of a connection.
type outcome uint8

const (
	endClosed  outcome = iota // hung up, or failed: end it
	endIdle                   // no request for a while, or others wait: to the epoll set
	endBlocked                // its client does not read: wait until it does
	endParked                 // the server parks: leave it for the handover
)

// newEpoll makes the idle set, with stop (an eventfd) in it.
func newEpoll(stop int) (int, error) {
	ep, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return -1, os.NewSyscallError("epoll_create1", err)
	}
	ev := unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(stop)}
	if err := unix.EpollCtl(ep, unix.EPOLL_CTL_ADD, stop, &ev); err != nil {
		unix.Close(ep)
		return -1, os.NewSyscallError("epoll_ctl", err)
	}
	return ep, nil
}

// startWorkers starts the first worker; the rest follow the load.
func (s *Server) startWorkers() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.workers.Load() == 0 {
		s.spawn()
	}
}

// spawn starts a worker; mu is held.
func (s *Server) spawn() {
	s.workers.Add(1)
	s.wg.Add(1)
	go s.work()
}

// stopWorkers makes every worker exit once it is done with its connection
// (pollStop stays readable until Resume clears it).
func (s *Server) stopWorkers() {
	var one [8]byte
	one[0] = 1
	unix.Write(s.pollStop, one[:])
}

// defaultSpinners bounds the workers that poll for a request at once:
// half the cores.
func defaultSpinners() int32 { return int32(max(1, runtime.GOMAXPROCS(0)/2)) }

// takeSpinner counts c's worker in among those that poll for a request,
// if there is room: maxSpinners in all. For a user other than root the
// slots are shared: the last free one goes only to a user polling for
// none of its connections, and past half of them a user takes no more
// than its fair share among the users polling, and none of the top
// quarter while it polls for one (internal/fairshare, Small is 1), so
// that a user asking back to back on many connections, or several
// together, always leave another user's worker room to poll. Root, the
// operator's or a single-user node's, takes any.
func (s *Server) takeSpinner(c *conn) bool {
	mine := c.spins
	if mine == nil {
		return false
	}
	held := int64(mine.Add(1) - 1)
	shares := fairshare.Shares{Cap: int64(s.maxSpinners)}
	for {
		n := s.spinning.Load()
		refuse := n >= s.maxSpinners
		if !refuse && c.cred.UID != 0 {
			refuse = (n+1 == s.maxSpinners && held > 0) ||
				shares.Check(int64(n), held, 1, func() int { return s.spinUsers(c.cred.UID) }) != nil
		}
		if refuse {
			mine.Add(-1)
			return false
		}
		if s.spinning.CompareAndSwap(n, n+1) {
			return true
		}
	}
}

// dropSpinner counts c's worker out of those that poll, once its poll
// ended (takeSpinner counted it in).
func (s *Server) dropSpinner(c *conn) {
	s.spinning.Add(-1)
	c.spins.Add(-1)
}

// spinUsers counts the users other than root whose connections a worker
// polls for, uid included.
func (s *Server) spinUsers(uid uint32) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for u, spins := range s.userSpins {
		if u != 0 && (u == uid || spins.Load() > 0) {
			n++
		}
	}
	return n
}

// busy reports whether every worker there may be is serving a connection:
// the idle set's ready connections wait for one to let its connection go.
func (s *Server) busy() bool { return s.waiters.Load() == 0 && s.workers.Load() >= s.maxWorkers }

// worker is what a serving goroutine needs besides its thread.
type worker struct {
	// enc is the buffer its connections' replies are encoded in.
	enc []byte
	// nudge is an eventfd in the wait for the next request: readable
	// when the worker should look whether its connection went idle, or
	// whether others wait for a worker.
	nudge int
	// deadline is when the connection served goes idle, in Unix
	// nanoseconds; timer checks it.
	deadline atomic.Int64
	timer    *time.Timer
	// aside: not one of the workers any more (setAside); it exits once
	// done with its connection.
	aside bool
	// mu orders poke against close: a timer that fires late must not
	// write a descriptor closed and given to someone else meanwhile.
	mu     sync.Mutex
	closed bool
}

func newWorker() (*worker, error) {
	fd, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		return nil, os.NewSyscallError("eventfd", err)
	}
	w := &worker{nudge: fd}
	w.timer = time.AfterFunc(time.Hour, w.check)
	w.timer.Stop()
	return w, nil
}

// asideWorker is the state of a goroutine outside the workers, which
// answers one request and lets its connection go: it needs no nudge.
func asideWorker() *worker {
	w := &worker{nudge: -1, aside: true, closed: true}
	w.timer = time.AfterFunc(time.Hour, w.check)
	w.timer.Stop()
	return w
}

// check runs on the timer: it nudges the worker once its connection's
// deadline passed, and looks again at the deadline otherwise.
func (w *worker) check() {
	if left := time.Until(time.Unix(0, w.deadline.Load())); left > 0 {
		w.timer.Reset(left)
		return
	}
	w.poke()
}

// poke makes the worker's wait for a request end.
func (w *worker) poke() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.closed {
		var one [8]byte
		one[0] = 1
		unix.Write(w.nudge, one[:])
	}
}

// settle clears a nudge, stale or new; the worker looks at what it is
// about itself.
func (w *worker) settle() {
	var buf [8]byte
	unix.Read(w.nudge, buf[:])
}

// watch starts the idle timer for a connection the worker took.
func (w *worker) watch() {
	w.settle()
	w.deadline.Store(time.Now().Add(idleAfter).UnixNano())
	w.timer.Reset(idleAfter)
}

func (w *worker) close() {
	w.timer.Stop()
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.closed {
		w.closed = true
		unix.Close(w.nudge)
		w.nudge = -1 // settle, by the same goroutine, reads nothing now
	}
}

// pokeAll nudges every worker; mu is held.
func (s *Server) pokeAll() {
	for w := range s.workerSet {
		w.poke()
	}
}

// work serves connections as their events come, until pollStop is
// readable or it saw none for workerLinger while another worker waits.
func (s *Server) work() {
	defer s.wg.Done()
	// Not locked to its thread: a locked goroutine that lost its P
	// during a system call needs two thread switches to run again, and
	// on two cores that showed in every round trip (reapThread ends the
	// threads instead).
	w, err := newWorker()
	s.mu.Lock()
	if err != nil {
		s.log.Error("cannot start a worker", "err", err)
		s.workers.Add(-1)
		s.mu.Unlock()
		return
	}
	s.workerSet[w] = struct{}{}
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.workerSet, w) // if it is still there
		s.mu.Unlock()
		w.close()
	}()
	events := make([]unix.EpollEvent, 1)
	for {
		s.waiters.Add(1)
		n, err := unix.EpollWait(s.epfd, events, int(workerLinger/time.Millisecond))
		s.waiters.Add(-1)
		if err == unix.EINTR {
			continue
		}
		s.mu.Lock()
		if err != nil {
			s.log.Error("waiting for idle connections", "err", os.NewSyscallError("epoll_wait", err))
			s.workers.Add(-1)
			s.mu.Unlock()
			return
		}
		if n == 0 {
			if s.waiters.Load() > 0 {
				s.workers.Add(-1) // another one waits
				s.mu.Unlock()
				go reapThread()
				return
			}
			s.mu.Unlock()
			continue
		}
		if int(events[0].Fd) == s.pollStop {
			s.workers.Add(-1)
			s.mu.Unlock()
			return
		}
		// A connection that ended is out of the map; one that is not idle
		// has no armed event, but checking costs nothing.
		c := s.byFD[events[0].Fd]
		if c == nil || c.state != stateIdle {
			s.mu.Unlock()
			continue
		}
		c.state = stateRunning
		if s.waiters.Load() == 0 {
			// Someone must watch the set meanwhile: a new worker, or at
			// the limit one that lets its connection go.
			if s.workers.Load() < s.maxWorkers {
				s.spawn()
			} else {
				s.pokeAll()
			}
		}
		s.mu.Unlock()
		s.runConn(c, w)
		if w.aside {
			return
		}
	}
}

// setAside takes w out of the workers, for a request that waits (an open
// waiting for a commit, up to an hour): it finishes its connection's
// request as a goroutine of its own, parked in a select, and another
// worker takes its place.
func (s *Server) setAside(w *worker) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if w.aside {
		return
	}
	w.aside = true
	delete(s.workerSet, w)
	s.workers.Add(-1)
	if s.waiters.Load() == 0 && !s.parking {
		s.spawn()
	}
	// It answers this request and stops: a thousand waiting opens hold
	// no descriptor each.
	w.close()
}

// serveAside serves c, which the caller owns, in a goroutine outside the
// workers: a connection handed over with a request still waiting.
func (s *Server) serveAside(c *conn) {
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		s.runConn(c, asideWorker())
	}()
}

// resume serves c, which the caller owns, from now on: at once if it has a
// request waiting, else from the idle set.
func (s *Server) resume(c *conn) {
	switch {
	case c.pending != nil:
		s.serveAside(c)
	case len(c.out) > 0:
		s.arm(c, unix.EPOLLOUT)
	default:
		s.arm(c, unix.EPOLLIN|unix.EPOLLRDHUP)
	}
}

// reapThread ends the thread that runs it: a goroutine that exits locked
// to its thread takes the thread along. One reaper for each worker that
// retires after a burst ends the threads the burst made, which Go would
// otherwise keep, idle, for ever; Go makes a thread again when it needs
// one.
func reapThread() { runtime.LockOSThread() }

// runConn serves c, which this worker owns, and hands it on.
func (s *Server) runConn(c *conn, w *worker) {
	w.watch()
	c.w = w
	out := c.serve(w)
	c.w = nil
	w.timer.Stop()
	switch out {
	case endIdle:
		s.arm(c, unix.EPOLLIN|unix.EPOLLRDHUP)
	case endBlocked:
		s.arm(c, unix.EPOLLOUT)
	case endParked:
		s.mu.Lock()
		c.state = stateStopped
		s.mu.Unlock()
	default:
		c.end()
	}
}

// arm hands c, which the caller owns, to the epoll set until its socket is
// ready for events (hang-ups and errors always count). The caller must not
// touch c afterwards.
func (s *Server) arm(c *conn, events uint32) {
	c.wc.ReleaseBuffer()
	c.log = nil
	fd := c.wc.FD()
	op := unix.EPOLL_CTL_MOD
	if !c.inSet {
		op = unix.EPOLL_CTL_ADD
	}
	s.mu.Lock()
	// Under mu, so that watchIdle, which may see the event at once, finds
	// the connection idle.
	c.state, c.inSet = stateIdle, true
	err := unix.EpollCtl(s.epfd, op, fd, &unix.EpollEvent{Events: events | unix.EPOLLONESHOT, Fd: int32(fd)})
	if err != nil {
		c.state, c.inSet = stateRunning, op == unix.EPOLL_CTL_MOD
	}
	s.mu.Unlock()
	if err != nil {
		// ENOMEM, or ENOSPC past fs.epoll.max_user_watches: a connection
		// that cannot be watched cannot be served without a thread.
		s.log.Warn("dropping a connection: cannot watch it (raise fs.epoll.max_user_watches?)", "err", os.NewSyscallError("epoll_ctl", err))
		c.end()
	}
}

// leaveSet takes c out of the epoll set before its descriptor closes: the
// set tracks the open file, which another process may share (a successor),
// and a later connection may get the same number.
func (s *Server) leaveSet(c *conn) {
	if !c.inSet {
		return
	}
	if err := unix.EpollCtl(s.epfd, unix.EPOLL_CTL_DEL, c.wc.FD(), nil); err != nil && !errors.Is(err, unix.ENOENT) {
		s.log.Warn("epoll_ctl del", "err", err)
	}
	c.inSet = false
}
