package segment

import (
	"encoding/json"
	"fmt"
	"slices"
	"syscall"
	"time"
)

// Record is the durable state of one segment: everything a restarted daemon
// needs to serve it again, given its memory descriptor, and who holds
// leases on it (leases.go).
type Record struct {
	ID       uint64          `json:"id"`
	Name     string          `json:"name"`
	Linked   bool            `json:"linked"`
	Size     int64           `json:"size"`
	Alloc    int64           `json:"alloc,omitempty"` // 0: no memory (a file created empty)
	Device   int             `json:"device"`
	UID      uint32          `json:"uid"`
	GID      uint32          `json:"gid"`
	Mode     uint32          `json:"mode"`
	Meta     json.RawMessage `json:"meta,omitempty"`
	Created  int64           `json:"created"`  // Unix nanoseconds
	Modified int64           `json:"modified"` // Unix nanoseconds
	TTL      int64           `json:"ttl_ns,omitempty"`
	Idle     int64           `json:"idle,omitempty"` // Unix nanoseconds
	// InUse says a TTL segment was open or pinned when the record was
	// written: its idle clock was not running.
	InUse bool `json:"in_use,omitempty"`
	Bound bool `json:"bound,omitempty"`
	// Session is the creator's client session, for a bound segment: the
	// creator reclaims it by that after a restart.
	Session string `json:"session,omitempty"`
	// CreatorPID and CreatorStart name a bound segment's creator process
	// (see Process): a restarted daemon ends the segment when that process
	// has exited, and keeps it for as long as it lives. Absent: unknown.
	CreatorPID   int    `json:"creator_pid,omitempty"`
	CreatorStart uint64 `json:"creator_start,omitempty"`
	// Origin names the request that created the segment (session/id), so
	// that a client retrying a create whose reply it lost gets this one.
	Origin string `json:"origin,omitempty"`
	// PulledBy names the pull request that made it (uid:session/id), so
	// that the asker sending it again after a crash gets this one
	// (Registry.MadeBy). A field of its own: a create's Origin must never
	// match a pull's segment.
	PulledBy string `json:"pulled_by,omitempty"`
	// Orphan says why the daemon cannot serve the segment, if it cannot.
	Orphan string `json:"orphan,omitempty"`
	// Slots and SlotBytes describe a channel; its memory comes with a
	// control block's descriptor.
	Slots     int   `json:"slots,omitempty"`
	SlotBytes int64 `json:"slot_bytes,omitempty"`
	// Uncommitted: its creator had not committed it (commit.go). After a
	// restart it stays so, and goes with its creator as a Bound segment
	// does. CommitOrigin names the request that committed it, so that a
	// retried commit has the first one's outcome.
	Uncommitted  bool   `json:"uncommitted,omitempty"`
	CommitOrigin string `json:"commit_origin,omitempty"`
	// Version counts the segments the name has named (absent: 1); Next
	// marks a next version its writer had not made current (versions.go),
	// and Replaces, with it, is the ID of the segment it was made to
	// replace (0: the name named nothing). A next version recorded without
	// Replaces (by an older daemon) is bound at its restore to what its
	// name names then.
	Version  uint64  `json:"version,omitempty"`
	Next     bool    `json:"next,omitempty"`
	Replaces *uint64 `json:"replaces,omitempty"`
	// Tier is "host" for a segment evicted to host memory: its descriptor
	// is then a memfd, whatever the backend (tier.go). Pin keeps it on its
	// device; Published says its memory came from a client. LastOpen
	// (Unix nanoseconds) is when it was last opened as of the record.
	Tier      string `json:"tier,omitempty"`
	Pin       bool   `json:"pin,omitempty"`
	Published bool   `json:"published,omitempty"`
	LastOpen  int64  `json:"last_open,omitempty"`
	// Parts lists, in order, the parts of memory made of several
	// descriptors (Parted): the first is the record's own descriptor, each
	// other one a record's of its own, with PartOf naming this segment.
	// Such a record is no segment: a restart joins it to the one that
	// lists it, or frees it when none does (a crash between the two).
	Parts  []Part `json:"parts,omitempty"`
	PartOf uint64 `json:"part_of,omitempty"`
	// The disk tier (disk.go): Tier is "disk" for a segment whose bytes
	// are only on disk. Persist makes it durable; DiskCopy says a copy is
	// on disk, Stale that the segment was opened to be written since that
	// copy was made, Synced when it was made (Unix nanoseconds).
	Persist  bool  `json:"persist,omitempty"`
	DiskCopy bool  `json:"disk_copy,omitempty"`
	Stale    bool  `json:"stale,omitempty"`
	Synced   int64 `json:"synced,omitempty"`
	// Offer: the daemon offers the segment to its peers (peers.go).
	Offer bool `json:"offer,omitempty"`
	// Leases says the record carries the segment's leases: Holders, the
	// processes holding some and how many each, and Anon, those of
	// processes that could not be named. A record without it (an older
	// daemon's) may have any leases, which the grace period waits for.
	Leases  bool     `json:"leases,omitempty"`
	Holders []Holder `json:"holders,omitempty"`
	Anon    int      `json:"anon,omitempty"`
	// Sources are the ranges the daemon filled from files; Foreign says
	// someone but the owner and root could write it (sources.go).
	Foreign bool     `json:"foreign,omitempty"`
	Sources []Source `json:"sources,omitempty"`
}

