package server

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"runtime/debug"
	"runtime/metrics"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm/internal/fairshare"
	"github.com/gpushm/gpushm/internal/wire"
)

// Connection limits (docs/security.md). A uid other than root may hold
// PerUser connections at once, and the daemon serves at most Total
// connections of all users together, so that connections never take the
// descriptors that segments need (and that the supervisor, which holds a
// copy of every segment's descriptor and, during an upgrade, every
// connection's, never runs out before this process does). A connection
// over a limit, or one that arrives when this process is out of
// descriptors, is never dropped in silence: its first request is answered
// with the refusal, naming the limit and its numbers, and then it is
// closed. Total is shared fairly (internal/fairshare): once half of it is
// open, a uid above its fair share is refused before the others, the top
// quarter is kept for uids holding few connections (SmallConnections at
// least, where Total allows) and the top thirty-second for root, so that
// no group of users at their limits locks out another user, or root.

// SmallConnections is the fair shares' floor for connections
// (fairshare.Shares): the least the reserve of Total gives a uid holding
// few, where it is large enough: a program's connection and a few
// commands run beside it (gpushm ls, a put) at once.
const SmallConnections = 4

// ConnLimits bound the connections the server serves; a zero limit is no
// limit.
type ConnLimits struct {
	// PerUser bounds the connections of one uid other than root.
	PerUser int
	// Total bounds the connections of all users, root included.
	Total int
	// Descriptors is this process's descriptor limit, for the refusal
	// sent when it is reached.
	Descriptors int
}

// SetConnLimits installs l; call before Serve.
func (s *Server) SetConnLimits(l ConnLimits) { s.connLimits = l }

// admitLocked counts c against the connection limits, or says which one
// it would exceed. A connection adopted from a predecessor was admitted
// there and is only counted. s.mu is held.
func (s *Server) admitLocked(c *conn) error {
	l, uid := s.connLimits, c.cred.UID
	if !c.adopted {
		if l.Total > 0 && s.nconns >= l.Total {
			return fmt.Errorf("connections of the daemon (all users): %d open, limit %d; try again later: %w", s.nconns, l.Total, syscall.EMFILE)
		}
		if uid != 0 && l.PerUser > 0 && s.userConns[uid] >= l.PerUser {
			return fmt.Errorf("connections per user: uid %d has %d open, limit %d; close some and try again: %w", uid, s.userConns[uid], l.PerUser, syscall.EAGAIN)
		}
		if uid != 0 {
			shares := fairshare.Shares{Cap: int64(l.Total), Floor: SmallConnections}
			if no := shares.Check(int64(s.nconns), int64(s.userConns[uid]), 1, func() int { return s.connUsersLocked(uid) }); no != nil {
				return fmt.Errorf("%s: %w", no.Describe("connections", "close", uid), syscall.EAGAIN)
			}
		}
	}
	s.nconns++
	s.userConns[uid]++
	if s.userSpins[uid] == nil {
		s.userSpins[uid] = new(atomic.Int32)
	}
	c.spins = s.userSpins[uid]
	return nil
}

// connUsersLocked counts the uids other than root with connections open,
// and uid whether it has one or not. s.mu is held.
func (s *Server) connUsersLocked(uid uint32) int {
	n := len(s.userConns)
	if s.userConns[0] > 0 {
		n--
	}
	if s.userConns[uid] == 0 {
		n++
	}
	return n
}

// leave uncounts a connection that ended.
func (s *Server) leave(c *conn) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.nconns--
	if s.userConns[c.cred.UID]--; s.userConns[c.cred.UID] <= 0 {
		delete(s.userConns, c.cred.UID)
		delete(s.userSpins, c.cred.UID)
	}
}

// Connections reports how many connections are open, and how many of
// them belong to uid.
func (s *Server) Connections(uid uint32) (total, user int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.nconns, s.userConns[uid]
}

