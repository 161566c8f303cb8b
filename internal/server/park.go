package server

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm/internal/channel"
	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/wire"
)

// A serving process hands its clients to a successor (an upgrade) without
// dropping one: Park stops accepting, lets every connection finish the
// request it is answering, and stops it before it reads the next; the
// connections' sockets and their state (leases, creator-bound segments,
// session) go to the successor, which Adopts them. A request a client sent
// meanwhile waits, unread, in its socket for the successor. If the handover
// fails, Resume serves them again here.

// ConnState is a parked connection's state, as the successor needs it.
type ConnState struct {
	Hello   bool                `json:"hello"`
	Session string              `json:"session,omitempty"`
	Leases  map[uint64]int      `json:"leases,omitempty"`
	Bound   []uint64            `json:"bound,omitempty"`
	Roles   map[uint64][]string `json:"roles,omitempty"`
	// PID and Start name the process that made the connection, as it was
	// accepted; absent from a predecessor that did not say, which names
	// it again from the socket.
	PID   int    `json:"pid,omitempty"`
	Start uint64 `json:"start,omitempty"`
	// Reclaiming: the client has made only reclaims since its hello.
	Reclaiming bool `json:"reclaiming,omitempty"`
	// Pending is a request read and not answered yet: an open waiting
	// for a commit, its wait shortened by the time already waited.
	Pending json.RawMessage `json:"pending,omitempty"`
}

// ParkedConn is one parked connection: its socket (the Server's, valid
// until the process exits or Resume) and its state.
type ParkedConn struct {
	FD    int
	State json.RawMessage
}

func (s *Server) isParking() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.parking
}

// waitUnparked blocks while the server is parked, and reports whether it
// was (the accept loop then starts over).
func (s *Server) waitUnparked(ctx context.Context) bool {
	s.mu.Lock()
	if !s.parking {
		s.mu.Unlock()
		return false
	}
	ch := s.resumed
	s.mu.Unlock()
	select {
	case <-ch:
	case <-ctx.Done():
	}
	return true
}

// Park stops serving for a successor: no more connections are accepted
// from ln, every connection stops between two requests, and their sockets
// and state are returned. The registry stays as it is; the caller stops
// journaling (Registry.Detach) once the state went to the successor.
func (s *Server) Park() ([]ParkedConn, error) {
	s.mu.Lock()
	if s.parking {
		s.mu.Unlock()
		return nil, errors.New("already parked")
	}
	s.parking = true
	s.resumed = make(chan struct{})
	s.stopWaitsLocked()
	s.mu.Unlock()
	s.stopWorkers()
	s.wakeAccept()
	var one [8]byte
	one[0] = 1
	if _, err := unix.Write(s.wake, one[:]); err != nil {
		return nil, fmt.Errorf("wake connections: %w", err)
	}
	// Each worker finishes its request, sees parking, and exits; wg counts
	// them. From then on no worker runs, and Park owns every connection:
	// those armed in the idle set stay there, unread.
	s.wg.Wait()
	s.mu.Lock()
	conns := make([]*conn, 0, len(s.conns))
	for c := range s.conns {
		conns = append(conns, c)
	}
	s.mu.Unlock()
	s.drain(conns)
	out := make([]ParkedConn, 0, len(conns))
	for _, c := range conns {
		if len(c.out) > 0 {
			// The successor could not send what this one owes the
			// client; the client reconnects and reclaims, as after a crash.
			s.log.Warn("upgrade: not handing over a connection whose client does not read its replies",
				"pid", c.cred.PID, "uid", c.cred.UID, "waited", parkDrain)
			continue
		}
		st := ConnState{Hello: c.hello, Session: c.session, Leases: map[uint64]int{}, Roles: map[uint64][]string{},
			Pending: c.pending, PID: c.proc.PID, Start: c.proc.Start, Reclaiming: c.reclaiming}
		for id, l := range c.leases {
			st.Leases[id] = l.n
		}
		for id, roles := range c.roles {
			for r := range roles {
				st.Roles[id] = append(st.Roles[id], string(r))
			}
		}
		for _, seg := range c.bound {
			st.Bound = append(st.Bound, seg.ID())
		}
		b, err := json.Marshal(st)
		if err != nil {
			return nil, err
		}
		out = append(out, ParkedConn{FD: c.wc.FD(), State: b})
	}
	return out, nil
}

// drain sends the replies parked connections still owe their clients,
// waiting up to parkDrain for clients to read.
func (s *Server) drain(conns []*conn) {
	deadline := time.Now().Add(parkDrain)
	for {
		var fds []unix.PollFd
		for _, c := range conns {
			if len(c.out) == 0 {
				continue
			}
			if err := c.flush(); err != nil {
				c.dropOut() // the client is gone; the successor sees it hang up
				continue
			}
			if len(c.out) > 0 {
				fds = append(fds, unix.PollFd{Fd: int32(c.wc.FD()), Events: unix.POLLOUT})
			}
		}
		left := time.Until(deadline)
		if len(fds) == 0 || left <= 0 {
			return
		}
		ts := unix.NsecToTimespec(left.Nanoseconds())
		if _, err := unix.Ppoll(fds, &ts, nil); err != nil && err != unix.EINTR {
			return
		}
	}
}