// OnHost reports whether the record's memory is host memory it was
// evicted to.
func (rec *Record) OnHost() bool { return rec.Tier == OnHost.String() }

// Journal receives every change of state that must outlive the process:
// the server hands it to a process that keeps the descriptors (see
// internal/supervisor). The registry calls it with its mutex held, in the
// order the changes happen, before the operation that made the change
// returns; it must not call back into the registry.
type Journal interface {
	// Put records rec. fd >= 0 is the segment's memory, new or replaced:
	// the journal keeps its own duplicate; ctlFD, with it, a channel's
	// control block. fd < 0 leaves the memory as it was recorded, unless
	// rec.Alloc is 0: the segment has no memory now.
	Put(rec Record, fd, ctlFD int)
	// Delete forgets a segment whose memory was freed.
	Delete(id uint64)
	// Batch records, as one change, what one operation did to several
	// segments (a rename over an existing name, an exchange of two
	// names): a restarted daemon sees all of it or none of it, never a
	// state in between. No new descriptor travels in a batch.
	Batch(changes []Change)
}

// Part is one part of a segment's memory: the record that holds its
// descriptor, and its bytes.
type Part struct {
	ID   uint64 `json:"id"`
	Size int64  `json:"size"`
}

// Change is one part of a Batch: a segment's record as it is now, as Put
// takes it (with no new descriptor), or, with Gone, that segment
// Record.ID was freed, as Delete.
type Change struct {
	Record Record
	Gone   bool
}

// SetJournal makes the registry durable: from now on every change goes to
// j. Call it before the registry is used. With a journal, creates wait for
// the memory's descriptor (on cuda, the export), because an acknowledged
// segment must be held by whoever keeps the journal.
func (r *Registry) SetJournal(j Journal) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.journal = j
}

// Detach stops journaling, for a server that hands its state to a
// successor: the successor owns the journal from now on, and this
// registry's Close must free its own references without recording them as
// deletions.
func (r *Registry) Detach() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.journal = nil
}

// Replay puts every segment the journal holds to it again, in ID order,
// each with its memory's descriptor, and returns the highest ID ever given
// out: for a journal whose keeper was replaced by one that holds nothing
// yet (a new supervisor, after the old one died). The lock is held
// throughout, so the journal sees the state of one moment, and every
// change after that moment reaches it after the replay.
func (r *Registry) Replay() uint64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.journal == nil {
		return r.nextID
	}
	segs := make(map[uint64]*Segment, len(r.byID))
	for _, s := range r.byName {
		segs[s.id] = s
	}
	for id, s := range r.byID {
		segs[id] = s
	}
	ids := make([]uint64, 0, len(segs))
	for id, s := range segs {
		if s.saved && !s.gone {
			ids = append(ids, id)
		}
	}
	slices.Sort(ids)
	for _, id := range ids {
		s := segs[id]
		fd, ctl := -1, -1
		if s.mem != nil {
			// Journaled memory was exported before its first Put: FD does
			// not wait here.
			if f, err := journalFD(s.mem); err == nil {
				fd, ctl = f, controlFD(s.mem)
			}
		}
		if fd >= 0 {
			// Its parts, under the IDs they have: an eviction that ended
			// after the new keeper took over sent them to it already.
			r.putPartsLocked(s)
		}
		r.journal.Put(s.recordLocked(), fd, ctl)
	}
	return r.nextID
}

