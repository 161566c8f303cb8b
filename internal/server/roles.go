package server

import (
	"errors"
	"fmt"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm/internal/channel"
	"github.com/gpushm/gpushm/internal/segment"
)

// Channels (docs/protocol.md): the server gives out the roles, one producer
// and one consumer per channel, and ends a role when its process goes: when
// the connection that took it closes, or, for a process that outlived a
// serving process's crash and has no connection yet, when its pidfd says it
// exited. Ending a role repairs the control block so that the other end
// never waits forever.

// withBlock maps seg's control block for fn.
func (s *Server) withBlock(seg *segment.Segment, fn func(*channel.Block) error) error {
	return s.reg.WithControl(seg, func(fd int) error { return withBlockFD(fd, fn) })
}

// withBlockFD maps the control block at fd for fn.
func withBlockFD(fd int, fn func(*channel.Block) error) error {
	mem, err := unix.Mmap(fd, 0, channel.BlockBytes, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return fmt.Errorf("map control block: %w", err)
	}
	defer unix.Munmap(mem)
	blk, err := channel.Map(mem)
	if err != nil {
		return err
	}
	return fn(blk)
}

// initControl writes a new channel's control block.
func initControl(slots int, slotBytes int64) func(segment.Memory) error {
	return func(m segment.Memory) error {
		c, ok := m.(*segment.ChannelMemory)
		if !ok {
			return errors.New("not a channel's memory")
		}
		fd, err := c.ControlFD()
		if err != nil {
			return err
		}
		return withBlockFD(fd, func(blk *channel.Block) error {
			blk.Init(slots, slotBytes, channel.Stride(slotBytes))
			return nil
		})
	}
}

// holderProcess is the process a role's holder names.
func holderProcess(h channel.Holder) segment.Process {
	return segment.Process{PID: h.PID, Start: h.Start}
}

// alive reports whether the process that holds a role is still the one
// recorded.
func alive(h channel.Holder) bool {
	p := holderProcess(h)
	return p.Known() && identify(p.PID) == p
}

func parseRole(s string) (channel.Role, error) {
	switch r := channel.Role(s); r {
	case channel.Tx, channel.Rx:
		return r, nil
	}
	return "", fmt.Errorf("role %q (want \"tx\" or \"rx\"): %w", s, syscall.EINVAL)
}

// roleKey names one role of one channel.
type roleKey struct {
	seg  uint64
	role channel.Role
}

// claim gives c role on seg, checking that nobody else alive holds it: no
// other process, and no other connection of c's process (the control block
// knows processes; the server knows its connections). A holder whose
// process is gone is detached first, as dead.
func (c *conn) claim(seg *segment.Segment, role channel.Role) error {
	if !seg.IsChannel() {
		return fmt.Errorf("%q is not a channel: %w", c.s.reg.Info(seg).Name, syscall.EINVAL)
	}
	p := c.proc
	if !p.Known() {
		// A role is ended by its process's exit, which needs its name.
		return fmt.Errorf("identify process %d: its start time cannot be read in /proc (a process of a pid namespace the daemon cannot see?)", c.cred.PID)
	}
	pid, start := p.PID, p.Start
	key := roleKey{seg.ID(), role}
	// One claim at a time, so that two claimants cannot both find the
	// role free.
	c.s.roleMu.Lock()
	err := c.s.withBlock(seg, func(blk *channel.Block) error {
		h := blk.Holder(role)
		if h.State == channel.StateAttached {
			mine := h.PID == pid && h.Start == start
			switch other := c.s.roleHolders[key]; {
			case mine && other != nil && other != c:
				return fmt.Errorf("%w: channel %q has a %s already: another connection of this process (pid %d); a channel has one of each",
					segment.ErrBusy, c.s.reg.Info(seg).Name, roleName(role), h.PID)
			case !mine && alive(h):
				return fmt.Errorf("%w: channel %q has a %s already (pid %d); a channel has one of each",
					segment.ErrBusy, c.s.reg.Info(seg).Name, roleName(role), h.PID)
			case !mine:
				c.s.detach(seg, blk, role, true, h.PID)
			}
		}
		// A channel made before the daemon was upgraded takes the
		// new version once neither end holds it.
		blk.Upgrade()
		blk.Attach(role, pid, start)
		return nil
	})
	if err == nil {
		c.s.setRoleHolderLocked(key, c)
	}
	c.s.roleMu.Unlock()
	if err != nil {
		return err
	}
	c.noteRole(seg.ID(), role)
	// After the unlock: a process that exited already is ended at once.
	c.s.watch(seg, role, channel.Holder{State: channel.StateAttached, PID: pid, Start: start})
	return nil
}

func roleName(r channel.Role) string {
	if r == channel.Rx {
		return "consumer"
	}
	return "producer"
}

// holdRole records that c holds role on channel id (an adopted
// connection's roles, which its predecessor granted).
func (c *conn) holdRole(id uint64, role channel.Role) {
	c.s.roleMu.Lock()
	c.s.setRoleHolderLocked(roleKey{id, role}, c)
	c.s.roleMu.Unlock()
	c.noteRole(id, role)
}

func (s *Server) setRoleHolderLocked(k roleKey, c *conn) {
	if s.roleHolders == nil {
		s.roleHolders = make(map[roleKey]*conn)
	}
	s.roleHolders[k] = c
}