// Resume serves the parked connections again, after a failed handover.
func (s *Server) Resume() {
	var buf [8]byte
	unix.Read(s.wake, buf[:]) // clear the eventfds
	unix.Read(s.acceptWake, buf[:])
	unix.Read(s.pollStop, buf[:])
	s.mu.Lock()
	s.parking = false
	s.waitStop = make(chan struct{})
	close(s.resumed)
	exited := s.exitedParked
	s.exitedParked = nil
	var stopped []*conn
	for c := range s.conns {
		if c.state == stateStopped {
			c.state = stateRunning // Resume's, until armed
			stopped = append(stopped, c)
		}
	}
	if s.workers.Load() == 0 {
		s.spawn()
	}
	s.mu.Unlock()
	for _, c := range stopped {
		s.resume(c)
	}
	// Processes that exited while parked: what they held ends now.
	for _, fn := range exited {
		fn()
	}
}

// Adopt serves a connection that a predecessor parked: fd (owned by the
// server from now on) and the state it wrote. Its leases are taken again
// without a permission check: they were granted before.
func (s *Server) Adopt(fd int, state json.RawMessage) error {
	var st ConnState
	if err := json.Unmarshal(state, &st); err != nil {
		unix.Close(fd)
		return fmt.Errorf("parked connection state: %w", err)
	}
	wc, err := wire.NewConn(fd)
	if err != nil {
		unix.Close(fd)
		return err
	}
	c := &conn{s: s, wc: wc, hello: st.Hello, session: st.Session, leases: make(map[uint64]*lease),
		roles: make(map[uint64]map[channel.Role]bool), pending: st.Pending, adopted: true, reclaiming: st.Reclaiming}
	if st.PID > 0 {
		c.proc = segment.Process{PID: st.PID, Start: st.Start}
	} else if cred, err := wc.PeerCred(); err == nil {
		c.proc = peerProcess(wc, int(cred.PID)) // a predecessor that did not say
	}
	c.procKnown = true
	// Its leases are journaled under its process, and restored for it:
	// taking them back turns those into this connection's.
	as := segment.Root
	as.Proc, as.Session = c.proc, c.session
	for id, n := range st.Leases {
		seg, err := s.reg.Reclaim(as, id, n, true)
		if err != nil {
			s.log.Warn("adopted connection: a lease it held is gone", "segment", id, "err", err)
			continue
		}
		for range n {
			c.hold(seg)
		}
		for _, r := range st.Roles[id] {
			// The control block says so already; the connection ends it.
			c.holdRole(id, channel.Role(r))
		}
	}
	for _, id := range st.Bound {
		if seg := s.takeBoundID(id); seg != nil {
			c.bound = append(c.bound, seg)
		}
	}
	if err := s.add(c); err != nil {
		wc.Close()
		return err
	}
	return nil
}

// restoredSeg is a creator-bound segment restored after a restart, waiting
// for its creator to say hello again.
type restoredSeg struct {
	seg     *segment.Segment
	creator segment.Process
	// watched says the creator's exit is watched: the segment ends then,
	// not when the grace period does.
	watched bool
}

// StartGrace begins the grace period after a restart, until until (now or
// earlier: none). Journaled leases are kept for their processes for as
// long as each lives, reconnecting or not (watchHolders); leases of
// processes that could not be named wait for their holders to reclaim
// them, and what was not reclaimed when the grace period ends, ends. A restored creator-bound
// segment waits for its creator's session to say hello again for as long
// as the creator's process lives, and ends as soon as it exits (at once if
// it exited while the daemon was down); only a segment whose creator
// cannot be watched (a process of another pid namespace, or one recorded
// before creators were) ends with the grace period. Call after Restore and
// Adopt, before Serve.
func (s *Server) StartGrace(until time.Time) {
	bound := map[string][]restoredSeg{}
	creators := map[segment.Process]bool{}
	for _, b := range s.reg.Bound() {
		if s.isAdopted(b.Segment) {
			continue
		}
		known := b.Creator.Known()
		bound[b.Session] = append(bound[b.Session], restoredSeg{seg: b.Segment, creator: b.Creator, watched: known})
		if known {
			creators[b.Creator] = true
		}
	}
	s.mu.Lock()
	s.restoredBound = bound
	s.mu.Unlock()
	type boundKey struct{}
	for p := range creators {
		err := s.onExit(p, boundKey{}, func() { s.endRestoredBound(p, "its creator exited") })
		switch {
		case errors.Is(err, errExited):
			s.endRestoredBound(p, "its creator exited while the daemon was down")
		case err != nil:
			s.log.Warn("cannot watch the creator of temporary segments; they end with the grace period unless it comes back", "pid", p.PID, "err", err)
			s.unwatch(p)
		}
	}
	unwatched := s.watchHolders()
	end := func() {
		for _, p := range unwatched {
			s.endHolds(p, "the grace period is over and its process cannot be watched")
		}
		s.mu.Lock()
		var left []*segment.Segment
		for session, segs := range s.restoredBound {
			kept := segs[:0]
			for _, r := range segs {
				if r.watched {
					kept = append(kept, r)
				} else {
					left = append(left, r.seg)
				}
			}
			if len(kept) > 0 {
				s.restoredBound[session] = kept
			} else {
				delete(s.restoredBound, session)
			}
		}
		s.mu.Unlock()
		for _, seg := range left {
			s.reg.Discard(seg)
		}
		s.reg.EndGrace()
		if len(left) > 0 {
			s.log.Info("grace period over: ended creator-bound segments whose creators did not come back and could not be watched", "segments", len(left))
		}
	}
	if d := time.Until(until); d > 0 {
		s.log.Info("grace period: clients of the last serving process may reclaim their leases", "for", d.Round(time.Millisecond))
		time.AfterFunc(d, end)
	} else {
		end()
	}
}

