package server

import (
	"errors"
	"fmt"
	"io"
	"slices"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/wire"
)

// Writing before naming (docs/protocol.md, "commit"): a segment created
// uncommitted is the creator's alone until it commits it; it is one of the
// connection's bound segments meanwhile, so it ends with the connection,
// or when the creator closes its last lease on it. An open may wait for a
// name to be committed. Such a wait holds no lock and no thread (the
// goroutine sleeps in a select), ends at its deadline, when the writer it
// waits for goes, when its client hangs up, or when the server stops; when
// the server parks for a successor, the request goes with the connection
// and the successor waits out the rest of it. A daemon that pulls missing
// names from its peers (SetPullMissing) is told of each look at a name
// missing here, and then a writer that gives up does not end the wait.

// maxWait bounds an open's wait: long enough for a writer that reads a
// large checkpoint from slow storage, short enough that a forgotten wait
// ends.
const maxWait = time.Hour

// hangupEvery is how often a waiting open checks that its client is still
// there: a client killed while waiting is noticed this late.
const hangupEvery = 200 * time.Millisecond

// errParked ends a wait that the successor takes over (conn.pending).
var errParked = errors.New("parked while waiting for a commit")

// Waiting is how many opens wait for a commit now.
func (s *Server) Waiting() int { return int(s.waiting.Load()) }

// waitStopped is closed when waits must end: the server parks or stops.
func (s *Server) waitStopped() <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.waitStop
}

// stopWaits ends every wait for a commit; s.mu is held.
func (s *Server) stopWaitsLocked() {
	select {
	case <-s.waitStop:
	default:
		close(s.waitStop)
	}
}

// acquireWait opens req.Name as open does, waiting up to req.Wait seconds
// for the name to name a committed segment.
func (c *conn) acquireWait(cred segment.Cred, req *wire.Request) (*segment.Segment, error) {
	if !(req.Wait > 0 && req.Wait <= maxWait.Seconds()) {
		return nil, fmt.Errorf("wait of %g seconds (want more than 0, at most %g): %w", req.Wait, maxWait.Seconds(), syscall.EINVAL)
	}
	deadline := time.Now().Add(time.Duration(req.Wait * float64(time.Second)))
	timer := time.NewTimer(time.Until(deadline))
	defer timer.Stop()
	tick := time.NewTicker(hangupEvery)
	defer tick.Stop()
	var w segment.Watch
	for waiting := false; ; {
		missing := c.s.missing.Load()
		seg, changed, err := c.s.reg.TryAcquire(cred, req.Name, req.ReadOnly, &w)
		if errors.Is(err, segment.ErrNotFound) && missing != nil {
			// A writer that gave up (a pull from a peer that failed, or
			// was cut short by a restart) leaves the name missing again:
			// a peer may still have it, so the wait goes on.
			w = segment.Watch{}
			continue
		}
		if seg != nil || err != nil {
			return seg, err
		}
		if missing != nil && !w.Seen() {
			(*missing)(cred, req.Name, req.ReadOnly)
		}
		if !waiting {
			waiting = true
			c.s.waiting.Add(1)
			defer c.s.waiting.Add(-1)
			c.s.log.Debug("open waits for a commit", "name", req.Name, "pid", c.cred.PID, "seconds", req.Wait)
		}
		select {
		case <-changed:
			continue
		case <-tick.C:
			if c.hungUp() {
				return nil, fmt.Errorf("the client hung up while waiting for %q: %w", req.Name, io.EOF)
			}
			continue
		case <-c.s.waitStopped():
			if !c.s.isParking() {
				return nil, fmt.Errorf("the daemon is stopping: %w", syscall.EIO)
			}
			if left := time.Until(deadline); left > 0 {
				// The successor answers it, waiting what is left.
				again := *req
				again.Wait = left.Seconds()
				b, err := wire.Encode(&again)
				if err != nil {
					return nil, err
				}
				c.pending = b
				return nil, errParked
			}
		case <-timer.C:
		}
		// The deadline passed: one last look, so that a commit that came
		// with it counts.
		seg, _, err = c.s.reg.TryAcquire(cred, req.Name, req.ReadOnly, &w)
		if errors.Is(err, segment.ErrNotFound) && missing != nil {
			err, w = nil, segment.Watch{}
		}
		if seg != nil || err != nil {
			return seg, err
		}
		if w.Seen() {
			return nil, fmt.Errorf("%q was not committed within %gs: %w", req.Name, req.Wait, syscall.ETIMEDOUT)
		}
		return nil, fmt.Errorf("no segment %q was committed within %gs: %w", req.Name, req.Wait, syscall.ETIMEDOUT)
	}
}

// hungUp reports whether the client closed its end of the connection.
func (c *conn) hungUp() bool {
	fds := []unix.PollFd{{Fd: int32(c.wc.FD()), Events: unix.POLLRDHUP}}
	n, err := unix.Poll(fds, 0)
	return err == nil && n > 0 && fds[0].Revents&(unix.POLLHUP|unix.POLLRDHUP|unix.POLLERR|unix.POLLNVAL) != 0
}

// commit makes a segment this connection created uncommitted openable by
// its name, with the request's meta, if any, as its meta from then on.
func (c *conn) commit(req *wire.Request) (*wire.Reply, int) {
	seg, err := c.s.reg.ByID(req.Segment)
	if err != nil {
		return fail(fmt.Errorf("commit: %w", err))
	}
	inf := c.s.reg.Info(seg)
	if inf.Uncommitted && !slices.Contains(c.bound, seg) {
		return fail(fmt.Errorf("commit %q: only the client that created it may commit it: %w", inf.Name, syscall.EPERM))
	}
	if len(req.Meta) > wire.MaxMeta {
		return fail(fmt.Errorf("commit %q: meta of %d bytes, limit %d: %w", inf.Name, len(req.Meta), wire.MaxMeta, syscall.EINVAL))
	}
	if err := c.s.reg.Commit(c.leaseCred(), seg, c.origin(req), req.Meta); err != nil {
		return fail(fmt.Errorf("commit: %w", err))
	}
	if !inf.Bound {
		// An ordinary segment from now on: it outlives this connection.
		c.bound = slices.DeleteFunc(c.bound, func(s *segment.Segment) bool { return s == seg })
	}
	return &wire.Reply{Segment: c.segmentInfo(seg)}, -1
}

// endUncommitted removes seg if this connection created it uncommitted
// and no longer holds it open: the creator gave up on it.
func (c *conn) endUncommitted(seg *segment.Segment) {
	if _, held := c.leases[seg.ID()]; held || !slices.Contains(c.bound, seg) || !c.s.reg.Info(seg).Uncommitted {
		return
	}
	c.bound = slices.DeleteFunc(c.bound, func(s *segment.Segment) bool { return s == seg })
	if err := c.s.reg.Discard(seg); err != nil {
		c.s.log.Error("end uncommitted segment", "segment", seg.ID(), "err", err)
	}
}

// mayReclaim refuses a reclaim of an uncommitted segment by anyone but its
// creator, whose connection holds it after hello (takeBound).
func (c *conn) mayReclaim(id uint64) error {
	seg, err := c.s.reg.ByID(id)
	if err != nil {
		return nil // Reclaim says so
	}
	if c.s.reg.Info(seg).Uncommitted && !slices.Contains(c.bound, seg) {
		return fmt.Errorf("segment %d is not committed yet, and not this client's: %w", id, syscall.EAGAIN)
	}
	return nil
}