func (s *Segment) recordLocked() Record {
	rec := Record{
		ID: s.id, Name: s.name, Linked: s.linked, Size: s.size, Device: s.device,
		UID: s.uid, GID: s.gid, Mode: s.mode, Meta: s.meta,
		Created: s.created.UnixNano(), Modified: s.modified.UnixNano(),
		TTL: int64(s.ttl), Bound: s.bound, Session: s.session, Origin: s.origin, PulledBy: s.pulledBy, Orphan: s.orphan,
		Slots: s.slots, SlotBytes: s.slotBytes,
		Uncommitted: s.uncommitted, CommitOrigin: s.commitOrigin,
		Version: s.version, Next: s.next,
		Pin: s.resident, Published: s.published, LastOpen: s.lastOpen.UnixNano(),
		Sources: s.sources, Foreign: s.foreign,
	}
	if s.tier != OnDevice {
		rec.Tier = s.tier.String()
	}
	rec.Parts = s.parts
	rec.Persist, rec.DiskCopy, rec.Stale, rec.Offer = s.persist, s.onDisk, s.onDisk && !s.diskClean, s.offer
	if !s.synced.IsZero() {
		rec.Synced = s.synced.UnixNano()
	}
	if s.next {
		replaces := s.replaces
		rec.Replaces = &replaces
	}
	if s.bound || s.uncommitted {
		rec.CreatorPID, rec.CreatorStart = s.creator.PID, s.creator.Start
	}
	if s.mem != nil {
		rec.Alloc = s.mem.Size()
	}
	rec.Leases = true
	rec.Holders, rec.Anon = s.holdersLocked()
	if s.ttl > 0 {
		rec.Idle = s.idle.UnixNano()
		rec.InUse = s.opens+s.pins > 0 || s.wasInUse
	}
	return rec
}

// noteLocked tells the journal about s as it is now: a Put (with fd, when
// its memory is new) while it lives, a Delete once it is gone.
// Inside a batch (beginBatchLocked) the change is held for the batch.
// A durable segment's copy on disk gets the record too, where what a
// reboot serves of it changed (remetaLocked).
func (r *Registry) noteLocked(s *Segment, fd int) {
	r.remetaLocked(s)
	r.journalLocked(s, fd)
}

func (r *Registry) journalLocked(s *Segment, fd int) {
	if r.journal == nil {
		return
	}
	if s.gone {
		if s.saved {
			r.forgetLocked(s.id)
			s.saved = false
		}
		r.forgetPartsLocked(s)
		return
	}
	s.saved = true
	stale := s.parts
	if s.partsOf == s.mem && fd < 0 {
		stale = nil // the same memory: its parts stay as journaled
	} else {
		s.parts, s.partsOf = nil, nil
	}
	if r.batching {
		if fd >= 0 {
			// A batch is one control message, which carries no
			// descriptor: an operation that makes new memory must not
			// batch.
			panic("segment: new memory in a journal batch")
		}
		r.batch = append(r.batch, Change{Record: s.recordLocked()})
	} else {
		ctl := -1
		if fd >= 0 {
			ctl = controlFD(s.mem)
			r.putPartsLocked(s)
		}
		r.journal.Put(s.recordLocked(), fd, ctl)
	}
	// Parts of memory it no longer has go once its record no longer
	// names them: a crash in between leaves records that name nothing,
	// which a restart frees.
	for _, p := range stale[min(1, len(stale)):] { // the first is its own
		r.forgetLocked(p.ID)
	}
}

// forgetLocked journals that the record id is gone: a segment's, or a
// part's.
func (r *Registry) forgetLocked(id uint64) {
	if r.batching {
		r.batch = append(r.batch, Change{Record: Record{ID: id}, Gone: true})
	} else {
		r.journal.Delete(id)
	}
}

