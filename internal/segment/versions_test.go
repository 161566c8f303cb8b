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

	if err := r.Commit(alice, v2, "o/1", []byte(`{"v":2}`)); err != nil {
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
	if err := r.Commit(alice, v2, "o/1", nil); err != nil {
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
	if err := r.Commit(alice, first, "", nil); err != nil {
		t.Fatal(err)
	}
	if inf, err := r.Stat("new"); err != nil || inf.Version != 1 {
		t.Fatalf("first version made current: %+v, %v", inf, err)
	}
}

// TestNextVersionBound plays each order in which a next version could be
// committed over a segment it was not made to replace: the commit is
// refused, the name keeps what it names, and the version stays
// uncommitted and unnamed, for its writer to close.
func TestNextVersionBound(t *testing.T) {
	next := CreateOptions{Name: "v", Size: 10, Open: true, Uncommitted: true, NextVersion: true}
	own := func(r *Registry, c Cred) {
		if _, _, err := r.Create(c, CreateOptions{Name: "v", Size: 10, Mode: 0o644, UseMode: true}); err != nil {
			t.Fatal(err)
		}
	}
	do := func(err error) {
		if err != nil {
			t.Fatal(err)
		}
	}
	tests := []struct {
		name    string
		writer  Cred
		before  func(r *Registry) // the name before the next version is made
		between func(r *Registry) // after it is made, before its commit
		want    error             // nil: the commit makes it current
	}{
		{"nothing, then root creates it", bob, nil,
			func(r *Registry) { own(r, Root) }, ErrExist},
		{"own, unlinked, root creates it", bob, func(r *Registry) { own(r, bob) },
			func(r *Registry) { do(r.Unlink(bob, "v")); own(r, Root) }, ErrExist},
		{"own, renamed away, root creates it", bob, func(r *Registry) { own(r, bob) },
			func(r *Registry) { do(r.Rename(bob, "v", "w", 0)); own(r, Root) }, ErrExist},
		{"own, renamed away, root renames its own over it", bob, func(r *Registry) { own(r, bob) },
			func(r *Registry) {
				do(r.Rename(bob, "v", "w", 0))
				_, _, err := r.Create(Root, CreateOptions{Name: "x", Size: 10})
				do(err)
				do(r.Rename(Root, "x", "v", 0))
			}, ErrExist},
		{"own, given to root", bob, func(r *Registry) { own(r, bob) },
			func(r *Registry) { s, _, _ := r.Lookup("v"); do(r.SetOwner(Root, s, 0, 0)) }, ErrNotOwner},
		{"own, unlinked, the name free", bob, func(r *Registry) { own(r, bob) },
			func(r *Registry) { do(r.Unlink(bob, "v")) }, ErrNotFound},
		{"own, renamed away, the name free", bob, func(r *Registry) { own(r, bob) },
			func(r *Registry) { do(r.Rename(bob, "v", "w", 0)) }, ErrNotFound},
		{"root's of nothing, then a user creates it", Root, nil,
			func(r *Registry) { own(r, bob) }, ErrExist},
		{"another version made current first", alice, func(r *Registry) { own(r, alice) },
			func(r *Registry) {
				other, _, err := r.Create(alice, next)
				do(err)
				do(r.Commit(alice, other, "", nil))
			}, ErrExist},
		{"own, kept", bob, func(r *Registry) { own(r, bob) }, nil, nil},
		{"nothing, still nothing", bob, nil, nil, nil},
		{"own, renamed away and back", bob, func(r *Registry) { own(r, bob) },
			func(r *Registry) { do(r.Rename(bob, "v", "w", 0)); do(r.Rename(bob, "w", "v", 0)) }, nil},
		{"a user's, committed by root", Root, func(r *Registry) { own(r, bob) }, nil, nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			r := New(newFake(), nil)
			r.SetJournal(newJournal())
			if tc.before != nil {
				tc.before(r)
			}
			nv, _, err := r.Create(tc.writer, next)
			if err != nil {
				t.Fatal(err)
			}
			if tc.between != nil {
				tc.between(r)
			}
			was, wasErr := r.Stat("v")
			err = r.Commit(tc.writer, nv, "o/1", nil)
			if tc.want == nil {
				if err != nil {
					t.Fatalf("Commit = %v, want success", err)
				}
				if inf, err := r.Stat("v"); err != nil || inf.ID != nv.ID() {
					t.Fatalf("after the commit the name names %+v, %v; want %d", inf, err, nv.ID())
				}
				if err := r.Commit(tc.writer, nv, "o/1", nil); err != nil {
					t.Fatalf("retried commit = %v", err)
				}
				return
			}
			if !errors.Is(err, tc.want) {
				t.Fatalf("Commit = %v, want %v", err, tc.want)
			}
			if now, nowErr := r.Stat("v"); now.ID != was.ID || now.UID != was.UID || (nowErr == nil) != (wasErr == nil) {
				t.Fatalf("after a refused commit the name names %d (uid %d, %v), want %d (uid %d, %v)",
					now.ID, now.UID, nowErr, was.ID, was.UID, wasErr)
			}
			if inf := r.Info(nv); !inf.Uncommitted || !inf.Next || inf.Linked {
				t.Fatalf("the refused version: %+v", inf)
			}
		})
	}
}

// TestNextVersionBoundAcrossRestart: the binding is journaled, so a
// restart between the create and the commit changes nothing; a next
// version an older daemon recorded, without one, is bound to what its
// name names when it is restored.
func TestNextVersionBoundAcrossRestart(t *testing.T) {
	f := newFake()
	r := New(f, nil)
	j := newJournal()
	r.SetJournal(j)
	nv, _, err := r.Create(bob, CreateOptions{Name: "v", Size: 10, Open: true, Uncommitted: true, NextVersion: true})
	if err != nil {
		t.Fatal(err)
	}
	if rec := j.recs[nv.ID()]; rec.Replaces == nil || *rec.Replaces != 0 {
		t.Fatalf("next version of nothing journaled with replaces %v, want 0", rec.Replaces)
	}
	r2, _, _ := restart(t, f, j, time.Minute)
	if _, _, err := r2.Create(Root, CreateOptions{Name: "v", Size: 10}); err != nil {
		t.Fatal(err)
	}
	if err := r2.Commit(bob, r2.byID[nv.ID()], "", nil); !errors.Is(err, ErrExist) {
		t.Fatalf("commit after a restart over root's new segment = %v, want ErrExist", err)
	}

	// An older daemon's record.
	f = newFake()
	r = New(f, nil)
	j = newJournal()
	r.SetJournal(j)
	cur, _, err := r.Create(bob, CreateOptions{Name: "w", Size: 10})
	if err != nil {
		t.Fatal(err)
	}
	old, _, err := r.Create(bob, CreateOptions{Name: "w", Size: 10, Open: true, Uncommitted: true, NextVersion: true})
	if err != nil {
		t.Fatal(err)
	}
	rec := j.recs[old.ID()]
	rec.Replaces = nil
	j.recs[old.ID()] = rec
	r2, j2, _ := restart(t, f, j, time.Minute)
	if got := r2.byID[old.ID()].replaces; got != cur.ID() {
		t.Fatalf("an older daemon's next version restored bound to %d, want %d", got, cur.ID())
	}
	if rec := j2.recs[old.ID()]; rec.Replaces == nil || *rec.Replaces != cur.ID() {
		t.Fatalf("its binding journaled as %v, want %d", rec.Replaces, cur.ID())
	}
	if err := r2.Commit(bob, r2.byID[old.ID()], "", nil); err != nil {
		t.Fatal(err)
	}
}
