package segment

import (
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"syscall"
	"time"
)

// The disk tier, and durable segments. A registry with a Disk (Tiers.Disk)
// moves segments GPU → host → disk: an eviction that finds the host budget
// full first moves the least recently opened segment on host to disk (or,
// without a host budget, the segment itself), and `evict --to disk` moves
// one there at once. A segment on disk holds a diskMemory, which has no
// descriptor: an open brings it back to its device directly (Disk.Read
// into new device memory), never through a second host copy.
//
// A durable segment (persist) also keeps a copy on disk while it is in
// memory: written in the background after its commit, and again by Sync.
// Its copy carries its record (Record.Persist), so that a daemon started
// after a reboot lists it again (durable.go in internal/daemon) and its
// first open restores it. A segment that is not durable is never listed
// after a reboot: its copy on disk, if it was evicted there, is removed.
//
// Every copy's key is the segment's ID (DiskKey), which a next version does
// not share: the copy of the version a durable next version replaces is
// removed only once the new one is on disk, so that a reboot at any moment
// finds one whole version of the name.

// Disk keeps copies of segments' bytes in files (internal/disk, through
// the daemon). Write and Read run without the registry's lock.
type Disk interface {
	// Write stores the first size bytes of src (a Memory implementing
	// Data) under key with meta, replacing any copy of key only once the
	// new one is whole.
	Write(key string, src Memory, size int64, meta []byte) error
	// Read fills the first size bytes of dst from key's copy, every chunk
	// checked; an error names the key and the file.
	Read(key string, dst Memory, size int64) error
	// Remove removes key's copy; none is no error.
	Remove(key string) error
	// SetMeta replaces the meta of key's copy, its bytes left as they
	// are: the segment's record changed (its mode, owner, name, meta) or
	// its bytes may have changed since the copy was made (stale).
	SetMeta(key string, meta []byte) error
	// Usage is the bytes the copies take and the budget (0: none).
	Usage() (used, budget int64)
}

// DiskKey is the key of segment id's copies on disk.
func DiskKey(id uint64) string { return strconv.FormatUint(id, 10) }

// OnDisk marks a segment whose bytes are only on disk.
const OnDisk Tier = 2

// diskMemory stands for the bytes of a segment on disk: it has no
// descriptor, and freeing it leaves the copy, which the registry removes
// when the segment goes.
type diskMemory struct{ size int64 }

func (m *diskMemory) FD() (int, error) {
	return -1, fmt.Errorf("%w: its bytes are on disk", ErrNoData)
}
func (m *diskMemory) Size() int64 { return m.size }
func (m *diskMemory) Free() error { return nil }

// DiskMemory is the memory of a segment restored on disk (after a restart
// or a reboot): size bytes with no descriptor.
func DiskMemory(size int64) Memory { return &diskMemory{size: size} }

func onDisk(m Memory) bool {
	_, ok := m.(*diskMemory)
	return ok
}

// ErrNoDisk: the daemon has no disk tier.
var ErrNoDisk = &Error{"no disk tier (start the daemon with --disk DIR)", syscall.EOPNOTSUPP}

// diskRecordLocked is the record a durable copy carries: what a daemon
// started after a reboot serves again, the copy written at synced, stale
// if the segment may have changed since. Leases and the creator's process
// do not outlive a reboot.
// fp is its durablePrint, for s.diskFP once the record is on disk: not
// before, since a write that fails, or that another write of the key
// overtakes, leaves the disk with an older record.
func (s *Segment) diskRecordLocked(synced time.Time, stale bool) (meta []byte, fp string) {
	rec := s.recordLocked()
	rec.Tier, rec.Holders, rec.Anon, rec.Leases = OnDisk.String(), nil, 0, true
	rec.Bound, rec.Session, rec.CreatorPID, rec.CreatorStart = false, "", 0, 0
	rec.DiskCopy, rec.Stale, rec.Synced = true, stale, synced.UnixNano()
	// A TTL's idle clock starts again when a daemon reads it back.
	rec.LastOpen, rec.Idle, rec.InUse = 0, 0, false
	if stale {
		// The files it records filling may be of writes after the copy
		// was made: the bytes on disk are not known to be theirs
		// (docs/security.md, "Files served from bundles").
		rec.Sources = nil
	}
	b, _ := json.Marshal(rec)
	return b, durablePrint(&rec)
}

// durablePrint is what of a durable copy's record a change must be
// written for.
func durablePrint(rec *Record) string {
	return fmt.Sprintf("%q %d %d %o %s %d %t %t", rec.Name, rec.UID, rec.GID, rec.Mode, rec.Meta, rec.Version, rec.Stale, rec.Linked)
}