// refuseAtFDLimit answers one waiting connection when accept failed for
// want of a descriptor: it gives up the spare descriptor kept for this,
// accepts, answers with EMFILE, closes, and takes the spare again. It
// reports whether a connection was answered.
func (s *Server) refuseAtFDLimit(lnfd int) bool {
	if s.spare < 0 {
		if s.spare = spareFD(); s.spare < 0 {
			return false
		}
	}
	unix.Close(s.spare)
	fd, _, err := unix.Accept4(lnfd, unix.SOCK_CLOEXEC)
	if err == nil {
		s.mu.Lock()
		n := s.nconns
		s.mu.Unlock()
		// The client says hello right after connecting; waiting a moment
		// for it lets the refusal carry its id.
		waitReadable(fd, spareWait)
		answerRefused(fd, make([]byte, wire.MaxMessage+1), fmt.Errorf(
			"the daemon is out of file descriptors (%d connections open, descriptor limit %d); try again later: %w",
			n, s.connLimits.Descriptors, syscall.EMFILE))
	}
	s.spare = spareFD()
	return err == nil
}

// spareWait bounds how long the accept loop waits for the first request
// of a connection it refuses for want of descriptors.
const spareWait = 100 * time.Millisecond

// spareFD takes a descriptor to give up when the process runs out, or -1.
func spareFD() int {
	fd, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
	if err != nil {
		return -1
	}
	return fd
}

// refuser answers connections that a limit turned away, all of them in
// one goroutine: it waits up to refuseWait for each client's first
// request, answers it with the refusal under the request's id (so that
// the client matches it), and closes the connection. At most maxRefusing
// wait at once; beyond that a connection is answered at once, under id 0
// if its request has not arrived.
type refuser struct {
	log  *slog.Logger
	wake int // eventfd: a refusal was added
	buf  []byte

	mu      sync.Mutex
	waiting []refusal
	closed  bool
	count   int       // refusals since the last warning
	warned  time.Time // when the last warning was logged
}

type refusal struct {
	fd       int
	err      error
	deadline time.Time
}

const (
	maxRefusing = 64
	refuseWait  = 2 * time.Second
	// warnEvery spaces the log lines about refusals: a client that
	// retries in a loop must not flood the log.
	warnEvery = 10 * time.Second
)

func newRefuser(log *slog.Logger) (*refuser, error) {
	wake, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		return nil, fmt.Errorf("eventfd: %w", err)
	}
	return &refuser{log: log, wake: wake, buf: make([]byte, wire.MaxMessage+1)}, nil
}

// refuse takes over wc's descriptor and answers its first request with
// err.
func (r *refuser) refuse(wc *wire.Conn, err error) {
	fd := wc.FD()
	r.mu.Lock()
	r.count++
	if now := time.Now(); now.Sub(r.warned) >= warnEvery {
		r.log.Warn("refused connections over a limit", "refused", r.count, "last", err)
		r.count, r.warned = 0, now
	}
	if r.closed || len(r.waiting) >= maxRefusing {
		r.mu.Unlock()
		answerRefused(fd, make([]byte, wire.MaxMessage+1), err)
		return
	}
	r.waiting = append(r.waiting, refusal{fd: fd, err: err, deadline: time.Now().Add(refuseWait)})
	r.mu.Unlock()
	var one [8]byte
	one[0] = 1
	unix.Write(r.wake, one[:])
}

