package segment

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// fakeJournal records what the registry journals, as a supervisor would:
// the latest record and descriptor of every segment alive.
type fakeJournal struct {
	mu   sync.Mutex
	recs map[uint64]Record
	fds  map[uint64]int
	log  []string
}

func newJournal() *fakeJournal {
	return &fakeJournal{recs: map[uint64]Record{}, fds: map[uint64]int{}}
}

func (j *fakeJournal) Put(rec Record, fd, ctl int) {
	j.mu.Lock()
	defer j.mu.Unlock()
	j.log = append(j.log, j.putLocked(rec, fd))
}

func (j *fakeJournal) putLocked(rec Record, fd int) string {
	j.recs[rec.ID] = rec
	if fd >= 0 {
		j.fds[rec.ID] = fd
	} else if rec.Alloc == 0 {
		delete(j.fds, rec.ID)
	}
	return fmt.Sprintf("put %s linked=%v fd=%v", rec.Name, rec.Linked, fd >= 0)
}

func (j *fakeJournal) Delete(id uint64) {
	j.mu.Lock()
	defer j.mu.Unlock()
	j.log = append(j.log, j.deleteLocked(id))
}

func (j *fakeJournal) deleteLocked(id uint64) string {
	name := j.recs[id].Name
	delete(j.recs, id)
	delete(j.fds, id)
	return "del " + name
}

// Batch is one entry of the log, as it is one message to a supervisor.
func (j *fakeJournal) Batch(cs []Change) {
	j.mu.Lock()
	defer j.mu.Unlock()
	var parts []string
	for _, c := range cs {
		if c.Gone {
			parts = append(parts, j.deleteLocked(c.Record.ID))
		} else {
			parts = append(parts, j.putLocked(c.Record, -1))
		}
	}
	j.log = append(j.log, "batch["+strings.Join(parts, "; ")+"]")
}

func (j *fakeJournal) take() []string {
	j.mu.Lock()
	defer j.mu.Unlock()
	l := j.log
	j.log = nil
	return l
}

func TestJournalRecordsEveryChange(t *testing.T) {
	f := newFake()
	r := New(f, nil)
	j := newJournal()
	r.SetJournal(j)
	steps := []struct {
		name string
		do   func() error
		want []string
	}{
		{"create", func() error {
			_, _, err := r.Create(alice, CreateOptions{Name: "a", Size: 100, Meta: []byte(`{"x":1}`)})
			return err
		}, []string{"put a linked=true fd=true"}},
		{"chmod", func() error {
			s, _, _ := r.Lookup("a")
			return r.SetMode(alice, s, 0o640)
		}, []string{"put a linked=true fd=false"}},
		{"rename", func() error { return r.Rename(alice, "a", "b", 0) }, []string{"put b linked=true fd=false"}},
		{"unlink", func() error { return r.Unlink(alice, "b") }, []string{"del b"}},
		{"unlink while open", func() error {
			s, _, err := r.Create(alice, CreateOptions{Name: "c", Size: 1, Open: true})
			if err != nil {
				return err
			}
			if err := r.Unlink(alice, "c"); err != nil {
				return err
			}
			return r.Release(s)
		}, []string{"put c linked=true fd=true", "put c linked=false fd=false", "del c"}},
		{"failed create", func() error {
			f.failWith = errors.New("no")
			defer func() { f.failWith = nil }()
			if _, _, err := r.Create(alice, CreateOptions{Name: "d", Size: 1}); err == nil {
				return errors.New("create succeeded")
			}
			return nil
		}, nil},
		{"open of a TTL segment stops its clock", func() error {
			if _, _, err := r.Create(alice, CreateOptions{Name: "t", Size: 1, TTL: time.Hour}); err != nil {
				return err
			}
			s, err := r.Acquire(alice, "t", true)
			if err != nil {
				return err
			}
			return r.Release(s)
		}, []string{"put t linked=true fd=true", "put t linked=true fd=false", "put t linked=true fd=false"}},
	}
	for _, st := range steps {
		if err := st.do(); err != nil {
			t.Fatalf("%s: %v", st.name, err)
		}
		if got := j.take(); !slices.Equal(got, st.want) {
			t.Fatalf("%s journaled %q, want %q", st.name, got, st.want)
		}
	}
	if rec := j.recs[r.mustID(t, "t")]; rec.TTL != int64(time.Hour) || rec.InUse {
		t.Fatalf("TTL record after the last close: %+v", rec)
	}
}

