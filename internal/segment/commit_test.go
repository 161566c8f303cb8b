package segment

import (
	"encoding/json"
	"errors"
	"syscall"
	"testing"
	"time"
)

func TestCommit(t *testing.T) {
	f := newFake()
	r := New(f, nil)
	j := newJournal()
	r.SetJournal(j)
	s, created, err := r.Create(alice, CreateOptions{Name: "m", Size: 10, Mode: 0o644, UseMode: true, Open: true, Uncommitted: true, Session: "w"})
	if err != nil || !created {
		t.Fatalf("Create = %v, %v", created, err)
	}
	if inf := r.Info(s); !inf.Uncommitted {
		t.Fatalf("Info = %+v, want uncommitted", inf)
	}
	if rec := j.recs[s.ID()]; !rec.Uncommitted {
		t.Fatalf("journaled %+v, want uncommitted", rec)
	}
	if m := r.Bound(); len(m) != 1 || m[0].Segment != s || m[0].Session != "w" {
		t.Fatalf("Bound() = %v, want the uncommitted segment with its session", m)
	}
	if _, err := r.Acquire(bob, "m", true); !errors.Is(err, ErrUncommitted) || !errors.Is(err, syscall.EAGAIN) {
		t.Fatalf("Acquire = %v, want ErrUncommitted", err)
	}
	if err := r.Pin(alice, s, Read); !errors.Is(err, ErrUncommitted) {
		t.Fatalf("Pin = %v, want ErrUncommitted", err)
	}
	if err := r.Rename(alice, "m", "n", 0); !errors.Is(err, syscall.EBUSY) {
		t.Fatalf("Rename = %v, want EBUSY", err)
	}
	if _, _, err := r.Create(bob, CreateOptions{Name: "m", Size: 10, ExistOK: true}); !errors.Is(err, ErrUncommitted) {
		t.Fatalf("Create exist_ok = %v, want ErrUncommitted", err)
	}

	var w Watch
	got, changed, err := r.TryAcquire(bob, "m", true, &w)
	if got != nil || changed == nil || err != nil || !w.Seen() {
		t.Fatalf("TryAcquire = %v, %v, %v; want a wait", got, changed, err)
	}
	if err := r.Commit(alice, s, "w/7", nil); err != nil {
		t.Fatal(err)
	}
	select {
	case <-changed:
	case <-time.After(10 * time.Second):
		t.Fatal("Commit did not wake the waiter")
	}
	if got, _, err := r.TryAcquire(bob, "m", true, &w); got != s || err != nil {
		t.Fatalf("TryAcquire after commit = %v, %v", got, err)
	}
	if rec := j.recs[s.ID()]; rec.Uncommitted || rec.CommitOrigin != "w/7" {
		t.Fatalf("journaled %+v after commit", rec)
	}
	if err := r.Commit(alice, s, "w/7", nil); err != nil {
		t.Fatalf("retried Commit = %v", err)
	}
	if err := r.Commit(alice, s, "w/8", nil); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("second Commit = %v, want EINVAL", err)
	}
	if m := r.Bound(); len(m) != 0 {
		t.Fatalf("Bound() after commit = %v", m)
	}
}

func TestWatchEnds(t *testing.T) {
	f := newFake()
	r := New(f, nil)
	// No such name: wait, and wake when one is made.
	var w Watch
	_, changed, err := r.TryAcquire(bob, "x", true, &w)
	if err != nil || w.Seen() {
		t.Fatal(err)
	}
	s, _, err := r.Create(alice, CreateOptions{Name: "x", Size: 10, Mode: 0o600, UseMode: true, Open: true, Uncommitted: true})
	if err != nil {
		t.Fatal(err)
	}
	<-changed
	// Not readable by bob: no use waiting.
	if _, _, err := r.TryAcquire(bob, "x", true, &w); !errors.Is(err, ErrPermission) {
		t.Fatalf("TryAcquire without permission = %v", err)
	}
	r.SetMode(alice, s, 0o644)
	if _, changed, err = r.TryAcquire(bob, "x", true, &w); err != nil || !w.Seen() {
		t.Fatal(err)
	}
	// The writer gives up: the wait ends with ErrNotFound.
	if err := r.Discard(s); err != nil {
		t.Fatal(err)
	}
	<-changed
	if _, _, err := r.TryAcquire(bob, "x", true, &w); !errors.Is(err, ErrNotFound) {
		t.Fatalf("TryAcquire after the writer went = %v, want ErrNotFound", err)
	}
	// Commit after the name went, or was taken.
	if err := r.Commit(alice, s, "", nil); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Commit of a removed segment = %v", err)
	}
	r.Release(s)
	s2, _, _ := r.Create(alice, CreateOptions{Name: "y", Size: 10, Open: true, Uncommitted: true})
	r.Unlink(alice, "y")
	r.Create(alice, CreateOptions{Name: "y", Size: 10})
	if err := r.Commit(alice, s2, "", nil); !errors.Is(err, ErrExist) {
		t.Fatalf("Commit over a taken name = %v, want ErrExist", err)
	}
}

func TestRestoreUncommitted(t *testing.T) {
	f := newFake()
	r := New(f, nil)
	j := newJournal()
	r.SetJournal(j)
	r.Create(alice, CreateOptions{Name: "half", Size: 10, Open: true, Uncommitted: true, Session: "w"})
	done, _, _ := r.Create(alice, CreateOptions{Name: "whole", Size: 10, Open: true, Uncommitted: true, Session: "w"})
	if err := r.Commit(alice, done, "w/2", json.RawMessage(`{"origin":`)); !errors.Is(err, ErrBadMeta) || !r.Info(done).Uncommitted {
		t.Fatalf("Commit with meta that is not JSON = %v, uncommitted %v; want ErrBadMeta, still uncommitted", err, r.Info(done).Uncommitted)
	}
	// The meta a commit carries is journaled with it.
	if err := r.Commit(alice, done, "w/2", json.RawMessage(`{"origin":{"dir":"/m"}}`)); err != nil {
		t.Fatal(err)
	}
	r2, _, _ := restart(t, f, j, time.Hour)
	if inf, err := r2.Stat("half"); err != nil || !inf.Uncommitted {
		t.Fatalf("restored half = %+v, %v", inf, err)
	}
	if _, err := r2.Acquire(bob, "half", true); !errors.Is(err, ErrUncommitted) {
		t.Fatalf("Acquire of a restored uncommitted segment = %v", err)
	}
	if inf, err := r2.Stat("whole"); err != nil || inf.Uncommitted || string(inf.Meta) != `{"origin":{"dir":"/m"}}` {
		t.Fatalf("restored whole = %+v, %v; want committed with the commit's meta", inf, err)
	}
	bound := r2.Bound()
	if len(bound) != 1 {
		t.Fatalf("Bound() after restore = %v, want the uncommitted one", bound)
	}
	seg, _, _ := r2.Lookup("whole")
	if err := r2.Commit(alice, seg, "w/2", nil); err != nil {
		t.Fatalf("a commit retried after the restart = %v", err)
	}
}
