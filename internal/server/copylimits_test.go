package server

import (
	"errors"
	"io"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/gpushm/gpushm/internal/fairshare"
)

// testWaiter is a copyWaiter whose client is there until gone is set; it
// counts the times its connection was set aside.
type testWaiter struct {
	asides atomic.Int32
	gone   atomic.Bool
	stop   chan struct{}
}

func newTestWaiter() *testWaiter { return &testWaiter{stop: make(chan struct{})} }

func (w *testWaiter) waiter() copyWaiter {
	return copyWaiter{aside: func() { w.asides.Add(1) }, gone: w.gone.Load, stop: w.stop}
}

// mustEnter admits a copy of uid at once.
func mustEnter(t *testing.T, l *copyLimits, uid uint32) *copySlot {
	t.Helper()
	w := newTestWaiter()
	s, err := l.enter(uid, w.waiter())
	if err != nil {
		t.Fatalf("copy of uid %d: %v", uid, err)
	}
	if w.asides.Load() != 0 {
		t.Fatalf("copy of uid %d waited before it started", uid)
	}
	return s
}

// enterLater starts a copy of uid that may wait, and returns what it gets.
func enterLater(l *copyLimits, uid uint32, w *testWaiter) <-chan error {
	got := make(chan error, 1)
	go func() {
		s, err := l.enter(uid, w.waiter())
		if err == nil {
			defer s.leave()
		}
		got <- err
	}()
	return got
}

// fillPool has three users run two copies each, and two more one each,
// all of them copies that never end: the pool of maxCopies is full.
func fillPool(t *testing.T, l *copyLimits) []*copySlot {
	t.Helper()
	var held []*copySlot
	for uid := uint32(2000); uid < 2004; uid++ {
		held = append(held, mustEnter(t, l, uid))
		if uid < 2003 {
			held = append(held, mustEnter(t, l, uid))
		}
	}
	held = append(held, mustEnter(t, l, 2004))
	if l.pooled != maxCopies {
		t.Fatalf("%d copies in the pool, want it full (%d)", l.pooled, maxCopies)
	}
	return held
}

// testUserCopyLimit: a user's limit is final and counts stuck copies.
func testUserCopyLimit(t *testing.T) {
	var l copyLimits
	a, b := mustEnter(t, &l, 1000), mustEnter(t, &l, 1000)
	w := newTestWaiter()
	_, err := l.enter(1000, w.waiter())
	if !errors.Is(err, syscall.EAGAIN) || !strings.Contains(err.Error(), "copies per user: uid 1000 runs 2 copies, limit 2") || w.asides.Load() != 0 {
		t.Fatalf("copy %d of one user: %v (waited: %v), want EAGAIN at once naming the limit", maxUserCopies+1, err, w.asides.Load() > 0)
	}
	// Its client gone, a copy stuck in a read leaves the pool but
	// still counts against its user.
	a.leavePool()
	if l.pooled != 1 {
		t.Fatalf("%d copies in the pool after one left it, want 1", l.pooled)
	}
	if _, err := l.enter(1000, newTestWaiter().waiter()); !errors.Is(err, syscall.EAGAIN) {
		t.Fatalf("a user with a stuck copy and another: %v, want EAGAIN", err)
	}
	a.leave()
	c := mustEnter(t, &l, 1000)
	b.leave()
	c.leave()
	if l.pooled != 0 || len(l.byUser) != 0 {
		t.Fatalf("after every copy ended: %d pooled, users %v", l.pooled, l.byUser)
	}
}

// TestCopyLimits: the rules of copyLimits, one by one.
func TestCopyLimits(t *testing.T) {
	defer func(d time.Duration) { copyWait = d }(copyWait)
	copyWait = 300 * time.Millisecond

	t.Run("a user's limit is final and counts stuck copies", testUserCopyLimit)

	t.Run("root and users running none never wait", func(t *testing.T) {
		var l copyLimits
		fillPool(t, &l)
		for range 3 * maxCopies {
			mustEnter(t, &l, 0)
		}
		for uid := uint32(3000); uid < 3000+2*maxCopies; uid++ {
			mustEnter(t, &l, uid)
		}
	})

	t.Run("a user running one waits for room, off the workers", func(t *testing.T) {
		var l copyLimits
		held := fillPool(t, &l)
		first := mustEnter(t, &l, 4000)
		defer first.leave()
		w := newTestWaiter()
		got := enterLater(&l, 4000, w)
		select {
		case err := <-got:
			t.Fatalf("a second copy with the pool full: %v, want it to wait", err)
		case <-time.After(50 * time.Millisecond):
		}
		if w.asides.Load() != 1 {
			t.Fatalf("the waiting copy's connection was set aside %d times, want 1", w.asides.Load())
		}
		// Clients hang up: their copies leave the pool, stuck or not.
		for _, s := range held[:6] {
			s.leavePool()
		}
		if err := <-got; err != nil {
			t.Fatalf("the second copy once the pool had room: %v", err)
		}
	})

	t.Run("the wait is bounded, and the refusal says the rule", func(t *testing.T) {
		var l copyLimits
		fillPool(t, &l)
		first := mustEnter(t, &l, 4000)
		defer first.leave()
		start := time.Now()
		err := <-enterLater(&l, 4000, newTestWaiter())
		want := "copies of the daemon: uid 4000 runs 1 and asked for 1 more, while the daemon runs 9, its limit of 8"
		if !errors.Is(err, syscall.EAGAIN) || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), "waited 300ms") {
			t.Fatalf("got %v, want EAGAIN saying %q after waiting", err, want)
		}
		if d := time.Since(start); d < copyWait || d > copyWait+2*time.Second {
			t.Fatalf("refused after %v, want after %v", d, copyWait)
		}
	})

	t.Run("fair shares below the pool's limit", func(t *testing.T) {
		// Four users run one each: half the pool. A second copy of any
		// would be above its fair share (7/4 = 1).
		var l copyLimits
		for uid := uint32(5000); uid < 5004; uid++ {
			mustEnter(t, &l, uid)
		}
		err := <-enterLater(&l, 5000, newTestWaiter())
		r := fairshare.Shares{Cap: maxCopies}.Check(4, 1, 1, func() int { return 4 })
		if r == nil {
			t.Fatal("fairshare allows the second copy; the test's numbers are off")
		}
		want := r.Describe("copies", "end", 5000)
		if !errors.Is(err, syscall.EAGAIN) || !strings.Contains(err.Error(), want) {
			t.Fatalf("got %v, want EAGAIN saying %q", err, want)
		}
	})

	t.Run("a waiting copy whose client hangs up ends", func(t *testing.T) {
		defer func(d time.Duration) { copyWait = d }(copyWait)
		copyWait = time.Minute
		var l copyLimits
		fillPool(t, &l)
		mustEnter(t, &l, 4000)
		w := newTestWaiter()
		got := enterLater(&l, 4000, w)
		time.Sleep(50 * time.Millisecond)
		w.gone.Store(true)
		select {
		case err := <-got:
			if !errors.Is(err, io.EOF) {
				t.Fatalf("got %v, want EOF", err)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("a waiting copy went on waiting after its client hung up")
		}
		w = newTestWaiter()
		got = enterLater(&l, 4000, w)
		close(w.stop)
		if err := <-got; !errors.Is(err, syscall.EAGAIN) || !strings.Contains(err.Error(), "handing over") {
			t.Fatalf("a copy waiting while the daemon parks: %v, want EAGAIN", err)
		}
	})
}
