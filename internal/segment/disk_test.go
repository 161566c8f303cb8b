package segment

import (
	"encoding/json"
	"errors"
	"io/fs"
	"sync"
	"testing"
	"time"
)

// fakeDisk is a disk tier in memory that keeps each copy's record, and
// runs the writes of one key one after the other, as internal/disk does.
// Hooks let a test hold a write before it takes its key (the moment
// between the registry letting go of its lock and the store taking the
// key) and a removal before it removes.
type fakeDisk struct {
	mu     sync.Mutex
	keys   map[string]*sync.Mutex
	copies map[string][]byte // each key's record
	// beforeWrite, if set, is called by Write before it takes its key;
	// beforeRemove by Remove before it removes.
	beforeWrite  func(key string)
	beforeRemove func(key string)
	// writeErr, if set, fails every Write.
	writeErr error
}

func newFakeDisk() *fakeDisk {
	return &fakeDisk{keys: map[string]*sync.Mutex{}, copies: map[string][]byte{}}
}

func (d *fakeDisk) lock(key string) func() {
	d.mu.Lock()
	k := d.keys[key]
	if k == nil {
		k = &sync.Mutex{}
		d.keys[key] = k
	}
	d.mu.Unlock()
	k.Lock()
	return k.Unlock
}

func (d *fakeDisk) hook(f func(*fakeDisk) func(string), key string) {
	d.mu.Lock()
	h := f(d)
	d.mu.Unlock()
	if h != nil {
		h(key)
	}
}

func (d *fakeDisk) Write(key string, _ Memory, _ int64, meta []byte) error {
	d.hook(func(d *fakeDisk) func(string) { return d.beforeWrite }, key)
	defer d.lock(key)()
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.writeErr != nil {
		return d.writeErr
	}
	d.copies[key] = append([]byte(nil), meta...)
	return nil
}

func (d *fakeDisk) setWriteErr(err error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.writeErr = err
}

func (d *fakeDisk) Read(key string, _ Memory, _ int64) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.copies[key] == nil {
		return fs.ErrNotExist
	}
	return nil
}

func (d *fakeDisk) Remove(key string) error {
	d.hook(func(d *fakeDisk) func(string) { return d.beforeRemove }, key)
	d.mu.Lock()
	defer d.mu.Unlock()
	delete(d.copies, key)
	return nil
}

func (d *fakeDisk) SetMeta(key string, meta []byte) error {
	defer d.lock(key)()
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.copies[key] == nil {
		return fs.ErrNotExist
	}
	d.copies[key] = append([]byte(nil), meta...)
	return nil
}

func (d *fakeDisk) Usage() (int64, int64) { return 0, 0 }

// record is the record of key's copy, and whether there is one.
func (d *fakeDisk) record(t *testing.T, key string) (Record, bool) {
	t.Helper()
	d.mu.Lock()
	defer d.mu.Unlock()
	b := d.copies[key]
	if b == nil {
		return Record{}, false
	}
	var rec Record
	if err := json.Unmarshal(b, &rec); err != nil {
		t.Fatal(err)
	}
	return rec, true
}

func (d *fakeDisk) setHooks(write, remove func(string)) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.beforeWrite, d.beforeRemove = write, remove
}

func newDiskRegistry(t *testing.T) (*Registry, *fakeDisk) {
	t.Helper()
	d := newFakeDisk()
	r := New(newDataAlloc(), nil)
	r.SetTiers(Tiers{HostBudget: 100 * page, Spill: newDataAlloc(), Mover: dataMover{}, Disk: d,
		Failed: func(op, name string, err error) { t.Logf("%s %s: %v", op, name, err) }})
	return r, d
}

// createDurable makes a durable segment of alice's, mode 0644, synced.
func createDurable(t *testing.T, r *Registry, name string) *Segment {
	t.Helper()
	s, _, err := r.Create(alice, CreateOptions{Name: name, Size: page, Persist: true, UseMode: true, Mode: 0o644})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.SyncDisk(alice, name); err != nil {
		t.Fatal(err)
	}
	return s
}