// beginBatchLocked starts holding the journal's changes, so that an
// operation that changes several segments records them as one
// (endBatchLocked). mu is held from begin to end.
func (r *Registry) beginBatchLocked() { r.batching = true }

// endBatchLocked sends the changes held since beginBatchLocked: one alone
// as itself, several as one Batch.
func (r *Registry) endBatchLocked() {
	cs := r.batch
	r.batching, r.batch = false, nil
	switch {
	case r.journal == nil || len(cs) == 0:
	case len(cs) > 1:
		r.journal.Batch(cs)
	case cs[0].Gone:
		r.journal.Delete(cs[0].Record.ID)
	default:
		r.journal.Put(cs[0].Record, -1, -1)
	}
}

// durableFD is mem's descriptor when a journal must receive it, else -1;
// it may wait for a background export, so call it without mu.
func (r *Registry) durableFD(mem Memory) (int, error) {
	r.mu.Lock()
	j := r.journal
	r.mu.Unlock()
	if j == nil || mem == nil {
		return -1, nil
	}
	return journalFD(mem)
}

// journalFD is mem's descriptor for the journal: one that stays
// resizable, where mem has one (Journaled).
func journalFD(mem Memory) (int, error) {
	if j, ok := mem.(Journaled); ok {
		return j.JournalFD()
	}
	return mem.FD()
}

// Restored is one segment handed back after a restart: its record and its
// memory, or why it cannot be served.
type Restored struct {
	Record Record
	// Memory is the segment's memory, owned by the registry from Restore
	// on; nil for a segment without memory, or one whose descriptor was
	// missing or not usable.
	Memory Memory
	// Problem, when not empty, makes the segment an orphan: listed, not
	// openable, removable.
	Problem string
	// Fresh says the journal does not hold the record yet (a durable
	// segment read back from disk after a reboot): Restore records it.
	Fresh bool
}

// ErrOrphan: the segment survived a restart in a state the daemon cannot
// serve (its descriptor is missing or of the wrong kind, its record is
// unreadable); it is kept, and reported, until removed.
var ErrOrphan = &Error{"segment is orphaned", syscall.EIO}

