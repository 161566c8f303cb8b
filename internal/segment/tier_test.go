package segment

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/gpushm/gpushm/internal/testutil"
)

const page = 4096

// fakeMover keeps every fake memory's bytes, so that a move can be checked
// to carry them, and counts moves; delay makes moves slow.
type fakeMover struct {
	mu       sync.Mutex
	data     map[int][]byte // by descriptor
	moves    atomic.Int32
	delay    time.Duration
	failNext atomic.Bool
}

func (m *fakeMover) Move(dst, src Memory, n int64) error {
	time.Sleep(m.delay)
	if m.failNext.Swap(false) {
		return syscall.EIO
	}
	m.moves.Add(1)
	m.mu.Lock()
	defer m.mu.Unlock()
	d, _ := dst.FD()
	s, _ := src.FD()
	m.data[d] = bytes.Clone(m.data[s][:min(int64(len(m.data[s])), n)])
	return nil
}

func (m *fakeMover) set(s *Segment, b []byte) {
	m.mu.Lock()
	defer m.mu.Unlock()
	fd, _ := s.FD()
	m.data[fd] = b
}

func (m *fakeMover) get(s *Segment) []byte {
	m.mu.Lock()
	defer m.mu.Unlock()
	fd, _ := s.FD()
	return m.data[fd]
}

type tierFixture struct {
	r            *Registry
	dev, spill   *fakeAlloc
	mover        *fakeMover
	budget, host int64
}

func newTiers(t *testing.T, budgetPages, hostPages int64) *tierFixture {
	t.Helper()
	f := &tierFixture{dev: newFake(), spill: newFake(), mover: &fakeMover{data: map[int][]byte{}},
		budget: budgetPages * page, host: hostPages * page}
	f.spill.next = 1 << 20 // descriptors apart from the device's
	f.r = New(f.dev, nil)
	f.r.SetTiers(Tiers{Budgets: map[int]int64{0: f.budget}, HostBudget: f.host, Spill: f.spill, Mover: f.mover})
	return f
}

// put creates name of one page holding its own name, unopened.
func (f *tierFixture) put(t *testing.T, name string) *Segment {
	t.Helper()
	s, _, err := f.r.Create(alice, CreateOptions{Name: name, Size: page})
	if err != nil {
		t.Fatalf("create %s: %v", name, err)
	}
	f.mover.set(s, []byte(name))
	return s
}

// use opens and closes name, checking its bytes on the device.
func (f *tierFixture) use(t *testing.T, name string) {
	t.Helper()
	s, err := f.r.Acquire(alice, name, false)
	if err != nil {
		t.Fatalf("open %s: %v", name, err)
	}
	f.checkOpen(t, s, name)
	if err := f.r.Release(s); err != nil {
		t.Fatal(err)
	}
}

func (f *tierFixture) checkOpen(t *testing.T, s *Segment, name string) {
	t.Helper()
	if inf := f.r.Info(s); inf.Tier != OnDevice {
		t.Fatalf("%s is open on tier %s", name, inf.Tier)
	}
	if got := f.mover.get(s); string(got) != name {
		t.Fatalf("%s holds %q", name, got)
	}
}

func (f *tierFixture) tiers(t *testing.T) map[string]Tier {
	t.Helper()
	out := map[string]Tier{}
	for _, inf := range f.r.List("", 0) {
		out[inf.Name] = inf.Tier
	}
	if st := f.r.TierStats(); st.Devices[0].Peak > f.budget || st.Devices[0].Bytes > f.budget {
		t.Fatalf("device 0 holds %d bytes (peak %d), budget %d", st.Devices[0].Bytes, st.Devices[0].Peak, f.budget)
	}
	return out
}

