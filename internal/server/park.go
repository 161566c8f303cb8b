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
	s.wakeAccept()
	var one [8]byte
	one[0] = 1
	if _, err := unix.Write(s.wake, one[:]); err != nil {
		return nil, fmt.Errorf("wake connections: %w", err)
	}
	// Each connection's goroutine finishes its request, sees parking, and
	// returns; wg counts them.
	s.wg.Wait()
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]ParkedConn, 0, len(s.parked))
	for _, c := range s.parked {
		st := ConnState{Hello: c.hello, Session: c.session, Leases: map[uint64]int{}, Roles: map[uint64][]string{},
			Pending: c.pending}
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

// Resume serves the parked connections again, after a failed handover.
func (s *Server) Resume() {
	var buf [8]byte
	unix.Read(s.wake, buf[:]) // clear the eventfds
	unix.Read(s.acceptWake, buf[:])
	s.mu.Lock()
	parked := s.parked
	s.parked = nil
	s.parking = false
	s.waitStop = make(chan struct{})
	close(s.resumed)
	s.mu.Unlock()
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, c := range parked {
		s.goServe(c)
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
		roles: make(map[uint64]map[channel.Role]bool), pending: st.Pending}
	for id, n := range st.Leases {
		seg, err := s.reg.Reclaim(segment.Root, id, n, true)
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
	if err := s.run(c); err != nil {
		wc.Close()
		return err
	}
	return nil
}

// StartGrace begins the grace period after a restart, until until (now or
// earlier: none): restored creator-bound segments wait for their creators
// to say hello again, restored leases for their holders to reclaim them.
// When it ends, what was not reclaimed ends too. Call after Restore and
// Adopt, before Serve.
func (s *Server) StartGrace(until time.Time) {
	bound := map[string][]*segment.Segment{}
	for seg, session := range s.reg.Bound() {
		if !s.isAdopted(seg) {
			bound[session] = append(bound[session], seg)
		}
	}
	s.mu.Lock()
	s.restoredBound = bound
	s.mu.Unlock()
	end := func() {
		s.mu.Lock()
		left := s.restoredBound
		s.restoredBound = nil
		s.mu.Unlock()
		n := 0
		for _, segs := range left {
			for _, seg := range segs {
				s.reg.Discard(seg)
				n++
			}
		}
		s.reg.EndGrace()
		if n > 0 {
			s.log.Info("grace period over: ended creator-bound segments whose creators did not come back", "segments", n)
		}
	}
	if d := time.Until(until); d > 0 {
		s.log.Info("grace period: clients of the last serving process may reclaim their leases", "for", d.Round(time.Millisecond))
		time.AfterFunc(d, end)
	} else {
		end()
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

// takeBound gives a client saying hello with session its restored
// creator-bound segments (those it owns, or all for root).
func (s *Server) takeBound(session string, uid uint32) []*segment.Segment {
	s.mu.Lock()
	defer s.mu.Unlock()
	segs := s.restoredBound[session]
	var mine, rest []*segment.Segment
	for _, seg := range segs {
		if uid == 0 || s.reg.Info(seg).UID == uid {
			mine = append(mine, seg)
		} else {
			rest = append(rest, seg)
		}
	}
	if len(rest) > 0 {
		s.restoredBound[session] = rest
	} else {
		delete(s.restoredBound, session)
	}
	return mine
}

// takeBoundID finds a creator-bound segment by id for an adopted
// connection; nothing else claims it, since the grace period has not
// started yet.
func (s *Server) takeBoundID(id uint64) *segment.Segment {
	for seg := range s.reg.Bound() {
		if seg.ID() == id {
			return seg
		}
	}
	return nil
}