// remetaLocked writes s's record to its copy on disk again, in the
// background, if what a reboot would serve of it changed.
func (r *Registry) remetaLocked(s *Segment) {
	d := r.tiers.cfg.Disk
	if d == nil || !s.persist || !s.onDisk || s.gone {
		return
	}
	if !s.linked && waitsFor(s.heldBy) {
		// Replaced by a durable next version not on disk yet, and held
		// open: its copy keeps naming it, so that a reboot finds the name
		// (the newer version wins once both are on disk).
		return
	}
	rec := s.recordLocked()
	rec.Stale = !s.diskClean
	if durablePrint(&rec) == s.diskFP {
		return
	}
	r.background.Add(1)
	s.diskBeginLocked()
	go func() {
		defer r.background.Done()
		// One at a time, each with the record as it is when it runs, so
		// that the last one written is the newest.
		r.remeta.Lock()
		defer r.remeta.Unlock()
		r.mu.Lock()
		defer r.mu.Unlock()
		defer s.diskEndLocked()
		if s.gone || !s.onDisk {
			return
		}
		meta, fp := s.diskRecordLocked(s.synced, !s.diskClean)
		key, failed, name := DiskKey(s.id), r.tiers.cfg.Failed, s.name
		r.mu.Unlock()
		err := d.SetMeta(key, meta)
		r.mu.Lock()
		if err != nil {
			if failed != nil {
				failed("record", name, err)
			}
			return
		}
		s.diskFP = fp
	}()
}

// diskBeginLocked counts a background write of s's record, or removal of
// its copy, that those who change what a reboot would serve of s wait for
// (waitDisk).
func (s *Segment) diskBeginLocked() {
	if s.diskOps == 0 {
		s.diskIdle = make(chan struct{})
	}
	s.diskOps++
}

func (s *Segment) diskEndLocked() {
	if s.diskOps--; s.diskOps == 0 {
		close(s.diskIdle)
	}
}

// waitDisk waits, mu not held, until the background writes of the records
// of segs and removals of their copies are done: an unlink, a chmod or a
// chown of a durable segment returns once a reboot would no longer serve
// it as it was (its bytes back after rm, a mode it no longer has).
func (r *Registry) waitDisk(segs ...*Segment) {
	var idle []chan struct{}
	r.mu.Lock()
	for _, s := range segs {
		if s != nil && s.diskOps > 0 {
			idle = append(idle, s.diskIdle)
		}
	}
	r.mu.Unlock()
	for _, c := range idle {
		<-c
	}
}

// removeDiskLater removes the copy of key off the caller's path; of, if
// not nil, is the segment the copy is of (waitDisk waits for it).
func (r *Registry) removeDiskLater(of *Segment, key string) {
	d := r.tiers.cfg.Disk
	if d == nil {
		return
	}
	r.background.Add(1)
	if of != nil {
		of.diskBeginLocked()
	}
	go func() {
		defer r.background.Done()
		d.Remove(key)
		if of != nil {
			r.mu.Lock()
			of.diskEndLocked()
			r.mu.Unlock()
		}
	}()
}

// retireDiskLocked removes what s kept on disk, s being gone: its copy,
// unless a durable next version that replaced it is not on disk yet (then
// that version removes it once it is), and the copies of the versions it
// replaced that waited for its own.
func (r *Registry) retireDiskLocked(s *Segment) {
	h := s.heldBy
	if !waitsFor(h) {
		r.supersedeLocked(s)
	} else {
		// s never reached disk (its write failed, or had not run) and a
		// durable next version replaced it: the copies of the versions s
		// replaced stay until that one is on disk, the name's last whole
		// version meanwhile.
		h.supersedes = append(h.supersedes, s.supersedes...)
		s.supersedes = nil
	}
	if s.persist {
		// The versions s replaced that are still held kept naming the
		// name while s was not on disk (remetaLocked): their copies say
		// now that they are unnamed.
		for _, o := range r.byID {
			if o.heldBy == s && !o.gone {
				r.remetaLocked(o)
			}
		}
	}
	if !s.onDisk && s.tier != OnDisk {
		return
	}
	if waitsFor(h) {
		h.supersedes = append(h.supersedes, DiskKey(s.id))
		return
	}
	r.removeDiskLater(s, DiskKey(s.id))
}

// waitsFor says whether h, the durable next version that replaced a
// segment, is not on disk yet: the replaced segment's copy must stay, as
// it is, until it is.
func waitsFor(h *Segment) bool { return h != nil && !h.gone && h.persist && !h.onDisk }

