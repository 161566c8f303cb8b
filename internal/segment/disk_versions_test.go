package segment

import (
	"errors"
	"testing"
)

// commitNext makes and commits a next version of name, the registry's
// writes to disk held by the hooks the caller set.
func commitNext(t *testing.T, r *Registry, name string) *Segment {
	t.Helper()
	s, _, err := r.Create(alice, CreateOptions{Name: name, Size: page, Open: true, Uncommitted: true, NextVersion: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Commit(alice, s, "", nil); err != nil {
		t.Fatal(err)
	}
	return s
}

// TestDiskNextVersionWhileHeld: a durable version held open when a next
// version replaces it keeps a copy that names it until the next version is
// on disk: a reboot in between finds the name.
func TestDiskNextVersionWhileHeld(t *testing.T) {
	r, d := newDiskRegistry(t)
	v1 := createDurable(t, r, "x")
	if _, err := r.Acquire(alice, "x", true); err != nil {
		t.Fatal(err)
	}
	r.background.Wait()
	held := make(chan struct{})
	d.setHooks(func(string) { <-held }, nil) // the next version's write waits
	v2 := commitNext(t, r, "x")
	r.Release(v2)
	if rec, ok := d.record(t, DiskKey(v1.id)); !ok || !rec.Linked || rec.Name != "x" {
		t.Fatalf("version 1's copy while version 2 is not on disk: %v, %+v; want it naming x", ok, rec)
	}
	close(held)
	d.setHooks(nil, nil)
	r.background.Wait()
	if rec, ok := d.record(t, DiskKey(v2.id)); !ok || rec.Version != 2 {
		t.Fatalf("version 2's copy: %v, %+v", ok, rec)
	}
	if err := r.Release(v1); err != nil {
		t.Fatal(err)
	}
	r.background.Wait()
	if _, ok := d.record(t, DiskKey(v1.id)); ok {
		t.Fatal("version 1's copy is left once version 2 is on disk and nobody holds version 1")
	}
}

// TestDiskNextVersionsUnwritten: a version whose write failed, replaced by
// another before that one is on disk, hands the copy of the last version
// that reached disk on: it goes only once the newest one is there.
func TestDiskNextVersionsUnwritten(t *testing.T) {
	r, d := newDiskRegistry(t)
	v1 := createDurable(t, r, "x")
	r.background.Wait()
	fail := errors.New("no space")
	d.setWriteErr(fail)
	v2 := commitNext(t, r, "x")
	r.Release(v2)
	r.background.Wait()
	if _, ok := d.record(t, DiskKey(v2.id)); ok {
		t.Fatal("version 2 on disk though its write failed")
	}
	held := make(chan struct{})
	d.setWriteErr(nil)
	d.setHooks(func(string) { <-held }, nil)
	v3 := commitNext(t, r, "x")
	r.Release(v3)
	if rec, ok := d.record(t, DiskKey(v1.id)); !ok || rec.Name != "x" {
		t.Fatalf("version 1's copy while neither 2 nor 3 is on disk: %v, %+v; want it kept", ok, rec)
	}
	close(held)
	d.setHooks(nil, nil)
	r.background.Wait()
	if _, ok := d.record(t, DiskKey(v1.id)); ok {
		t.Fatal("version 1's copy left after version 3 reached disk")
	}
	if rec, ok := d.record(t, DiskKey(v3.id)); !ok || rec.Version != 3 {
		t.Fatalf("version 3's copy: %v, %+v", ok, rec)
	}
}

// TestDiskNextVersionRemoved: a durable next version removed before it is
// on disk, its predecessor held open: the predecessor's copy stops naming
// the name, which must not come back after a reboot.
func TestDiskNextVersionRemoved(t *testing.T) {
	r, d := newDiskRegistry(t)
	v1 := createDurable(t, r, "x")
	if _, err := r.Acquire(alice, "x", true); err != nil {
		t.Fatal(err)
	}
	r.background.Wait()
	held := make(chan struct{})
	d.setHooks(func(string) { <-held }, nil)
	v2 := commitNext(t, r, "x")
	r.Release(v2)
	d.setHooks(nil, nil)
	if err := r.Unlink(alice, "x"); err != nil {
		t.Fatal(err)
	}
	close(held)
	r.background.Wait()
	if rec, ok := d.record(t, DiskKey(v1.id)); ok && rec.Linked {
		t.Fatalf("version 1's copy names x after x was removed: %+v", rec)
	}
	r.Release(v1)
}