// TestDiskRecordChmodDuringSync: a chmod whose record reaches the disk
// while a sync of the segment is between the registry and the store (the
// record written to the copy the sync then replaces) is written again
// once the sync's copy is in: the copy a reboot reads has the new mode,
// not the wider one the sync began with.
func TestDiskRecordChmodDuringSync(t *testing.T) {
	r, d := newDiskRegistry(t)
	s := createDurable(t, r, "x")
	key := DiskKey(s.id)
	// A writable open makes the copy stale, so that sync writes again.
	if _, err := r.Acquire(alice, "x", false); err != nil {
		t.Fatal(err)
	}
	if err := r.Release(s); err != nil {
		t.Fatal(err)
	}
	r.background.Wait()
	entered, release := make(chan struct{}), make(chan struct{})
	d.setHooks(func(string) {
		close(entered)
		<-release
	}, nil)
	synced := make(chan error, 1)
	go func() {
		_, err := r.SyncDisk(alice, "x")
		synced <- err
	}()
	<-entered
	d.setHooks(nil, nil)
	if err := r.SetMode(alice, s, 0o600); err != nil {
		t.Fatal(err)
	}
	if rec, _ := d.record(t, key); rec.Mode != 0o600 {
		t.Fatalf("chmod returned with the copy's record at mode %#o", rec.Mode)
	}
	close(release)
	if err := <-synced; err != nil {
		t.Fatal(err)
	}
	r.background.Wait()
	rec, ok := d.record(t, key)
	if !ok || rec.Mode != 0o600 || rec.Stale {
		t.Fatalf("after the sync: copy %v, record mode %#o, stale %v; want mode 0600, not stale", ok, rec.Mode, rec.Stale)
	}
}

// TestDiskFirstSyncWritten: a writable open while a segment's first sync
// runs makes the copy stale, as one after it does: the writes it lets in
// may come after the bytes were copied.
func TestDiskFirstSyncWritten(t *testing.T) {
	r, d := newDiskRegistry(t)
	s, _, err := r.Create(alice, CreateOptions{Name: "x", Size: page, Persist: true})
	if err != nil {
		t.Fatal(err)
	}
	entered, release := make(chan struct{}), make(chan struct{})
	d.setHooks(func(string) {
		close(entered)
		<-release
	}, nil)
	synced := make(chan error, 1)
	go func() {
		_, err := r.SyncDisk(alice, "x")
		synced <- err
	}()
	<-entered
	if _, err := r.Acquire(alice, "x", false); err != nil {
		t.Fatal(err)
	}
	close(release)
	if err := <-synced; err != nil {
		t.Fatal(err)
	}
	r.background.Wait()
	if rec, ok := d.record(t, DiskKey(s.id)); !ok || !rec.Stale {
		t.Fatalf("copy %v, stale %v after a writable open during the first sync; want stale", ok, rec.Stale)
	}
	r.mu.Lock()
	inf := r.infoLocked(s)
	r.mu.Unlock()
	if !inf.Stale {
		t.Fatalf("stat says not stale after a writable open during the first sync")
	}
	r.Release(s)
}

// TestDiskUnlinkWaits: rm of a durable segment returns once its copy is
// gone, and rm of one held open once its record says it has no name: a
// reboot right after rm must not bring it back. chmod and chown return
// once the record has the new mode and owner.
func TestDiskUnlinkWaits(t *testing.T) {
	r, d := newDiskRegistry(t)
	slow := func(string) { time.Sleep(50 * time.Millisecond) }

	a := createDurable(t, r, "a")
	d.setHooks(nil, slow)
	if err := r.Unlink(alice, "a"); err != nil {
		t.Fatal(err)
	}
	if _, ok := d.record(t, DiskKey(a.id)); ok {
		t.Fatal("rm returned with the copy still on disk")
	}

	b := createDurable(t, r, "b")
	if _, err := r.Acquire(alice, "b", true); err != nil {
		t.Fatal(err)
	}
	r.background.Wait()
	if err := r.Unlink(alice, "b"); err != nil {
		t.Fatal(err)
	}
	if rec, ok := d.record(t, DiskKey(b.id)); ok && rec.Linked {
		t.Fatal("rm of an open segment returned with its copy's record still naming it")
	}
	r.Release(b)
	r.background.Wait()
	if _, ok := d.record(t, DiskKey(b.id)); ok {
		t.Fatal("the copy of a removed segment stays after its last close")
	}

	c := createDurable(t, r, "c")
	if err := r.SetOwner(Cred{}, c, 1001, 1001); err != nil {
		t.Fatal(err)
	}
	if rec, _ := d.record(t, DiskKey(c.id)); rec.UID != 1001 {
		t.Fatalf("chown returned with the copy's record at uid %d", rec.UID)
	}
	if err := r.Rename(Cred{}, "c", "d", 0); err != nil {
		t.Fatal(err)
	}
	if rec, _ := d.record(t, DiskKey(c.id)); rec.Name != "d" {
		t.Fatalf("rename returned with the copy's record at name %q", rec.Name)
	}
	if errors.Is(r.Unlink(Cred{}, "d"), ErrNotFound) {
		t.Fatal("d is gone")
	}
}