// holdKey is the key under which a process's restored leases wait for its
// exit (onExit).
type holdKey struct{}

// watchHolders watches every process that holds restored leases, and ends
// its leases when it exits (at once if it exited while the daemon was
// down). It returns the processes that cannot be watched: their leases
// end with the grace period, unless reclaimed.
func (s *Server) watchHolders() (unwatched []segment.Process) {
	for _, p := range s.reg.RestoredHolders() {
		err := s.onExit(p, holdKey{}, func() { s.endHolds(p, "its process exited") })
		switch {
		case errors.Is(err, errExited):
			s.endHolds(p, "its process exited while the daemon was down")
		case err != nil:
			s.log.Warn("cannot watch a process holding leases; they end with the grace period unless it comes back", "pid", p.PID, "err", err)
			unwatched = append(unwatched, p)
		}
	}
	return unwatched
}

// endHolds ends the restored leases of p.
func (s *Server) endHolds(p segment.Process, why string) {
	if n := s.reg.EndHolds(p); n > 0 {
		s.log.Info("leases ended: "+why, "pid", p.PID, "leases", n)
	}
}

// endRestoredBound ends the restored creator-bound segments that p made
// and that no connection took back.
func (s *Server) endRestoredBound(p segment.Process, why string) {
	var ended []*segment.Segment
	s.mu.Lock()
	for session := range s.restoredBound {
		ended = append(ended, s.takeRestored(session, func(r restoredSeg) bool { return r.creator == p })...)
	}
	s.mu.Unlock()
	for _, seg := range ended {
		// Discard leaves a name alone that now names another segment.
		if err := s.reg.Discard(seg); err != nil {
			s.log.Error("end creator-bound segment", "segment", seg.ID(), "err", err)
		}
	}
	if len(ended) > 0 {
		s.log.Info("ended temporary segments: "+why, "pid", p.PID, "segments", len(ended))
	}
}

// unwatch leaves p's restored creator-bound segments to the grace period.
func (s *Server) unwatch(p segment.Process) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, segs := range s.restoredBound {
		for i := range segs {
			if segs[i].creator == p {
				segs[i].watched = false
			}
		}
	}
}

func (s *Server) isAdopted(seg *segment.Segment) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for c := range s.conns {
		for _, b := range c.bound {
			if b == seg {
				return true
			}
		}
	}
	return false
}

// takeRestored takes the restored creator-bound segments of session that
// take picks out of s.restoredBound. Call with s.mu held.
func (s *Server) takeRestored(session string, take func(restoredSeg) bool) []*segment.Segment {
	var taken []*segment.Segment
	var rest []restoredSeg
	for _, r := range s.restoredBound[session] {
		if take(r) {
			taken = append(taken, r.seg)
		} else {
			rest = append(rest, r)
		}
	}
	if len(rest) > 0 {
		s.restoredBound[session] = rest
	} else {
		delete(s.restoredBound, session)
	}
	return taken
}

// takeBound gives a client saying hello with session its restored
// creator-bound segments (those it owns, or all for root). They are bound
// to its connection from now on, and to its process p across the next
// restart.
func (s *Server) takeBound(session string, uid uint32, p segment.Process) []*segment.Segment {
	s.mu.Lock()
	mine := s.takeRestored(session, func(r restoredSeg) bool { return uid == 0 || s.reg.Info(r.seg).UID == uid })
	s.mu.Unlock()
	for _, seg := range mine {
		s.reg.Rebind(seg, p)
	}
	return mine
}

// takeBoundID finds a creator-bound segment by id for an adopted
// connection; nothing else claims it, since the grace period has not
// started yet.
func (s *Server) takeBoundID(id uint64) *segment.Segment {
	for _, b := range s.reg.Bound() {
		if b.Segment.ID() == id {
			return b.Segment
		}
	}
	return nil
}