func TestTierLeastRecentlyOpenedGoesFirst(t *testing.T) {
	f := newTiers(t, 3, 100)
	for _, n := range []string{"a", "b", "c"} {
		f.put(t, n)
		time.Sleep(time.Millisecond) // distinct times, whatever the clock's grain
	}
	for _, n := range []string{"b", "a", "c"} {
		f.use(t, n)
		time.Sleep(time.Millisecond)
	}
	f.put(t, "d") // b was opened longest ago
	if got := f.tiers(t); got["b"] != OnHost || got["a"] != OnDevice || got["c"] != OnDevice {
		t.Fatalf("after d: %v, want b on host", got)
	}
	time.Sleep(time.Millisecond)
	f.use(t, "b") // back, and a (opened before c and d) makes room
	if got := f.tiers(t); got["a"] != OnHost || got["b"] != OnDevice {
		t.Fatalf("after opening b: %v, want a on host", got)
	}
	for _, n := range []string{"a", "b", "c", "d"} {
		f.use(t, n)
	}
	st := f.r.TierStats()
	if st.Evictions < 3 || st.Restores < 2 || st.HostBytes != page {
		t.Fatalf("stats %+v", st)
	}
	f.r.background.Wait()
	if f.dev.liveCount() != 3 || f.spill.liveCount() != 1 {
		t.Fatalf("%d device and %d host allocations live, want 3 and 1", f.dev.liveCount(), f.spill.liveCount())
	}
}

func TestTierOpenAndPinnedNeverMove(t *testing.T) {
	f := newTiers(t, 3, 100)
	held := f.put(t, "held")
	if _, err := f.r.Acquire(alice, "held", true); err != nil {
		t.Fatal(err)
	}
	if _, _, err := f.r.Create(alice, CreateOptions{Name: "pinned", Size: page, Resident: true}); err != nil {
		t.Fatal(err)
	}
	f.put(t, "x")
	for i := range 5 {
		f.put(t, fmt.Sprintf("y%d", i)) // each pushes the last out
	}
	got := f.tiers(t)
	if got["held"] != OnDevice || got["pinned"] != OnDevice {
		t.Fatalf("%v: an open or pinned segment moved", got)
	}
	for _, name := range []string{"held", "pinned"} {
		if _, err := f.r.Evict(alice, name); !errors.Is(err, ErrPinned) || !errors.Is(err, syscall.EBUSY) {
			t.Fatalf("evict %s: %v, want EBUSY", name, err)
		}
	}
	// Every other segment open too: no room, and nothing left behind.
	for _, name := range []string{"x", "y0", "y1", "y2", "y3", "y4"} {
		if got[name] == OnDevice {
			if _, err := f.r.Acquire(alice, name, true); err != nil {
				t.Fatal(err)
			}
		}
	}
	live := f.dev.liveCount()
	_, _, err := f.r.Create(alice, CreateOptions{Name: "z", Size: page})
	if !errors.Is(err, ErrNoRoom) || !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("create past a budget of open segments: %v, want ENOSPC", err)
	}
	if _, err := f.r.Stat("z"); !errors.Is(err, ErrNotFound) || f.dev.liveCount() != live {
		t.Fatalf("a refused create left %v, %d allocations (was %d)", err, f.dev.liveCount(), live)
	}
	// An evicted segment cannot come back either.
	if _, err := f.r.Acquire(alice, "y0", true); !errors.Is(err, ErrNoRoom) {
		t.Fatalf("open of y0 with no room: %v", err)
	}
	// Unpinned, the pinned one makes room.
	if _, err := f.r.SetResident(alice, "pinned", false); err != nil {
		t.Fatal(err)
	}
	if _, err := f.r.SetResident(bob, "held", false); !errors.Is(err, ErrNotOwner) {
		t.Fatalf("unpin by another user: %v", err)
	}
	f.put(t, "z")
	if got := f.tiers(t); got["pinned"] != OnHost || got["held"] != OnDevice {
		t.Fatalf("%v", got)
	}
	f.checkOpen(t, held, "held")
}