// Restore fills an empty registry with the segments of a daemon that
// stopped, and starts a grace period of the given length. The leases the
// records name are kept for their processes (restored, leases.go) until
// the server ends them (EndHolds) or their processes reclaim them
// (Reclaim). A segment whose record has anonymous leases, or none on
// record (an older daemon's), may also still be mapped by clients that
// have not reconnected yet: until the grace period ends it is not freed,
// resized or expired (if it was in use). nextID is the highest ID ever
// given out. It returns the names that became orphans.
func (r *Registry) Restore(items []Restored, nextID uint64, grace time.Duration) (orphans []string) {
	// Unnamed, with no lease on record and none in doubt: nothing keeps
	// them, and they are freed once the lock is dropped.
	type freed struct {
		s   *Segment
		mem Memory
	}
	var unheld []freed
	defer func() {
		for _, f := range unheld {
			f.s.free(f.mem)
		}
	}()
	r.mu.Lock()
	defer r.mu.Unlock()
	r.nextID = max(r.nextID, nextID)
	r.graceUntil = time.Now().Add(grace)
	var unbound []*Segment // next versions an older daemon recorded
	for _, it := range items {
		rec := it.Record
		r.nextID = max(r.nextID, rec.ID)
		if rec.PartOf != 0 {
			// A part no segment took (JoinParts): of memory its segment
			// no longer has, or of a segment whose record never named it.
			unheld = append(unheld, freed{&Segment{id: rec.ID}, r.strayPartLocked(it)})
			continue
		}
		problem, known := it.Problem, rec.Orphan != ""
		if problem == "" && known {
			problem = rec.Orphan
		}
		if problem == "" && rec.Alloc > 0 && it.Memory == nil {
			problem = "its memory descriptor is missing"
		}
		if problem == "" && !rec.Linked && it.Memory == nil {
			// Unnamed and without memory: nothing left to serve or free.
			if r.journal != nil {
				r.journal.Delete(rec.ID)
			}
			continue
		}
		if problem == "" && rec.Linked {
			if err := ValidName(rec.Name); err != nil {
				problem = err.Error()
			} else if r.byName[rec.Name] != nil {
				problem = fmt.Sprintf("another segment restored under the name %q", rec.Name)
			}
		}
		if !rec.Linked && it.Memory == nil {
			// Unnamed and without memory: nothing left to serve or free.
			if r.journal != nil {
				r.journal.Delete(rec.ID)
			}
			continue
		}
		s := &Segment{
			id: rec.ID, name: rec.Name, size: rec.Size, device: rec.Device,
			created: time.Unix(0, rec.Created), modified: time.Unix(0, rec.Modified),
			uid: rec.UID, gid: rec.GID, mode: rec.Mode & 0o777, meta: rec.Meta,
			linked: rec.Linked, mem: it.Memory, ready: closedChan,
			ttl: time.Duration(rec.TTL), idle: time.Unix(0, rec.Idle), bound: rec.Bound,
			session: rec.Session, creator: Process{PID: rec.CreatorPID, Start: rec.CreatorStart},
			origin: rec.Origin, pulledBy: rec.PulledBy, saved: true,
			slots: rec.Slots, slotBytes: rec.SlotBytes,
			doubt: !rec.Leases || rec.Anon > 0, wasInUse: rec.InUse && rec.TTL > 0 && (!rec.Leases || rec.Anon > 0),
			uncommitted: rec.Uncommitted, commitOrigin: rec.CommitOrigin,
			version: max(rec.Version, 1), next: rec.Next && rec.Uncommitted && !rec.Linked,
			resident: rec.Pin, published: rec.Published, lastOpen: time.Unix(0, rec.LastOpen),
			sources: slices.Clone(rec.Sources), foreign: rec.Foreign,
		}
		s.restoreTier(&rec)
		if pm, ok := s.mem.(Parted); ok && len(rec.Parts) > 1 && len(pm.Parts()) == len(rec.Parts) {
			s.parts, s.partsOf = slices.Clone(rec.Parts), s.mem
		}
		if rec.Replaces != nil {
			s.replaces = *rec.Replaces
		}
		r.restoreLeases(s, &rec)
		if rec.LastOpen == 0 {
			s.lastOpen = s.created
		}
		if s.size > memSize(s.mem) {
			s.size = memSize(s.mem)
		}
		if problem != "" {
			s.orphan, s.bound, s.ttl, s.uncommitted, s.next = problem, false, 0, false, false
			if !known {
				// Newly orphaned: named for what it is, findable by ls. An
				// orphan already removed (unlinked) stays unnamed.
				if rec.Name != "" {
					s.orphan = fmt.Sprintf("%s (was %q)", problem, rec.Name)
				}
				s.name, s.linked = r.orphanName(rec.ID), true
			}
			if s.linked {
				if r.byName[s.name] != nil {
					s.name = r.orphanName(rec.ID)
				}
				orphans = append(orphans, s.name)
			}
		}
		if s.linked {
			r.byName[s.name] = s
		}
		if s.mem != nil {
			r.byID[s.id] = s
		}
		if s.next && rec.Replaces == nil {
			unbound = append(unbound, s)
		}
		if problem != "" || rec.Size != s.size || it.Fresh {
			r.noteLocked(s, -1)
		}
		if mem := r.detachLocked(s); mem != nil {
			unheld = append(unheld, freed{s, mem})
		}
	}
	r.bindRestoredLocked(unbound)
	return orphans
}

// bindRestoredLocked binds the next versions an older daemon recorded,
// which say nothing of what they replace, to what their names name now
// (all that can be known), and journals them so: a commit replaces that,
// or nothing, whatever comes later (versions.go). mu is held.
func (r *Registry) bindRestoredLocked(unbound []*Segment) {
	for _, s := range unbound {
		if s.gone {
			continue
		}
		if cur := r.byName[s.name]; cur != nil {
			s.replaces = cur.id
		}
		r.noteLocked(s, -1)
	}
}

var closedChan = func() chan struct{} { c := make(chan struct{}); close(c); return c }()