func (c *conn) noteRole(id uint64, role channel.Role) {
	if c.roles[id] == nil {
		c.roles[id] = map[channel.Role]bool{}
	}
	c.roles[id][role] = true
}

// unclaim ends c's role on seg (every role c holds there, for role ""):
// cleanly (the client closed it) or as if its process died (the
// connection ended without a close).
func (c *conn) unclaim(seg *segment.Segment, role channel.Role, died bool) {
	held := c.roles[seg.ID()]
	var end []channel.Role
	for r := range held {
		if role == "" || r == role {
			end = append(end, r)
			delete(held, r)
		}
	}
	if len(held) == 0 {
		delete(c.roles, seg.ID())
	}
	if len(end) == 0 {
		return
	}
	c.s.roleMu.Lock()
	for _, r := range end {
		if k := (roleKey{seg.ID(), r}); c.s.roleHolders[k] == c {
			delete(c.s.roleHolders, k)
		}
	}
	pid := int(c.cred.PID)
	var later []channel.Holder
	err := c.s.withBlock(seg, func(blk *channel.Block) error {
		for _, r := range end {
			h := blk.Holder(r)
			if h.State != channel.StateAttached || h.PID != pid {
				continue
			}
			if died && r == channel.Tx && alive(h) {
				// The socket closes as the process exits, before the
				// driver has surely stopped its GPU work: the cut waits
				// for the exit (watch), or a moment for a process that
				// lives on without its connection.
				later = append(later, h)
				continue
			}
			c.s.detach(seg, blk, r, died, h.PID)
		}
		return nil
	})
	c.s.roleMu.Unlock()
	for _, h := range later {
		time.AfterFunc(deadRoleWait, func() { c.s.endDeadRole(seg, channel.Tx, h) })
	}
	if err != nil {
		c.s.log.Debug("end channel role", "segment", seg.ID(), "err", err)
	}
}

// watch ends role on seg when the process h exits, if it still holds it
// then; at once if it has exited already.
func (s *Server) watch(seg *segment.Segment, role channel.Role, h channel.Holder) {
	end := func() { s.endDeadRole(seg, role, h) }
	err := s.onExit(holderProcess(h), roleKey{seg.ID(), role}, end)
	if errors.Is(err, errExited) || err != nil && !alive(h) {
		end()
	}
	// A live process that cannot be watched (no pidfds): its connection
	// ends the role.
}

// deadRoleWait is how long a producer whose connection ended while its
// process lives keeps its role before it ends as dead; cutGuard is how
// long a break's cut marks are kept against late writes (Block.Recut).
const (
	deadRoleWait = 2 * time.Second
	cutGuard     = 10 * time.Second
)

// endDeadRole ends role on seg as its holder h died, if h holds it still.
func (s *Server) endDeadRole(seg *segment.Segment, role channel.Role, h channel.Holder) {
	s.roleMu.Lock()
	defer s.roleMu.Unlock()
	s.withBlock(seg, func(blk *channel.Block) error {
		if now := blk.Holder(role); now.State == channel.StateAttached && now.PID == h.PID && now.Start == h.Start {
			s.log.Info("channel end exited; its role ends", "segment", seg.ID(), "role", role, "pid", h.PID)
			s.detach(seg, blk, role, true, h.PID)
		}
		return nil
	})
}

// detach ends role on blk; a producer's death that cuts messages off is
// logged, and its cut marks guarded for a while. Call with roleMu held.
func (s *Server) detach(seg *segment.Segment, blk *channel.Block, role channel.Role, died bool, pid int) {
	before := blk.Break()
	blk.Detach(role, died)
	b := blk.Break()
	if b.Count == before.Count {
		return
	}
	s.log.Warn("a dead producer's messages are cut off; the consumer is told", "segment", seg.ID(),
		"pid", pid, "first", b.First, "end", b.End)
	go func() {
		for deadline := time.Now().Add(cutGuard); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
			standing := false
			if err := s.withBlock(seg, func(blk *channel.Block) error {
				standing = blk.Recut()
				return nil
			}); err != nil || !standing {
				return
			}
		}
	}()
}

// RepairChannels checks every channel's roles after a restart: a role whose
// process is gone ends as if it died; one whose process lives is watched
// until it exits (its client reclaims it when it reconnects).
func (s *Server) RepairChannels() {
	for _, seg := range s.reg.Channels() {
		held := map[channel.Role]channel.Holder{}
		s.withBlock(seg, func(blk *channel.Block) error {
			if _, _, _, err := blk.Check(); err != nil {
				s.log.Error("channel control block", "segment", seg.ID(), "err", err)
				return nil
			}
			for _, role := range []channel.Role{channel.Tx, channel.Rx} {
				if h := blk.Holder(role); h.State == channel.StateAttached {
					held[role] = h
				}
			}
			return nil
		})
		for role, h := range held {
			s.watch(seg, role, h) // ends the role now if its process is gone
		}
	}
}

// markRemoved tells a removed channel's ends (the registry calls it).
func (s *Server) markRemoved(seg *segment.Segment) {
	s.withBlock(seg, func(blk *channel.Block) error {
		blk.MarkRemoved()
		return nil
	})
}