func (r *Registry) mustID(t *testing.T, name string) uint64 {
	t.Helper()
	s, _, err := r.Lookup(name)
	if err != nil {
		t.Fatal(err)
	}
	return s.ID()
}

// restart builds a registry from what j holds, as a restarted server does
// from its supervisor, with the fake descriptors as memory.
func restart(t *testing.T, f *fakeAlloc, j *fakeJournal, grace time.Duration) (*Registry, *fakeJournal, []string) {
	t.Helper()
	r := New(f, nil)
	nj := newJournal()
	r.SetJournal(nj)
	var items []Restored
	var next uint64
	for id, rec := range j.recs {
		nj.recs[id] = rec
		it := Restored{Record: rec}
		if fd, ok := j.fds[id]; ok {
			nj.fds[id] = fd
			it.Memory = &fakeMem{f: f, fd: fd, size: rec.Alloc}
		}
		items = append(items, it)
		next = max(next, id)
	}
	orphans := r.Restore(items, next, grace)
	nj.take()
	return r, nj, orphans
}

func TestRestoreAndGrace(t *testing.T) {
	f := newFake()
	r := New(f, nil)
	j := newJournal()
	r.SetJournal(j)
	// Leases of a process that could not be named (alice's Cred names
	// none): only the grace period keeps them after a restart.
	r.Create(alice, CreateOptions{Name: "keep", Size: 10, Mode: 0o640, UseMode: true, Meta: []byte(`{"k":1}`), Open: true})
	open, _, _ := r.Create(alice, CreateOptions{Name: "gone-but-open", Size: 10, Open: true})
	r.Unlink(alice, "gone-but-open")
	creator := Process{PID: 4242, Start: 777}
	r.Create(alice, CreateOptions{Name: "bound", Size: 10, Bound: true, Session: "s1", Creator: creator})
	r.Create(alice, CreateOptions{Name: "ttl-open", Size: 10, TTL: time.Millisecond})
	ttlLease, _ := r.Acquire(alice, "ttl-open", false)
	// The server dies here: its registry is lost, the journal is not.
	_, _ = open, ttlLease

	r2, j2, orphans := restart(t, f, j, time.Hour)
	if len(orphans) != 0 {
		t.Fatalf("orphans %v", orphans)
	}
	inf, err := r2.Stat("keep")
	if err != nil || inf.Mode != 0o640 || string(inf.Meta) != `{"k":1}` || inf.UID != alice.UID || !inf.Doubt {
		t.Fatalf("keep after restart: %+v, %v", inf, err)
	}
	if r2.Usage().Segments != 4 {
		t.Fatalf("usage %+v: the unlinked-but-open segment must be kept", r2.Usage())
	}
	// In the grace period: the open TTL segment does not expire, a resize
	// is refused (a client may still map it), the bound one waits for its
	// creator.
	if got := r2.Expire(time.Now().Add(time.Hour)); len(got) != 0 {
		t.Fatalf("expired during the grace period: %v", got)
	}
	s, _, _ := r2.Lookup("keep")
	if err := r2.Resize(s, 99999); !errors.Is(err, ErrBusy) || !strings.Contains(err.Error(), "restarted") {
		t.Fatalf("resize during the grace period = %v, want ErrBusy", err)
	}
	b := r2.Bound()
	if len(b) != 1 || b[0].Session != "s1" || b[0].Creator != creator {
		t.Fatalf("Bound() = %+v, want one segment of session s1 made by %+v", b, creator)
	}
	// The creator came back as another process: the next restart waits
	// for that one.
	next := Process{PID: 4343, Start: 888}
	r2.Rebind(b[0].Segment, next)
	if got := j2.recs[b[0].Segment.ID()]; got.CreatorPID != next.PID || got.CreatorStart != next.Start {
		t.Fatalf("journaled creator after Rebind: pid %d start %d, want %+v", got.CreatorPID, got.CreatorStart, next)
	}
	// A client reclaims its lease on the unlinked segment by id.
	if _, err := r2.Reclaim(eve, open.ID(), 1, false); !errors.Is(err, ErrPermission) {
		t.Fatalf("reclaim by another user = %v, want ErrPermission", err)
	}
	held, err := r2.Reclaim(alice, open.ID(), 1, false)
	if err != nil {
		t.Fatal(err)
	}
	r2.EndGrace()
	if r2.Usage().Segments != 4 {
		t.Fatalf("usage %+v after the grace period: the reclaimed segment must stay", r2.Usage())
	}
	if err := r2.Release(held); err != nil {
		t.Fatal(err)
	}
	if r2.Usage().Segments != 3 {
		t.Fatalf("usage %+v after the reclaimed lease ended", r2.Usage())
	}
	if got := j2.take(); !slices.Contains(got, "del gone-but-open") {
		t.Fatalf("journal after the last lease: %q", got)
	}
	// The TTL segment's clock runs from the end of the grace period.
	if got := r2.Expire(time.Now().Add(time.Second)); !slices.Equal(got, []string{"ttl-open"}) {
		t.Fatalf("Expire after the grace period = %v", got)
	}
	if err := r2.Resize(s, 99999); errors.Is(err, ErrBusy) {
		t.Fatalf("resize after the grace period: %v", err)
	}
}