// toDiskLocked moves s, on its device or on host, to disk: its bytes are
// written (unless its durable copy is current) and its memory freed. mu
// is held, and dropped while the bytes move.
func (r *Registry) toDiskLocked(s *Segment) error {
	if why := r.unmovableLocked(s); why != "" {
		return fmt.Errorf("%w: %q: %s", ErrPinned, s.name, why)
	}
	d := r.tiers.cfg.Disk
	if d == nil {
		return ErrNoDisk
	}
	if s.tier == OnDisk {
		return nil
	}
	done := make(chan struct{})
	s.moving, s.copying = done, true
	defer func() {
		s.moving, s.copying = nil, false
		close(done)
	}()
	current := s.onDisk && s.diskClean
	synced := time.Now()
	var (
		meta []byte
		fp   string
	)
	if s.persist {
		meta, fp = s.diskRecordLocked(synced, false)
	}
	r.mu.Unlock()
	start := time.Now()
	s.io.Lock()
	old, size := s.mem, memSize(s.mem)
	var err error
	if !current {
		err = d.Write(DiskKey(s.id), old, size, meta)
	}
	s.io.Unlock()
	r.mu.Lock()
	if err != nil {
		return fmt.Errorf("write %q (%s) to disk: %w", s.name, fmtBytes(size), err)
	}
	if s.gone || s.mem != old {
		r.removeDiskLater(s, DiskKey(s.id))
		return fmt.Errorf("%w: %q was removed while it moved", ErrNotFound, s.name)
	}
	was := s.tier
	s.mem, s.tier, s.onDisk, s.diskClean = &diskMemory{size: size}, OnDisk, true, true
	if !current {
		// The copy has the record as it was when the write began: a
		// change meanwhile (noteLocked below) is written again.
		s.synced, s.diskFP = synced, fp
	}
	if s.clean != nil {
		r.dirtyLocked(s)
	}
	r.noteLocked(s, -1)
	r.tiers.stats.DiskWrites++
	r.tiers.stats.DiskWrittenBytes += size
	observe, syncer := r.tiers.cfg.Observe, r.journal
	r.mu.Unlock()
	ferr := s.free(old)
	if sy, ok := syncer.(Syncer); ok && was == OnDevice {
		// As an eviction to host: the keeper lets go of the device
		// memory when it applies the record.
		sy.Sync(time.Second)
	}
	if observe != nil {
		observe("evict-disk", s.name, size, time.Since(start))
	}
	r.mu.Lock()
	return ferr
}

// diskRoomLocked makes room for need bytes under the host budget by moving
// the least recently opened segments on host to disk, and reports whether
// they fit. mu is held, and dropped while segments move.
func (r *Registry) diskRoomLocked(need int64) bool {
	for !r.hostRoomLocked(need) {
		if r.tiers.cfg.Disk == nil {
			return false
		}
		v := r.oldestLocked(func(s *Segment) bool { return s.tier == OnHost && r.unmovableLocked(s) == "" })
		if v == nil {
			return false
		}
		if err := r.toDiskLocked(v); err != nil && !errors.Is(err, ErrNotFound) {
			return false
		}
	}
	return true
}

func (r *Registry) hasDisk() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.tiers.cfg.Disk != nil
}

// SyncDisk writes the named durable segment's bytes to disk now, as they are
// (writes through a mapping while it runs may or may not be in the copy),
// and returns once they are durable. The owner or root may.
func (r *Registry) SyncDisk(c Cred, name string) (Info, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	s, err := r.findOwned(c, name)
	if err != nil {
		return Info{}, err
	}
	if !s.persist {
		return Info{}, fmt.Errorf("%w: %q is not durable (create or put it with --persist)", ErrBadOption, name)
	}
	if err := r.syncLocked(s); err != nil {
		return Info{}, err
	}
	return r.infoLocked(s), nil
}

// syncLater writes durable s to disk in the background, after its commit.
func (r *Registry) syncLater(s *Segment) {
	r.background.Add(1)
	go func() {
		defer r.background.Done()
		r.mu.Lock()
		err := r.syncLocked(s)
		failed := r.tiers.cfg.Failed
		name := s.name
		r.mu.Unlock()
		if err != nil && failed != nil && !errors.Is(err, ErrNotFound) {
			failed("sync", name, err)
		}
	}()
}