// orphanName is a name for an orphan that no segment has.
func (r *Registry) orphanName(id uint64) string {
	name := fmt.Sprintf("orphaned-%d", id)
	for r.byName[name] != nil {
		name += "~"
	}
	return name
}

// GraceLeft is how long the grace period still runs (0 when over).
func (r *Registry) GraceLeft() time.Duration {
	r.mu.Lock()
	defer r.mu.Unlock()
	return max(time.Until(r.graceUntil), 0)
}

// EndGrace ends the grace period: restored segments that nobody reclaimed
// are treated as unopened from now on (unlinked ones are freed; a TTL
// segment that was in use starts its idle clock now).
func (r *Registry) EndGrace() {
	type freed struct {
		s   *Segment
		mem Memory
	}
	var mems []freed
	now := time.Now()
	r.mu.Lock()
	r.graceUntil = time.Time{}
	for _, s := range r.doubtful() {
		s.doubt = false
		if s.wasInUse || s.restoredAnon > 0 {
			// Anonymous leases not reclaimed by now have ended.
			s.restoredAnon = 0
			if s.wasInUse && s.opens+s.pins == 0 {
				s.idle = now
			}
			s.wasInUse = false
			r.noteLocked(s, -1)
		}
		if mem := r.detachLocked(s); mem != nil {
			mems = append(mems, freed{s, mem})
		}
	}
	r.mu.Unlock()
	for _, f := range mems {
		f.s.free(f.mem)
	}
}

// doubtful lists the segments still in doubt; mu is held.
func (r *Registry) doubtful() []*Segment {
	var out []*Segment
	for _, s := range r.byName {
		if s.doubt {
			out = append(out, s)
		}
	}
	for _, s := range r.byID {
		if s.doubt && !s.linked {
			out = append(out, s)
		}
	}
	return out
}

// Reclaim takes n leases on segment id, named or not, for a client that
// held them before the daemon restarted and still has the memory mapped.
// It checks the access asked for as Acquire does. No descriptor goes with
// it: the client has its mapping. Leases journaled for the client's
// process (c.Proc) become the ones it takes, rather than being added to.
func (r *Registry) Reclaim(c Cred, id uint64, n int, readOnly bool) (*Segment, error) {
	if n <= 0 {
		return nil, fmt.Errorf("reclaim %d leases: %w", n, syscall.EINVAL)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	s := r.byID[id]
	if s == nil || s.gone {
		return nil, fmt.Errorf("%w: id %d", ErrNotFound, id)
	}
	if s.orphan != "" {
		return nil, fmt.Errorf("%w: %q: %s", ErrOrphan, s.name, s.orphan)
	}
	want := uint32(Read | Write)
	if readOnly {
		want = Read
	}
	if !allowed(c, s, want) {
		return nil, fmt.Errorf("%w: reclaim of %q (mode %#o, owner %d:%d)", ErrPermission, s.name, s.mode, s.uid, s.gid)
	}
	if err := r.onDeviceLocked(s); err != nil {
		return nil, err
	}
	s.reclaimLocked(c, n)
	r.noteLocked(s, -1)
	return s, nil
}

// BoundSegment is a segment that ends with its creator, and who made it.
type BoundSegment struct {
	Segment *Segment
	Session string
	Creator Process
}

// Bound lists every segment that ends with its creator: creator-bound
// segments and uncommitted ones.
func (r *Registry) Bound() []BoundSegment {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []BoundSegment
	for _, s := range r.byName {
		if (s.bound || s.uncommitted) && !s.gone {
			out = append(out, BoundSegment{Segment: s, Session: s.session, Creator: s.creator})
		}
	}
	for _, s := range r.byID {
		// Next versions hold no name until committed (versions.go).
		if s.next && !s.linked && !s.gone {
			out = append(out, BoundSegment{Segment: s, Session: s.session, Creator: s.creator})
		}
	}
	return out
}

// Rebind records p as the creator of the bound segment s: the process
// whose connection it ends with now (a client that came back after a
// restart). It journals the change, so that the next restart waits for p.
func (r *Registry) Rebind(s *Segment, p Process) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !s.bound || s.gone || s.creator == p {
		return
	}
	s.creator = p
	r.noteLocked(s, -1)
}
