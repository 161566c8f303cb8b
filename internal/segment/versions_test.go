package segment

import (
	"errors"
	"syscall"
	"testing"
	"time"
)

func TestVersions(t *testing.T) {
	f := newFake()
	r := New(f, nil)
	j := newJournal()
	r.SetJournal(j)
	v1, _, err := r.Create(alice, CreateOptions{Name: "w", Size: 10, Mode: 0o644, UseMode: true})
	if err != nil {
		t.Fatal(err)
	}
	// A reader holds version 1 throughout.
	if _, err := r.Acquire(bob, "w", true); err != nil {
		t.Fatal(err)
	}
	next := CreateOptions{Name: "w", Size: 20, Open: true, Uncommitted: true, NextVersion: true}
	if _, _, err := r.Create(bob, next); !errors.Is(err, ErrNotOwner) {
		t.Fatalf("another user's next version = %v, want ErrNotOwner", err)
	}
	if _, _, err := r.Create(alice, CreateOptions{Name: "w", Size: 20, Open: true, NextVersion: true}); !errors.Is(err, ErrBadOption) {
		t.Fatalf("a next version not uncommitted = %v, want ErrBadOption", err)
	}
	v2, _, err := r.Create(alice, next)
	if err != nil {
		t.Fatal(err)
	}
	if inf, _ := r.Stat("w"); inf.ID != v1.ID() || inf.Version != 1 {
		t.Fatalf("before the commit the name names %+v, want version 1", inf)
	}
	if rec := j.recs[v2.ID()]; !rec.Next || rec.Linked || !rec.Uncommitted {
		t.Fatalf("next version journaled as %+v", rec)
	}
	_, ready, changed, err := r.WaitVersion("w", v1.ID())
	if ready || changed == nil || err != nil {
		t.Fatalf("WaitVersion before the commit = %v, %v", ready, err)
	}
	// A restart before the commit keeps both, the name on version 1.
	r2, _, _ := restart(t, f, j, time.Minute)
	if inf, _ := r2.Stat("w"); inf.ID != v1.ID() {
		t.Fatalf("after a restart the name names %d, want %d", inf.ID, v1.ID())
	}
	if s := r2.byID[v2.ID()]; s == nil || !s.next || !s.uncommitted {
		t.Fatalf("next version after a restart: %+v", s)
	}
	j.take()

	if err := r.Commit(v2, "o/1", []byte(`{"v":2}`)); err != nil {
		t.Fatal(err)
	}
	select {
	case <-changed:
	case <-time.After(10 * time.Second):
		t.Fatal("the commit did not wake WaitVersion")
	}
	if inf, ready, _, err := r.WaitVersion("w", v1.ID()); !ready || err != nil || inf.ID != v2.ID() || inf.Version != 2 {
		t.Fatalf("WaitVersion after the commit = %+v, %v, %v", inf, ready, err)
	}
	if got := j.take(); len(got) != 1 {
		t.Fatalf("making a version current journaled %v, want one change", got)
	}
	inf, _ := r.Stat("w")
	if inf.ID != v2.ID() || inf.Version != 2 || string(inf.Meta) != `{"v":2}` || len(inf.Versions) != 1 ||
		inf.Versions[0].ID != v1.ID() || inf.Versions[0].Opens != 1 {
		t.Fatalf("stat after the commit: %+v", inf)
	}
	if err := r.Commit(v2, "o/1", nil); err != nil {
		t.Fatalf("retried commit = %v", err)
	}
	// Version 1 goes with its last reader.
	live := len(f.live)
	if err := r.ReleaseBy(v1, bob); err != nil {
		t.Fatal(err)
	}
	if len(f.live) != live-1 || len(j.recs) != 1 {
		t.Fatalf("version 1 after its last reader: %d allocations (was %d), %d records", len(f.live), live, len(j.recs))
	}
	if rec := j.recs[v2.ID()]; rec.Version != 2 || rec.Next || !rec.Linked {
		t.Fatalf("version 2 journaled as %+v", rec)
	}
	// A writer that gives up leaves the current version.
	v3, _, err := r.Create(alice, next)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.ReleaseBy(v3, alice); err != nil {
		t.Fatal(err)
	}
	if inf, _ := r.Stat("w"); inf.ID != v2.ID() || len(f.live) != live-1 {
		t.Fatalf("after a next version was given up: %+v, %d allocations", inf, len(f.live))
	}
	// Channels have no versions; a name nobody has gets its first.
	if err := mayReplace(alice, &Segment{name: "c", uid: alice.UID, slots: 2}); !errors.Is(err, ErrBadOption) {
		t.Fatalf("next version of a channel = %v, want ErrBadOption", err)
	}
	first, _, err := r.Create(alice, CreateOptions{Name: "new", Size: 10, Open: true, Uncommitted: true, NextVersion: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.Stat("new"); !errors.Is(err, syscall.ENOENT) {
		t.Fatalf("an uncommitted first version is named: %v", err)
	}
	if err := r.Commit(first, "", nil); err != nil {
		t.Fatal(err)
	}
	if inf, err := r.Stat("new"); err != nil || inf.Version != 1 {
		t.Fatalf("first version made current: %+v, %v", inf, err)
	}
}