// syncLocked writes s's bytes to its copy on disk, unless the copy is
// current. mu is held, and dropped while the bytes move; s is pinned
// meanwhile, so it neither moves nor goes.
func (r *Registry) syncLocked(s *Segment) error {
	for s.moving != nil {
		r.waitLocked(s.moving)
	}
	switch {
	case s.gone || r.closed:
		return fmt.Errorf("%w: %q was removed", ErrNotFound, s.name)
	case s.onDisk && s.diskClean:
		r.supersedeLocked(s)
		return nil
	case s.mem == nil:
		return fmt.Errorf("%w: %q has no memory", ErrEmpty, s.name)
	case s.uncommitted:
		return uncommittedError(s)
	}
	d := r.tiers.cfg.Disk
	if d == nil {
		return ErrNoDisk
	}
	s.pins++
	s.diskClean = true // a writable open meanwhile makes it false again
	start := time.Now()
	meta, fp := s.diskRecordLocked(start, false)
	mem, size, name := s.mem, memSize(s.mem), s.name
	observe := r.tiers.cfg.Observe
	r.mu.Unlock()
	s.io.RLock()
	err := d.Write(DiskKey(s.id), mem, size, meta)
	s.io.RUnlock()
	if err == nil && observe != nil {
		observe("sync", name, size, time.Since(start))
	}
	r.mu.Lock()
	s.pins--
	if err != nil {
		s.diskClean = false
		r.detachLater(s)
		return fmt.Errorf("write %q (%s) to disk: %w", name, fmtBytes(size), err)
	}
	// The copy has the record as it was when the write began. A change of
	// record written meanwhile (remetaLocked) may have gone to the copy
	// this one replaced, before this write took the key: noteLocked below
	// writes the record again if it is not fp.
	s.onDisk, s.synced, s.diskFP = true, start, fp
	r.tiers.stats.DiskWrites++
	r.tiers.stats.DiskWrittenBytes += size
	// Opened to be written while the copy was made (it may hold some of
	// those writes, or none), renamed, chmod'ed: noteLocked writes the
	// record again (remetaLocked).
	r.noteLocked(s, -1)
	r.supersedeLocked(s)
	r.detachLater(s)
	return nil
}

// supersedeLocked removes the copies of the versions s replaced, s's own
// being on disk now.
func (r *Registry) supersedeLocked(s *Segment) {
	for _, k := range s.supersedes {
		r.removeDiskLater(nil, k)
	}
	s.supersedes = nil
}

// detachLater retires s if it went while pinned (detachLocked), freeing
// its memory off the caller's path.
func (r *Registry) detachLater(s *Segment) {
	if mem := r.detachLocked(s); mem != nil {
		r.background.Add(1)
		go func() {
			defer r.background.Done()
			s.free(mem)
		}()
	}
}

// writtenLocked notes that s may be written now (a writable open, a write
// of the daemon's own): its clean host copy goes, and its copy on disk,
// if current, is marked older than its bytes.
func (r *Registry) writtenLocked(s *Segment) {
	r.dirtyLocked(s)
	// diskClean without onDisk is a first sync in flight (syncLocked): the
	// copy it makes is stale too once made, since writes after it may not
	// be in it.
	if s.diskClean && s.tier == OnDevice && !s.gone {
		s.diskClean = false
		r.noteLocked(s, -1) // and its copy's record says so (remetaLocked)
	}
}

// DiskKeys are the keys of every copy on disk a segment of the registry
// holds (its own, and those of versions it replaced that wait for it).
func (r *Registry) DiskKeys() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var keys []string
	add := func(s *Segment) {
		if s.onDisk || s.tier == OnDisk {
			keys = append(keys, DiskKey(s.id))
		}
		keys = append(keys, s.supersedes...)
	}
	for _, s := range r.byID {
		add(s)
	}
	for _, s := range r.byName {
		if r.byID[s.id] != s {
			add(s)
		}
	}
	return keys
}

// AdoptCopy hands key, a durable copy of an earlier version of name found
// on disk after a restart, to name's current segment if that one is durable
// and its own copy is not on disk yet: it removes the old copy once its own
// is there (ResyncDurable). It reports whether it took it.
func (r *Registry) AdoptCopy(name, key string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	s := r.byName[name]
	if s == nil || !s.persist || s.onDisk || DiskKey(s.id) == key {
		return false
	}
	s.supersedes = append(s.supersedes, key)
	return true
}

// ResyncDurable writes to disk, in the background, every durable segment
// whose copy is not there (its write was lost with a serving process).
func (r *Registry) ResyncDurable() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.tiers.cfg.Disk == nil {
		return
	}
	for _, s := range r.byName {
		if s.persist && !s.onDisk && !s.uncommitted && s.mem != nil && s.orphan == "" {
			r.syncLater(s)
		}
	}
}

// restoreTier sets what rec says of where s's bytes are.
func (s *Segment) restoreTier(rec *Record) {
	switch rec.Tier {
	case OnHost.String():
		s.tier = OnHost
	case OnDisk.String():
		s.tier = OnDisk
	}
	s.persist, s.onDisk, s.offer = rec.Persist, rec.DiskCopy || s.tier == OnDisk, rec.Offer
	s.diskClean = s.onDisk && !rec.Stale
	if rec.Synced != 0 {
		s.synced = time.Unix(0, rec.Synced)
	}
}