func TestTierHostBudget(t *testing.T) {
	f := newTiers(t, 2, 1)
	f.put(t, "a")
	f.put(t, "b")
	f.put(t, "c") // a goes to host, which is then full
	_, _, err := f.r.Create(alice, CreateOptions{Name: "d", Size: page})
	if !errors.Is(err, ErrNoRoom) {
		t.Fatalf("create with the host budget full: %v, want ENOSPC", err)
	}
	if got := f.tiers(t); got["a"] != OnHost || got["b"] != OnDevice || got["c"] != OnDevice || len(got) != 3 {
		t.Fatalf("%v", got)
	}
	// Eviction off: creates past the budget fail, nothing moves.
	g := newTiers(t, 1, 0)
	g.put(t, "a")
	if _, _, err := g.r.Create(alice, CreateOptions{Name: "b", Size: page}); !errors.Is(err, ErrNoRoom) {
		t.Fatalf("create past the budget with eviction off: %v", err)
	}
	if _, err := g.r.Evict(alice, "a"); !errors.Is(err, ErrNoRoom) {
		t.Fatalf("evict with eviction off: %v", err)
	}
}

func TestTierConcurrentOpensShareOneRestore(t *testing.T) {
	f := newTiers(t, 4, 100)
	f.put(t, "big")
	if _, err := f.r.Evict(alice, "big"); err != nil {
		t.Fatal(err)
	}
	if _, err := f.r.Evict(bob, "big"); !errors.Is(err, ErrNotOwner) {
		t.Fatalf("evict by another user: %v", err)
	}
	f.mover.delay = 20 * time.Millisecond
	before := f.mover.moves.Load()
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for range 8 {
		wg.Go(func() {
			s, err := f.r.Acquire(alice, "big", true)
			if err == nil {
				if got := f.mover.get(s); string(got) != "big" {
					err = fmt.Errorf("holds %q", got)
				}
				f.r.Release(s)
			}
			errs <- err
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if n := f.mover.moves.Load() - before; n != 1 {
		t.Fatalf("%d moves for 8 concurrent opens, want 1", n)
	}
}

func TestTierFailedMoveLeavesItWhole(t *testing.T) {
	f := newTiers(t, 2, 100)
	f.put(t, "a")
	devLive, hostLive := f.dev.liveCount(), f.spill.liveCount()
	f.mover.failNext.Store(true)
	if _, err := f.r.Evict(alice, "a"); !errors.Is(err, syscall.EIO) {
		t.Fatalf("evict with a failing copy: %v", err)
	}
	if got := f.tiers(t); got["a"] != OnDevice || f.dev.liveCount() != devLive || f.spill.liveCount() != hostLive {
		t.Fatalf("after a failed eviction: %v, %d/%d allocations", got, f.dev.liveCount(), f.spill.liveCount())
	}
	if _, err := f.r.Evict(alice, "a"); err != nil {
		t.Fatal(err)
	}
	f.mover.failNext.Store(true)
	if _, err := f.r.Acquire(alice, "a", true); !errors.Is(err, syscall.EIO) {
		t.Fatalf("open with a failing restore: %v", err)
	}
	f.r.background.Wait()
	if got := f.tiers(t); got["a"] != OnHost || f.dev.liveCount() != devLive-1 {
		t.Fatalf("after a failed restore: %v, %d device allocations", got, f.dev.liveCount())
	}
	f.use(t, "a")
}

func TestTierJournaled(t *testing.T) {
	f := newTiers(t, 2, 100)
	j := newJournal()
	f.r.SetJournal(j)
	s := f.put(t, "a")
	if _, err := f.r.Evict(alice, "a"); err != nil {
		t.Fatal(err)
	}
	rec, fd := j.recs[s.ID()], j.fds[s.ID()]
	if !rec.OnHost() || fd < 1<<20 {
		t.Fatalf("after eviction the journal has tier %q, descriptor %d (want host memory's)", rec.Tier, fd)
	}
	// What a restarted daemon makes of it.
	g := newTiers(t, 2, 100)
	mem, _ := g.spill.Allocate(0, rec.Alloc)
	g.r.Restore([]Restored{{Record: rec, Memory: mem}}, rec.ID, 0)
	g.r.EndGrace()
	if inf, err := g.r.Stat("a"); err != nil || inf.Tier != OnHost {
		t.Fatalf("restored: %+v, %v", inf, err)
	}
	mfd, _ := mem.FD()
	g.mover.data[mfd] = []byte("a")
	g.use(t, "a")
	if _, err := f.r.Acquire(alice, "a", true); err != nil {
		t.Fatal(err)
	}
	if rec := j.recs[s.ID()]; rec.OnHost() || j.fds[s.ID()] >= 1<<20 {
		t.Fatalf("after the restore the journal has tier %q, descriptor %d", rec.Tier, j.fds[s.ID()])
	}
}

func TestTierRestoreWaitsForGrace(t *testing.T) {
	f := newTiers(t, 1, 100)
	j := newJournal()
	f.r.SetJournal(j)
	a := f.put(t, "a")
	b := f.put(t, "b") // a is evicted
	recs := []Record{j.recs[a.ID()], j.recs[b.ID()]}
	// b was held by a process the daemon could not name: only the grace
	// period keeps it.
	recs[1].Anon = 1
	g := newTiers(t, 1, 100)
	var items []Restored
	for _, rec := range recs {
		alloc := g.dev
		if rec.OnHost() {
			alloc = g.spill
		}
		mem, _ := alloc.Allocate(0, rec.Alloc)
		fd, _ := mem.FD()
		g.mover.data[fd] = []byte(rec.Name)
		items = append(items, Restored{Record: rec, Memory: mem})
	}
	g.r.Restore(items, b.ID(), 150*time.Millisecond)
	go func() {
		time.Sleep(150 * time.Millisecond)
		g.r.EndGrace()
	}()
	start := time.Now()
	g.use(t, "a") // b may still be mapped until the grace period ends
	if d := time.Since(start); d < 100*time.Millisecond {
		t.Fatalf("a came back after %s, before the grace period ended", d)
	}
	if got := g.tiers(t); got["b"] != OnHost {
		t.Fatalf("%v", got)
	}
}

func TestTierGrowsWhereItLives(t *testing.T) {
	f := newTiers(t, 4, 100)
	f.put(t, "a")
	if _, err := f.r.Evict(alice, "a"); err != nil {
		t.Fatal(err)
	}
	s, _, _ := f.r.Lookup("a")
	f.spill.failWith = syscall.ENOMEM
	f.dev.failWith = syscall.EIO
	err := f.r.Resize(s, 3*page)
	if !errors.Is(err, syscall.ENOMEM) || !strings.Contains(err.Error(), "host memory") {
		t.Fatalf("a resize of a segment on host: %v, want the host allocator's ENOMEM", err)
	}
}

// Restores that race for a budget too small for all of them wait for each
// other's copies, never for each other's room: they all end, each either
// served or refused with ENOSPC, and the budget holds.
func TestTierRacingRestoresEnd(t *testing.T) {
	f := newTiers(t, 2, 100)
	names := []string{"a", "b", "c", "d", "e"}
	for _, n := range names {
		f.put(t, n)
	}
	f.mover.delay = time.Millisecond
	var served, refused atomic.Int32
	done := make(chan struct{})
	go func() {
		defer close(done)
		var wg sync.WaitGroup
		for g := range 4 {
			wg.Go(func() {
				for i := range 20 {
					name := names[(g+i)%len(names)]
					s, err := f.r.Acquire(alice, name, true)
					if errors.Is(err, ErrNoRoom) {
						refused.Add(1)
						continue
					}
					if err != nil {
						t.Error(err)
						return
					}
					if got := f.mover.get(s); string(got) != name {
						t.Errorf("%s holds %q", name, got)
					}
					served.Add(1)
					f.r.Release(s)
				}
			})
		}
		wg.Wait()
	}()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("racing restores did not end in 30s")
	}
	f.tiers(t)
	if served.Load() == 0 {
		t.Fatalf("no open served (%d refused)", refused.Load())
	}
	t.Logf("%d served, %d refused for want of room", served.Load(), refused.Load())
}

// A segment brought back and opened only read-only keeps its host copy:
// evicting it again copies nothing. A read-write open, a write through
// the daemon or a resize drops the copy, and so does a need for room
// under the host budget.
func TestTierCleanCopy(t *testing.T) {
	f := newTiers(t, 1, 3)
	f.put(t, "a")
	if _, err := f.r.Evict(alice, "a"); err != nil {
		t.Fatal(err)
	}
	read := func(name string) {
		t.Helper()
		s, err := f.r.Acquire(alice, name, true)
		if err != nil {
			t.Fatal(err)
		}
		f.checkOpen(t, s, name)
		f.r.Release(s)
	}
	read("a") // restored, with a clean copy
	if st := f.r.TierStats(); st.CleanBytes != page || st.HostBytes != 0 {
		t.Fatalf("after a read-only restore: %+v", st)
	}
	moves := f.mover.moves.Load()
	if _, err := f.r.Evict(alice, "a"); err != nil {
		t.Fatal(err)
	}
	if n := f.mover.moves.Load() - moves; n != 0 {
		t.Fatalf("evicting a clean segment copied %d times", n)
	}
	read("a")
	if s, err := f.r.Acquire(alice, "a", false); err != nil {
		t.Fatal(err)
	} else {
		f.r.Release(s)
	}
	f.r.background.Wait()
	if st := f.r.TierStats(); st.CleanBytes != 0 || f.spill.liveCount() != 0 {
		t.Fatalf("after a read-write open: %+v, %d host allocations", st, f.spill.liveCount())
	}
	moves = f.mover.moves.Load()
	if _, err := f.r.Evict(alice, "a"); err != nil {
		t.Fatal(err)
	}
	if n := f.mover.moves.Load() - moves; n != 1 {
		t.Fatalf("evicting a segment opened read-write copied %d times, want 1", n)
	}
	// A daemon write (the FUSE view's), through a pin for writing.
	read("a")
	s, _, _ := f.r.Lookup("a")
	if err := f.r.Pin(alice, s, Write); err != nil {
		t.Fatal(err)
	}
	f.r.Unpin(s)
	if st := f.r.TierStats(); st.CleanBytes != 0 {
		t.Fatalf("after a pin for writing: %+v", st)
	}
}

// A fill writes through the daemon's own mapping, whatever lease its
// client holds (a read-only one, here): the clean copy goes, or the next
// eviction would bring back the bytes from before the fill, under the
// fill's source.
func TestTierFillDropsTheCleanCopy(t *testing.T) {
	f := newTiers(t, 1, 3)
	f.put(t, "a")
	if _, err := f.r.Evict(alice, "a"); err != nil {
		t.Fatal(err)
	}
	s, err := f.r.Acquire(alice, "a", true) // restored, with a clean copy
	if err != nil {
		t.Fatal(err)
	}
	if st := f.r.TierStats(); st.CleanBytes != page {
		t.Fatalf("after a read-only restore: %+v", st)
	}
	f.r.Filling(alice, s)
	f.r.background.Wait()
	if st := f.r.TierStats(); st.CleanBytes != 0 {
		t.Fatalf("after a fill: %+v", st)
	}
	f.r.Release(s)
}

// A clean copy never takes host memory past its budget: kept only when
// there is room, dropped first when an eviction needs room.
func TestTierCleanCopyWithinHostBudget(t *testing.T) {
	f := newTiers(t, 1, 2)
	read := func(name string) {
		t.Helper()
		s, err := f.r.Acquire(alice, name, true)
		if err != nil {
			t.Fatal(err)
		}
		f.r.Release(s)
	}
	f.put(t, "a")
	f.put(t, "b") // a to host
	read("a")     // b to host, a back with a clean copy: 2 of 2
	if st := f.r.TierStats(); st.HostBytes != page || st.CleanBytes != page {
		t.Fatalf("%+v", st)
	}
	f.put(t, "c") // a's eviction is a swap: a and b on host
	read("c")
	read("b") // c to host needs room: host holds a, c; b's copy would make 3
	f.r.background.Wait()
	if st := f.r.TierStats(); st.HostBytes != 2*page || st.CleanBytes != 0 || f.spill.liveCount() != 2 {
		t.Fatalf("%+v, %d host allocations", st, f.spill.liveCount())
	}
}

// A create that could not fit even with everything evicted fails at once,
// evicting nothing.
func TestTierHopelessCreateEvictsNothing(t *testing.T) {
	f := newTiers(t, 3, 100)
	for _, n := range []string{"a", "b", "c"} {
		f.put(t, n)
	}
	if _, _, err := f.r.Create(alice, CreateOptions{Name: "big", Size: 4 * page}); !errors.Is(err, ErrNoRoom) {
		t.Fatalf("create larger than the budget: %v", err)
	}
	if got := f.tiers(t); got["a"] != OnDevice || got["b"] != OnDevice || got["c"] != OnDevice {
		t.Fatalf("a hopeless create evicted: %v", got)
	}
	if st := f.r.TierStats(); st.Evictions != 0 {
		t.Fatalf("%d evictions", st.Evictions)
	}
}

// A user's quota counts a segment once, wherever it lives: evicting one
// frees no quota, and bringing it back takes none.
func TestTierQuotaCountsOnce(t *testing.T) {
	f := newTiers(t, 2, 100)
	f.r.SetLimits(Limits{UserBytes: 3 * page})
	f.put(t, "a")
	f.put(t, "b")
	if _, err := f.r.Evict(alice, "a"); err != nil {
		t.Fatal(err)
	}
	f.put(t, "c") // the third page of the quota, with a on host
	if _, _, err := f.r.Create(alice, CreateOptions{Name: "d", Size: page}); !errors.Is(err, ErrQuota) {
		t.Fatalf("a fourth page past a quota of three, one of them evicted: %v", err)
	}
	f.use(t, "a") // back, evicting another: still three pages, no refusal
	for _, q := range f.r.Quotas() {
		if q.Kind == "user_bytes" && q.Used != 3*page {
			t.Fatalf("quota use %d, want %d", q.Used, 3*page)
		}
	}
}

// TestTierVictimRemovedBeforeItMoves: the segment an eviction picked is
// unlinked (and freed) while the eviction waits to copy it. The eviction
// has nothing to copy then, and the create it made room for goes on: the
// removal made the room.
func TestTierVictimRemovedBeforeItMoves(t *testing.T) {
	f := newTiers(t, 2, 100)
	a := f.put(t, "a")
	f.put(t, "b")
	a.io.Lock() // the daemon's own copy of a, which the move waits for
	created := make(chan error, 1)
	go func() {
		_, _, err := f.r.Create(alice, CreateOptions{Name: "c", Size: page})
		created <- err
	}()
	testutil.WaitFor(t, "the eviction of a", func() bool {
		f.r.mu.Lock()
		defer f.r.mu.Unlock()
		return a.moving != nil
	})
	unlinked := make(chan error, 1)
	go func() { unlinked <- f.r.Unlink(alice, "a") }()
	testutil.WaitFor(t, "a's removal", func() bool {
		f.r.mu.Lock()
		defer f.r.mu.Unlock()
		return a.gone
	})
	a.io.Unlock()
	if err := <-unlinked; err != nil {
		t.Fatalf("unlink: %v", err)
	}
	if err := <-created; err != nil {
		t.Fatalf("create, while the segment it evicted was removed: %v", err)
	}
	f.r.background.Wait()
	if got := f.tiers(t); len(got) != 2 || got["b"] != OnDevice || got["c"] != OnDevice {
		t.Fatalf("after the create: %v", got)
	}
	if n := f.spill.liveCount(); n != 0 {
		t.Fatalf("%d host allocations left, want 0", n)
	}
}

// dataMover moves the bytes of files_test.go's fake memory.
type dataMover struct{}

func (dataMover) Move(dst, src Memory, n int64) error { return dst.(*dataMem).CopyFrom(src, n) }

// TestTierGrowthEvicts: a file that grows in the FUSE view (a write past
// its end) makes room under the budget as a create does, evicting the
// least recently opened segment, and fails with ENOSPC when nothing may
// move; the budget holds throughout.
func TestTierGrowthEvicts(t *testing.T) {
	const budget = 4 * page
	r := New(newDataAlloc(), nil)
	r.SetTiers(Tiers{Budgets: map[int]int64{0: budget}, HostBudget: 100 * page, Spill: newDataAlloc(), Mover: dataMover{}})
	create := func(name string) *Segment {
		t.Helper()
		s, _, err := r.Create(alice, CreateOptions{Name: name, Size: page})
		if err != nil {
			t.Fatalf("create %s: %v", name, err)
		}
		return s
	}
	check := func(want map[string]Tier) {
		t.Helper()
		r.background.Wait()
		for _, inf := range r.List("", 0) {
			if w, ok := want[inf.Name]; ok && inf.Tier != w {
				t.Errorf("%s on %s, want %s", inf.Name, inf.Tier, w)
			}
		}
		if st := r.TierStats(); st.Devices[0].Peak > budget {
			t.Fatalf("device 0 held %d bytes at its peak, budget %d", st.Devices[0].Peak, budget)
		}
	}
	create("a")
	create("b")
	file := create("file")
	if err := r.Pin(alice, file, Read|Write); err != nil {
		t.Fatal(err)
	}
	defer r.Unpin(file)
	// One page grows to two: with a and b, and the old page while the
	// bytes are copied, five would be in use.
	if _, err := r.WriteAt(file, []byte("grown"), page); err != nil {
		t.Fatalf("a write that grows the file: %v", err)
	}
	check(map[string]Tier{"a": OnHost, "b": OnDevice, "file": OnDevice})
	c := create("c")
	if err := r.Pin(alice, c, Read); err != nil {
		t.Fatal(err)
	}
	defer r.Unpin(c)
	if _, err := r.Evict(alice, "b"); err != nil {
		t.Fatal(err)
	}
	// The file (two pages) and c, both pinned, leave one page free: no
	// growth fits beside the file's copy.
	if _, err := r.WriteAt(file, []byte("more"), 2*page); !errors.Is(err, ErrNoRoom) {
		t.Fatalf("a growth that nothing may make room for: %v, want ErrNoRoom", err)
	}
	check(map[string]Tier{"a": OnHost, "b": OnHost, "c": OnDevice, "file": OnDevice})
	got := make([]byte, 5)
	if _, err := r.ReadAt(file, got, page); err != nil || string(got) != "grown" {
		t.Fatalf("the file after the refused growth: %q, %v", got, err)
	}
}

// TestPeakWithoutBudget: info's peak is the most a device held, whether or
// not it has a budget; a budget is chosen from it.
func TestPeakWithoutBudget(t *testing.T) {
	r := New(newFake(), nil)
	if _, _, err := r.Create(alice, CreateOptions{Name: "a", Size: 3 * page}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := r.Create(alice, CreateOptions{Name: "b", Size: page}); err != nil {
		t.Fatal(err)
	}
	if err := r.Unlink(alice, "a"); err != nil {
		t.Fatal(err)
	}
	st := r.TierStats()
	if len(st.Devices) != 1 || st.Devices[0].Budget != 0 || st.Devices[0].Bytes != page || st.Devices[0].Peak != 4*page {
		t.Fatalf("after 4 pages and 3 freed, no budget: %+v; want 1 page held, peak 4 pages", st.Devices)
	}
}

// TestCreatePastWholeBudget: a create larger than the whole budget says
// so, without evicting anything or blaming the segments that are there.
func TestCreatePastWholeBudget(t *testing.T) {
	f := newTiers(t, 4, 16)
	f.put(t, "x")
	_, _, err := f.r.Create(alice, CreateOptions{Name: "big", Size: 5 * page})
	want := fmt.Sprintf("%d bytes exceeds device 0's budget of %d bytes", 5*page, 4*page)
	if !errors.Is(err, ErrNoRoom) || !strings.Contains(err.Error(), want) || strings.Contains(err.Error(), "unable to move") {
		t.Fatalf("create of 5 pages under a budget of 4: %v; want ENOSPC saying %q", err, want)
	}
	if got := f.tiers(t); got["x"] != OnDevice || f.mover.moves.Load() != 0 {
		t.Fatalf("a create that could never fit moved segments: %v, %d moves", got, f.mover.moves.Load())
	}
	if _, err := f.r.Stat("big"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("a refused create left its name: %v", err)
	}
}

// NextEviction is what the host reserve grows to: the largest segment on
// the device that may be evicted and has no copy on the host, while the
// host budget has room for it.
func TestNextEviction(t *testing.T) {
	f := newTiers(t, 20, 4)
	if n := f.r.NextEviction(); n != 0 {
		t.Fatalf("no segments: %d, want 0", n)
	}
	mk := func(name string, pages int64, resident bool) {
		t.Helper()
		if _, _, err := f.r.Create(alice, CreateOptions{Name: name, Size: pages * page, Resident: resident}); err != nil {
			t.Fatal(err)
		}
	}
	mk("a", 2, false)
	mk("b", 1, false)
	mk("pinned", 3, true) // never evicted
	// Published memory never moves either.
	m, err := f.dev.Allocate(0, 3*page)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := f.r.Create(alice, CreateOptions{Name: "published", Size: 3 * page, Memory: m}); err != nil {
		t.Fatal(err)
	}
	if n := f.r.NextEviction(); n != 2*page {
		t.Fatalf("a (2 pages), b, a pinned and a published segment (3): %d, want a's %d", n, 2*page)
	}
	f.r.SetTiers(Tiers{HostBudget: f.host, Spill: f.spill, Mover: f.mover})
	if n := f.r.NextEviction(); n != 0 {
		t.Fatalf("no device budget (nothing is evicted but on request): %d, want 0", n)
	}
	f.r.SetTiers(Tiers{Budgets: map[int]int64{0: f.budget}, HostBudget: f.host, Spill: f.spill, Mover: f.mover})
	// Evicted, then back with a clean copy: its next eviction is a swap.
	if _, err := f.r.Evict(alice, "a"); err != nil {
		t.Fatal(err)
	}
	if n := f.r.NextEviction(); n != page {
		t.Fatalf("a on the host: %d, want b's %d", n, page)
	}
	s, err := f.r.Acquire(alice, "a", true)
	if err != nil {
		t.Fatal(err)
	}
	f.r.Release(s)
	if n := f.r.NextEviction(); n != page {
		t.Fatalf("a back with a clean copy: %d, want b's %d", n, page)
	}
	// a's clean copy would make room for c (dropped first).
	mk("c", 4, false)
	if n := f.r.NextEviction(); n != 4*page {
		t.Fatalf("c (4 pages) beside a's clean copy (2 of the host budget's 4): %d, want %d", n, 4*page)
	}
	// The host budget (4 pages, 1 held by b evicted) has no room for c.
	if _, err := f.r.Evict(alice, "b"); err != nil {
		t.Fatal(err)
	}
	if n := f.r.NextEviction(); n != 0 {
		t.Fatalf("c (4 pages) with 3 pages of host budget left: %d, want 0", n)
	}
	f.r.SetTiers(Tiers{Budgets: map[int]int64{0: f.budget}, Spill: f.spill, Mover: f.mover})
	if n := f.r.NextEviction(); n != 0 {
		t.Fatalf("eviction off (no host budget): %d, want 0", n)
	}
}