func TestJournalResize(t *testing.T) {
	r := New(newDataAlloc(), nil)
	j := newJournal()
	r.SetJournal(j)
	s, _, err := r.Create(alice, CreateOptions{Name: "f", AllowEmpty: true, Pin: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Resize(s, 10000); err != nil {
		t.Fatal(err)
	}
	if err := r.Resize(s, 0); err != nil {
		t.Fatal(err)
	}
	want := []string{"put f linked=true fd=false", "put f linked=true fd=true", "put f linked=true fd=false"}
	if got := j.take(); !slices.Equal(got, want) {
		t.Fatalf("journaled %q, want %q", got, want)
	}
	if _, ok := j.fds[s.ID()]; ok || j.recs[s.ID()].Alloc != 0 {
		t.Fatalf("a segment resized to 0 still has memory in the journal: %+v", j.recs[s.ID()])
	}
}

func TestRestoreOrphans(t *testing.T) {
	f := newFake()
	j := newJournal()
	good := &fakeMem{f: f, fd: 7, size: 4096}
	f.live[7] = 4096
	bad := &fakeMem{f: f, fd: 8, size: 4096}
	f.live[8] = 4096
	r := New(f, nil)
	r.SetJournal(j)
	orphans := r.Restore([]Restored{
		{Record: Record{ID: 1, Name: "ok", Linked: true, Size: 10, Alloc: 4096, Mode: 0o600}, Memory: good},
		{Record: Record{ID: 2, Name: "nofd", Linked: true, Size: 10, Alloc: 4096}},
		{Record: Record{ID: 3, Name: "ok", Linked: true, Size: 10, Alloc: 4096}, Memory: bad},
		{Record: Record{ID: 9, Name: "", Linked: false}, Memory: nil},
		{Record: Record{ID: 4, Name: "a/b", Linked: true}},
	}, 20, 0)
	slices.Sort(orphans)
	if want := []string{"orphaned-2", "orphaned-3", "orphaned-4"}; !slices.Equal(orphans, want) {
		t.Fatalf("orphans %v, want %v", orphans, want)
	}
	if _, err := r.Acquire(Root, "orphaned-3", false); !errors.Is(err, ErrOrphan) {
		t.Fatalf("open of an orphan = %v, want ErrOrphan", err)
	}
	inf, _ := r.Stat("orphaned-3")
	if !strings.Contains(inf.Orphan, `"ok"`) {
		t.Fatalf("orphan reason %q does not name the segment it was", inf.Orphan)
	}
	// Removing an orphan frees what it held.
	r.EndGrace()
	if err := r.Unlink(Root, "orphaned-3"); err != nil {
		t.Fatal(err)
	}
	if _, ok := f.live[8]; ok {
		t.Fatal("the orphan's descriptor was not freed by rm")
	}
	// IDs go on from the highest given out.
	s, _, err := r.Create(alice, CreateOptions{Name: "new", Size: 1})
	if err != nil || s.ID() != 21 {
		t.Fatalf("new segment id %d (%v), want 21", s.ID(), err)
	}
}

func TestRetriedCreateFindsItsSegment(t *testing.T) {
	f := newFake()
	r := New(f, nil)
	o := CreateOptions{Name: "x", Size: 10, Open: true, Origin: "sess/7"}
	a, created, err := r.Create(alice, o)
	if err != nil || !created {
		t.Fatal(err)
	}
	b, created, err := r.Create(alice, o)
	if err != nil || !created || b != a {
		t.Fatalf("retried create = %v, %v, %v; want the same segment, created", b, created, err)
	}
	o.Origin = "sess/8"
	if _, _, err := r.Create(alice, o); !errors.Is(err, ErrExist) {
		t.Fatalf("another request = %v, want ErrExist", err)
	}
	if f.liveCount() != 1 {
		t.Fatalf("%d allocations, want 1", f.liveCount())
	}
}

// TestJournalRenameIsOneChange: a rename that changes two segments (over
// an existing name, freed or kept open; an exchange) reaches the journal
// as one batch, and a registry rebuilt from the journal has the names as
// the rename left them.
func TestJournalRenameIsOneChange(t *testing.T) {
	f := newFake()
	r := New(f, nil)
	j := newJournal()
	r.SetJournal(j)
	create := func(name string, open bool) *Segment {
		t.Helper()
		s, _, err := r.Create(alice, CreateOptions{Name: name, Size: 10, Open: open, Meta: []byte(`{"was":"` + name + `"}`)})
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	a, b, c := create("a", false), create("b", false), create("c", true)
	create("d", false)
	j.take()
	steps := []struct {
		name     string
		from, to string
		flags    uint32
		want     []string
	}{
		{"over a name nobody has open", "a", "b", 0, []string{"batch[del b; put b linked=true fd=false]"}},
		{"over a name still open", "b", "c", 0, []string{"batch[put c linked=false fd=false; put c linked=true fd=false]"}},
		{"exchange", "c", "d", RenameExchange, []string{"batch[put d linked=true fd=false; put c linked=true fd=false]"}},
		{"to a free name", "d", "e", 0, []string{"put e linked=true fd=false"}},
	}
	for _, st := range steps {
		if err := r.Rename(alice, st.from, st.to, st.flags); err != nil {
			t.Fatalf("%s: rename %s to %s: %v", st.name, st.from, st.to, err)
		}
		if got := j.take(); !slices.Equal(got, st.want) {
			t.Fatalf("%s: journaled %q, want %q", st.name, got, st.want)
		}
	}
	if _, ok := j.recs[b.ID()]; ok {
		t.Fatal("the segment renamed over while unopened is still in the journal")
	}
	// What a restarted daemon makes of the journal: "a" renamed to b, to
	// c, exchanged with d and moved to e; "d" now named "c"; the first
	// "c" kept unnamed for its lease.
	r2, _, orphans := restart(t, f, j, time.Hour)
	if len(orphans) != 0 {
		t.Fatalf("orphans after the restart: %v", orphans)
	}
	for name, want := range map[string]string{"e": `{"was":"a"}`, "c": `{"was":"d"}`} {
		inf, err := r2.Stat(name)
		if err != nil || string(inf.Meta) != want {
			t.Fatalf("%s after the restart: %+v, %v; want meta %s", name, inf, err, want)
		}
	}
	for _, name := range []string{"a", "b", "d"} {
		if _, err := r2.Stat(name); !errors.Is(err, ErrNotFound) {
			t.Fatalf("%s after the restart: %v, want ErrNotFound", name, err)
		}
	}
	if _, err := r2.Reclaim(alice, c.ID(), 1, false); err != nil {
		t.Fatalf("reclaim of the unnamed, still open segment: %v", err)
	}
	if got := r2.Info(mustSeg(t, r2, "e")).ID; got != a.ID() {
		t.Fatalf("e is segment %d, want %d", got, a.ID())
	}
}

func mustSeg(t *testing.T, r *Registry, name string) *Segment {
	t.Helper()
	s, _, err := r.Lookup(name)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// TestReplay: a journal that lost what it held (a supervisor that died) is
// given the state again, the same as it had been journaled, and the
// highest ID given out.
func TestReplay(t *testing.T) {
	f := newFake()
	r := New(f, nil)
	j := newJournal()
	r.SetJournal(j)
	for _, name := range []string{"a", "b", "c", "gone"} {
		if _, _, err := r.Create(alice, CreateOptions{Name: name, Size: 100, Meta: []byte(`{"n":"` + name + `"}`)}); err != nil {
			t.Fatal(err)
		}
	}
	last := r.mustID(t, "gone")
	if err := r.Unlink(alice, "gone"); err != nil {
		t.Fatal(err)
	}
	open, err := r.Acquire(alice, "b", false)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Release(open)
	if err := r.Unlink(alice, "b"); err != nil { // unnamed, still open
		t.Fatal(err)
	}
	if err := r.Rename(alice, "c", "c2", 0); err != nil {
		t.Fatal(err)
	}
	nj := newJournal()
	r.SetJournal(nj)
	next := r.Replay()
	if next != last {
		t.Fatalf("Replay = %d, want the highest ID given out, %d (removed since)", next, last)
	}
	if !maps.EqualFunc(nj.recs, j.recs, func(a, b Record) bool { return fmt.Sprint(a) == fmt.Sprint(b) }) {
		t.Fatalf("replayed records %+v\nwant %+v", nj.recs, j.recs)
	}
	if !maps.Equal(nj.fds, j.fds) {
		t.Fatalf("replayed descriptors %v, want %v", nj.fds, j.fds)
	}
	if got := nj.take(); !slices.Equal(got, []string{"put a linked=true fd=true", "put b linked=false fd=true", "put c2 linked=true fd=true"}) {
		t.Fatalf("replayed %q", got)
	}
}

// TestLeasesJournaled: every lease is journaled under the process that
// took it; a restarted registry keeps them for those processes, past the
// grace period, until the process takes them back (Reclaim) or the server
// ends them (EndHolds, when the process exits). A TTL segment so held does
// not expire; its clock starts when the last holder goes.
func TestLeasesJournaled(t *testing.T) {
	f := newFake()
	r := New(f, nil)
	j := newJournal()
	r.SetJournal(j)
	p1, p2 := Process{PID: 100, Start: 1}, Process{PID: 200, Start: 2}
	a1, a2 := alice, alice
	a1.Proc, a2.Proc = p1, p2
	a1.Session, a2.Session = "s1", "s2"
	a, _, err := r.Create(a1, CreateOptions{Name: "a", Size: 10, Open: true})
	if err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if _, err := r.Acquire(a2, "a", true); err != nil {
			t.Fatal(err)
		}
	}
	b, _, _ := r.Create(a1, CreateOptions{Name: "b", Size: 10, Open: true})
	r.Unlink(alice, "b")
	r.Create(alice, CreateOptions{Name: "ttl", Size: 10, TTL: 50 * time.Millisecond})
	if _, err := r.Acquire(a2, "ttl", true); err != nil {
		t.Fatal(err)
	}
	if err := r.ReleaseBy(a, a2); err != nil {
		t.Fatal(err)
	}
	want := []Holder{{PID: 100, Start: 1, Session: sessionID("s1"), N: 1}, {PID: 200, Start: 2, Session: sessionID("s2"), N: 1}}
	if rec := j.recs[a.ID()]; !rec.Leases || !slices.Equal(rec.Holders, want) || rec.Anon != 0 {
		t.Fatalf("a's record: leases %v holders %+v anon %d, want %+v", rec.Leases, rec.Holders, rec.Anon, want)
	}

	// The grace period ends at once: journaled leases do not wait for it.
	r2, j2, _ := restart(t, f, j, 0)
	r2.EndGrace()
	time.Sleep(60 * time.Millisecond) // past ttl's TTL
	if got := r2.Expire(time.Now()); len(got) != 0 {
		t.Fatalf("expired while its holder lives: %v", got)
	}
	if inf, err := r2.Stat("a"); err != nil || inf.Opens != 2 || inf.Doubt {
		t.Fatalf("a after the restart: opens %d doubt %v (%v), want 2 leases held for their processes", inf.Opens, inf.Doubt, err)
	}
	if u := r2.Usage(); u.Segments != 3 {
		t.Fatalf("usage %+v: b, unlinked, is held by p1", u)
	}
	got := r2.RestoredHolders()
	slices.SortFunc(got, func(x, y Process) int { return x.PID - y.PID })
	if !slices.Equal(got, []Process{p1, p2}) {
		t.Fatalf("RestoredHolders() = %v, want [%v %v]", got, p1, p2)
	}
	// p2 comes back and takes its lease on a: the same lease, not another.
	back, err := r2.Reclaim(a2, a.ID(), 1, true)
	if err != nil {
		t.Fatal(err)
	}
	if inf, _ := r2.Stat("a"); inf.Opens != 2 {
		t.Fatalf("a after p2's reclaim: opens %d, want 2", inf.Opens)
	}
	if err := r2.ReleaseBy(back, a2); err != nil {
		t.Fatal(err)
	}
	if rec := j2.recs[a.ID()]; !slices.Equal(rec.Holders, want[:1]) {
		t.Fatalf("a's record after p2 closed: %+v, want %+v", rec.Holders, want[:1])
	}
	// p1's client comes back in the session it had and takes back
	// nothing; its leases end then, not when p1 exits. Another session of
	// p1 ends nothing.
	other := a1
	other.Session = "another"
	if n := r2.EndSessionHolds(other); n != 0 {
		t.Fatalf("EndSessionHolds of another session = %d, want 0", n)
	}
	if n := r2.EndSessionHolds(a1); n != 2 {
		t.Fatalf("EndSessionHolds(p1's session) = %d, want 2 (a and b)", n)
	}
	// p2 exits: its lease on ttl ends, and the clock starts then.
	if n := r2.EndHolds(p2); n != 1 {
		t.Fatalf("EndHolds(p2) = %d, want 1 (its lease on ttl)", n)
	}
	if got := r2.Expire(time.Now()); len(got) != 0 {
		t.Fatalf("expired at once when its holder went: %v", got)
	}
	if got := r2.Expire(time.Now().Add(time.Second)); !slices.Equal(got, []string{"ttl"}) {
		t.Fatalf("Expire a TTL after its holder went = %v", got)
	}
	if _, ok := j2.recs[b.ID()]; ok {
		t.Fatal("b is still journaled after the leases that kept it ended")
	}
	if inf, _ := r2.Stat("a"); inf.Opens != 0 || len(j2.recs[a.ID()].Holders) != 0 {
		t.Fatalf("a after both holders' leases ended: opens %d, holders %+v", inf.Opens, j2.recs[a.ID()].Holders)
	}
}

// TestLeasesJournaledBounded: a record names at most maxHolders
// processes; the leases of the others are journaled as anonymous, which
// the grace period waits for.
func TestLeasesJournaledBounded(t *testing.T) {
	f := newFake()
	r := New(f, nil)
	j := newJournal()
	r.SetJournal(j)
	r.Create(alice, CreateOptions{Name: "s", Size: 10, Mode: 0o644, UseMode: true})
	for i := range maxHolders + 10 {
		c := bob
		c.Proc = Process{PID: 1000 + i, Start: 5}
		if _, err := r.Acquire(c, "s", true); err != nil {
			t.Fatal(err)
		}
	}
	rec := j.recs[r.mustID(t, "s")]
	if len(rec.Holders) != maxHolders || rec.Anon != 10 {
		t.Fatalf("record of a segment %d processes hold: %d holders, %d anonymous leases", maxHolders+10, len(rec.Holders), rec.Anon)
	}
	r2, _, _ := restart(t, f, j, time.Hour)
	if inf, _ := r2.Stat("s"); !inf.Doubt || inf.Opens != maxHolders {
		t.Fatalf("after a restart: doubt %v, opens %d; want in doubt, %d leases held", inf.Doubt, inf.Opens, maxHolders)
	}
}

// TestRetriedPullFindsItsSegment: MadeBy answers a pull sent again with
// the committed segment its first attempt made, and no one else: another
// user (root too) saying the same session and id, another request, or the
// same one before its commit learns nothing; a create with the pull's
// session and id does not get the pull's segment; a segment a create made
// is not taken for a pull's, whoever says its origin.
func TestRetriedPullFindsItsSegment(t *testing.T) {
	f := newFake()
	r := New(f, nil)
	s, _, err := r.Create(alice, CreateOptions{Name: "x", Size: 10, Open: true, Uncommitted: true, PulledBy: PullOrigin(alice, "sess/7")})
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := r.MadeBy(alice, "x", "sess/7"); ok {
		t.Fatal("an uncommitted segment was taken for its request's outcome")
	}
	// The pull's own client, on a connection of the same session, asks to
	// create the name with the pull's request id: the segment is not its.
	if got, _, err := r.Create(alice, CreateOptions{Name: "x", Size: 10, Open: true, Uncommitted: true, Origin: "sess/7"}); !errors.Is(err, ErrExist) {
		t.Fatalf("a create with the pull's origin = %v, %v; want ErrExist", got, err)
	}
	if err := r.Commit(alice, s, "", nil); err != nil {
		t.Fatal(err)
	}
	if got, _, err := r.Create(alice, CreateOptions{Name: "x", Size: 10, Open: true, Origin: "sess/7"}); !errors.Is(err, ErrExist) {
		t.Fatalf("a create with the pull's origin, committed = %v, %v; want ErrExist", got, err)
	}
	// Another user's create, saying root's session and id.
	if _, _, err := r.Create(eve, CreateOptions{Name: "y", Size: 10, Mode: 0o666, UseMode: true, Origin: "root-sess/3"}); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		who          Cred
		name, origin string
		want         bool
	}{
		{alice, "x", "sess/7", true},
		{Root, "x", "sess/7", false},
		{eve, "x", "sess/7", false},
		{alice, "x", "sess/8", false},
		{alice, "x", "", false},
		{alice, "z", "sess/7", false},
		{Root, "y", "root-sess/3", false},
	} {
		inf, ok := r.MadeBy(tc.who, tc.name, tc.origin)
		if ok != tc.want || ok && inf.ID != s.ID() {
			t.Errorf("MadeBy(uid %d, %q, %q) = %+v, %v; want %v", tc.who.UID, tc.name, tc.origin, inf.ID, ok, tc.want)
		}
	}
}