// run answers refused connections until ctx is done, then answers those
// still waiting.
func (r *refuser) run(ctx context.Context) {
	stop := context.AfterFunc(ctx, func() {
		var one [8]byte
		one[0] = 1
		unix.Write(r.wake, one[:])
	})
	defer stop()
	var fds []unix.PollFd
	for {
		r.mu.Lock()
		if ctx.Err() != nil {
			left := r.waiting
			r.waiting, r.closed = nil, true
			r.mu.Unlock()
			for _, w := range left {
				answerRefused(w.fd, r.buf, w.err)
			}
			unix.Close(r.wake)
			return
		}
		now := time.Now()
		timeout := -1
		fds = append(fds[:0], unix.PollFd{Fd: int32(r.wake), Events: unix.POLLIN})
		kept := r.waiting[:0]
		var due []refusal
		for _, w := range r.waiting {
			if !now.Before(w.deadline) {
				due = append(due, w)
				continue
			}
			kept = append(kept, w)
			fds = append(fds, unix.PollFd{Fd: int32(w.fd), Events: unix.POLLIN})
			if ms := int(w.deadline.Sub(now)/time.Millisecond) + 1; timeout < 0 || ms < timeout {
				timeout = ms
			}
		}
		r.waiting = kept
		r.mu.Unlock()
		for _, w := range due {
			answerRefused(w.fd, r.buf, w.err)
		}
		if len(due) > 0 {
			continue
		}
		if _, err := unix.Poll(fds, timeout); err != nil && err != unix.EINTR {
			r.log.Error("poll refused connections", "err", err)
			time.Sleep(10 * time.Millisecond)
			continue
		}
		var buf [8]byte
		unix.Read(r.wake, buf[:])
		ready := map[int]bool{}
		for _, p := range fds[1:] {
			if p.Revents != 0 {
				ready[int(p.Fd)] = true
			}
		}
		if len(ready) == 0 {
			continue
		}
		r.mu.Lock()
		kept = r.waiting[:0]
		due = due[:0]
		for _, w := range r.waiting {
			if ready[w.fd] {
				due = append(due, w)
			} else {
				kept = append(kept, w)
			}
		}
		r.waiting = kept
		r.mu.Unlock()
		for _, w := range due {
			answerRefused(w.fd, r.buf, w.err)
		}
	}
}

// answerRefused reads fd's first request, if it came, answers it with err
// under its id (0 when none could be read), and closes fd. Whatever else
// the client sent is read first: closing a socket with unread messages
// makes the peer's next read fail with ECONNRESET, before the answer.
func answerRefused(fd int, buf []byte, err error) {
	var id uint64
	for i := 0; i < 16; i++ {
		n, _, _, _, rerr := unix.Recvmsg(fd, buf, nil, unix.MSG_DONTWAIT)
		if rerr != nil || n == 0 {
			break
		}
		if i == 0 {
			id = requestID(buf[:n])
		}
	}
	b, eerr := wire.Encode(&wire.Reply{ID: id, Error: errReply(err)})
	if eerr == nil {
		unix.SendmsgN(fd, b, nil, nil, unix.MSG_DONTWAIT|unix.MSG_NOSIGNAL)
	}
	unix.Shutdown(fd, unix.SHUT_RDWR)
	unix.Close(fd)
}

// requestID reads a request's id, whatever else is wrong with it.
func requestID(b []byte) uint64 {
	var r struct {
		ID uint64 `json:"id"`
	}
	json.Unmarshal(b, &r)
	return r.ID
}

// waitReadable waits up to d for fd to have something to read.
func waitReadable(fd int, d time.Duration) {
	fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
	deadline := time.Now().Add(d)
	for {
		left := time.Until(deadline)
		if left <= 0 {
			return
		}
		if _, err := unix.Poll(fds, int(left/time.Millisecond)+1); err != unix.EINTR {
			return
		}
	}
}

// trim gives memory back to the system once a burst of work is over. Go
// keeps the heap a burst grew until its next collection and gives it back
// slowly after that, which in an idle daemon may take minutes: a user who
// filled its limits and let go would leave the daemon that much bigger.
// So once the process allocated trimAfter bytes since the last trim and
// then stayed quiet (allocating less than quietBytes) for one sweep, it
// collects and releases what is free. The sweep calls it.
func (s *Server) trim() {
	a := heapAllocs()
	quiet := a-s.trimLast < quietBytes
	s.trimLast = a
	if !quiet || a-s.trimmed < trimAfter {
		return
	}
	debug.FreeOSMemory()
	s.trimmed = heapAllocs()
	s.trimLast = s.trimmed
}

const (
	trimAfter  = 512 << 10
	quietBytes = 256 << 10
)

// heapAllocs is how many bytes the process allocated since it started.
func heapAllocs() uint64 {
	sample := []metrics.Sample{{Name: "/gc/heap/allocs:bytes"}}
	metrics.Read(sample)
	if sample[0].Value.Kind() != metrics.KindUint64 {
		return 0
	}
	return sample[0].Value.Uint64()
}
