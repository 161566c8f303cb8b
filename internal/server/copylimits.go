package server

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"syscall"
	"time"

	"github.com/gpushm/gpushm/internal/fairshare"
)

// Copies at once. A copy reads its file for as long as the file's reads
// take, and a read from a FUSE file whose server holds it does not
// return: not even SIGKILL ends such a read (docs/security.md,
// "Resources"). So a copy counts two ways:
//
//   - against its user, maxUserCopies at most (root has no limit), from
//     its start until it returns, however long a read holds it: this is
//     what bounds the copies a user can leave stuck;
//   - in the daemon's pool of maxCopies shared by all users, while its
//     client is there: a copy whose client hangs up stops at its copiers'
//     next chunk (watchClient), and leaves the pool at once,
//     before it can stop.
//
// Root and a user running no copy always start one, beyond the pool if
// need be: whatever users hold, including copies stuck for ever, each
// user gets a copy, and root as many as it asks for. A user already
// running one gets another only within the pool and its fair share of it
// (internal/fairshare, as for segments and connections); else it waits,
// off the workers, up to copyWait for a copy to end, and is then refused
// with EAGAIN, the rule and its numbers. What a copy holds besides (its
// goroutines and threads, pinned buffers from a pool that never makes a
// copy wait: xfer.Pool) is bounded per copy.
const (
	maxCopies     = 8
	maxUserCopies = 2
)

// copyWait is how long a user's further copy waits for room in the pool.
var copyWait = 30 * time.Second

type copyLimits struct {
	mu sync.Mutex
	// pooled are the copies in the pool: those whose client is still there.
	pooled int
	// byUser are each user's copies, stuck ones included.
	byUser map[uint32]int
	// changed is closed, and made anew, when a copy leaves the pool or
	// ends: copies waiting for room look again.
	changed chan struct{}
}

// A copySlot is one copy's place in copyLimits.
type copySlot struct {
	l      *copyLimits
	uid    uint32
	pooled bool // under l.mu
}

// copyWaiter is what a copy waiting for room needs of its connection.
type copyWaiter struct {
	aside func()          // takes the connection off the workers, before it waits
	gone  func() bool     // its client hung up
	stop  <-chan struct{} // closed when the daemon stops or parks
}

// enter admits a copy of uid, at once, after waiting for room up to
// copyWait, or not (EAGAIN, naming the rule).
func (l *copyLimits) enter(uid uint32, w copyWaiter) (*copySlot, error) {
	var timer *time.Timer
	var tick *time.Ticker
	for {
		l.mu.Lock()
		why, final := l.refusal(uid)
		if why == nil {
			l.pooled++
			l.byUser[uid]++
			l.mu.Unlock()
			return &copySlot{l: l, uid: uid, pooled: true}, nil
		}
		changed := l.changed
		l.mu.Unlock()
		if final {
			return nil, why
		}
		if timer == nil {
			w.aside()
			timer, tick = time.NewTimer(copyWait), time.NewTicker(hangupEvery)
			defer timer.Stop()
			defer tick.Stop()
		}
		select {
		case <-changed:
		case <-tick.C:
			if w.gone() {
				return nil, fmt.Errorf("the client hung up while its copy waited: %w", io.EOF)
			}
		case <-w.stop:
			return nil, fmt.Errorf("the daemon is stopping or handing over to a new one; copy again: %w", syscall.EAGAIN)
		case <-timer.C:
			return nil, fmt.Errorf("waited %v: %w", copyWait, why)
		}
	}
}

// refusal says why a copy of uid may not start now (nil: it may), and
// whether that is final (waiting would not help); mu is held.
func (l *copyLimits) refusal(uid uint32) (why error, final bool) {
	if l.byUser == nil {
		l.byUser = make(map[uint32]int)
		l.changed = make(chan struct{})
	}
	held := l.byUser[uid]
	switch {
	case uid == 0 || held == 0:
		return nil, false
	case held >= maxUserCopies:
		return fmt.Errorf("copies per user: uid %d runs %d copies, limit %d (a copy stuck in a read counts until the read returns, even after its client is gone); wait for one to end: %w",
			uid, held, maxUserCopies, syscall.EAGAIN), true
	case l.pooled >= maxCopies:
		return fmt.Errorf("copies of the daemon: uid %d runs %d and asked for 1 more, while the daemon runs %d, its limit of %d for users already copying (root and users copying nothing still start one); try again when one ends: %w",
			uid, held, l.pooled, maxCopies, syscall.EAGAIN), false
	}
	if r := (fairshare.Shares{Cap: maxCopies}).Check(int64(l.pooled), int64(held), 1, l.users); r != nil {
		return fmt.Errorf("%s: %w", r.Describe("copies", "end", uid), syscall.EAGAIN), false
	}
	return nil, false
}

// users counts the users other than root running copies; mu is held.
func (l *copyLimits) users() int {
	n := 0
	for uid := range l.byUser {
		if uid != 0 {
			n++
		}
	}
	return n
}

// leavePool takes the copy out of the daemon's pool, once its client is
// gone: it still counts against its user until it returns (leave).
func (s *copySlot) leavePool() {
	l := s.l
	l.mu.Lock()
	defer l.mu.Unlock()
	if s.pooled {
		s.pooled = false
		l.pooled--
		l.wake()
	}
}

// leave ends the copy's place.
func (s *copySlot) leave() {
	s.leavePool()
	l := s.l
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.byUser[s.uid]--; l.byUser[s.uid] == 0 {
		delete(l.byUser, s.uid)
	}
	l.wake()
}

// wake tells waiting copies to look again; mu is held.
func (l *copyLimits) wake() {
	close(l.changed)
	l.changed = make(chan struct{})
}

// watchClient returns a context that ends when c's client hangs up
// (looked at every hangupEvery): the copy then stops at its next chunk,
// and slot leaves the pool at once, before the copy can stop. end stops
// the watch, and waits for it.
func (c *conn) watchClient(slot *copySlot) (ctx context.Context, end func()) {
	ctx, cancel := context.WithCancelCause(context.Background())
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		tick := time.NewTicker(hangupEvery)
		defer tick.Stop()
		for {
			select {
			case <-done:
				return
			case <-tick.C:
				if c.hungUp() {
					slot.leavePool()
					cancel(errors.New("the client hung up"))
					return
				}
			}
		}
	})
	return ctx, func() {
		close(done)
		wg.Wait()
		cancel(nil)
	}
}
