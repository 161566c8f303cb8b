package segment

import (
	"encoding/json"
	"errors"
	"fmt"
	"time"
)

// CreateOptions describes a new segment.
type CreateOptions struct {
	Name   string
	Size   int64
	Device int
	Mode   uint32 // permission bits; DefaultMode when UseMode is false
	// UseMode says Mode was given; a mode of 0 is legal.
	UseMode bool
	Meta    json.RawMessage
	// ExistOK makes create open-or-create: when the name exists with the
	// same size and device, that segment is returned.
	ExistOK bool
	// Open acquires a lease on the returned segment, atomically with the
	// create, so no unlink can free it in between. ReadOnly asks for read
	// access only.
	Open     bool
	ReadOnly bool
	// AllowEmpty permits Size 0: the segment is named but holds no memory
	// until Resize or WriteAt gives it some (a file created empty through
	// the FUSE view). The socket protocol never sets it.
	AllowEmpty bool
	// Pin takes a pin (see Registry.Pin) on the new segment, atomically
	// with the create. With ExistOK, an existing segment is returned
	// unpinned and created reports false.
	Pin bool
	// TTL > 0 makes the segment expire once it has been unopened for TTL.
	TTL time.Duration
	// Bound records that the segment ends with its creator's connection;
	// ending it is the caller's (the server's) business.
	Bound bool
	// Memory, when set, is used instead of allocating: memory a client
	// published. Create owns it from the call on, and frees it on failure.
	Memory Memory
	// Session identifies the creating client across reconnections: a
	// bound segment's creator reclaims it by this after a restart.
	Session string
	// Creator is the creating process, journaled for a bound segment: a
	// restarted daemon keeps the segment while that process lives.
	Creator Process
	// Origin names the creating request (session and request id); a
	// create with the same Origin finds the segment it made, as created,
	// so that a retried request has the outcome of the first.
	Origin string
	// PulledBy, for a segment a pull makes, names the pull's request as
	// PullOrigin gives it: what MadeBy matches, and nothing else does.
	PulledBy string
	// Slots > 0 makes a channel (slots.go): Slots buffers of SlotBytes
	// each, and a control block that Control initializes.
	Slots     int
	SlotBytes int64
	Control   func(Memory) error
	// Uncommitted holds the name for a segment that only its creator may
	// open until Commit (commit.go); it ends with its creator as a Bound
	// segment does. It needs Open, and no ExistOK, Pin, Memory or Slots.
	Uncommitted bool
	// NextVersion makes the next version of the name (versions.go): an
	// uncommitted segment that takes no name until Commit makes it the
	// name's current version, in place of the one there. It needs
	// Uncommitted, and the right to remove the current version, whose
	// owner and (unless UseMode) mode it takes.
	NextVersion bool
	// Resident keeps the segment on its device: it is never evicted to
	// host memory (tier.go).
	Resident bool
	// Persist makes the segment durable (disk.go): its bytes go to disk
	// after its commit, and by Sync. It needs the registry's disk tier.
	Persist bool
	// Offer offers the segment to the daemon's peers (peers.go).
	Offer bool
	// Trace, when set, times the steps of the create: check (validation,
	// the name, limits), alloc or alloc-pool, export (waiting for the
	// memory's descriptor), journal.
	Trace *Trace
}

// Create makes a new segment, or with ExistOK returns the existing one.
// created reports which. With Open, the caller holds a lease on the result.
//
// Its steps: checkCreate reads the options; under mu, the name's current
// segment is found (createExistingLocked answers with it, or
// nextVersionLocked makes the new segment its next version);
// admitLocked checks budgets and limits and addCreatingLocked names the
// new segment, still creating; room is made; the memory is allocated and
// exported without mu; finishCreateLocked records it, or undoes the
// segment.
func (r *Registry) Create(c Cred, o CreateOptions) (s *Segment, created bool, err error) {
	// Until o.Memory is taken below, freeing it on failure is this
	// function's job; after, the paths that fail free mem themselves.
	pending := o.Memory
	defer func() {
		if pending != nil {
			free(pending)
		}
	}()
	mode, err := r.checkCreate(&o)
	if err != nil {
		return nil, false, err
	}

	r.mu.Lock()
	owner := c
	existing, err := r.find(o.Name)
	if err != nil && !errors.Is(err, ErrNotFound) {
		r.mu.Unlock()
		return nil, false, err
	}
	var replaces uint64
	if o.NextVersion {
		var again *Segment
		again, owner, mode, err = r.nextVersionLocked(c, o, existing, mode)
		if err != nil || again != nil {
			r.mu.Unlock()
			return again, again != nil, err
		}
		if existing != nil {
			replaces = existing.id
		}
		existing = nil // stays current until the commit
	}
	if existing != nil {
		s, created, err = r.createExistingLocked(c, o, existing)
		r.mu.Unlock()
		return s, created, err
	}
	need, err := r.admitLocked(c, o)
	if err != nil {
		r.mu.Unlock()
		return nil, false, err
	}
	s = r.addCreatingLocked(owner, o, mode)
	s.replaces = replaces
	err = nil // find's ErrNotFound
	if need > 0 {
		// Counted from here on (deviceUseLocked): room is made for it now,
		// and no room ends the create as a failed allocation does.
		err = r.roomLocked(o.Device, nil, need, fmt.Sprintf("creating %q (%s)", o.Name, fmtBytes(need)))
	}
	r.mu.Unlock()
	o.Trace.Mark("check")

	var mem Memory
	switch {
	case err != nil:
	case o.Memory != nil:
		mem, pending = o.Memory, nil
	case o.Slots > 0:
		mem, err = r.allocateChannel(o)
	case o.Size > 0:
		mem, err = r.allocate(o.Device, o.Size)
	}
	o.Trace.Mark(allocStep(mem))
	fd := -1
	if err == nil {
		fd, err = r.durableFD(mem)
	}
	o.Trace.Mark("export")

	r.mu.Lock()
	defer r.mu.Unlock()
	defer close(s.ready)
	return r.finishCreateLocked(c, s, o, mem, fd, err)
}

// checkCreate checks a create's options before anything is locked, sizes a
// channel (o.Size), and says the mode the segment gets.
func (r *Registry) checkCreate(o *CreateOptions) (mode uint32, err error) {
	if err := ValidName(o.Name); err != nil {
		return 0, err
	}
	if o.Slots != 0 {
		size, err := r.channelSize(*o)
		if err != nil {
			return 0, err
		}
		o.Size = size
	}
	if o.Uncommitted && (!o.Open || o.ExistOK || o.Pin || o.Memory != nil || o.Slots != 0 || o.AllowEmpty) {
		return 0, fmt.Errorf("%w: an uncommitted segment is created open, and not with exist_ok, as a channel or from published memory", ErrBadOption)
	}
	if o.Persist && (o.Slots != 0 || o.Memory != nil || o.Bound) {
		return 0, fmt.Errorf("%w: a channel, memory a client published, or a temporary segment is never durable", ErrBadOption)
	}
	if o.Persist && !r.hasDisk() {
		return 0, ErrNoDisk
	}
	if o.NextVersion && !o.Uncommitted {
		return 0, fmt.Errorf("%w: a next version is created uncommitted: its writer fills it, then commits it to make it current", ErrBadOption)
	}
	if o.Size < 0 || o.Size == 0 && !o.AllowEmpty {
		return 0, fmt.Errorf("%w: %d (must be positive)", ErrBadSize, o.Size)
	}
	mode = uint32(DefaultMode)
	if o.UseMode {
		if o.Mode&^0o777 != 0 {
			return 0, fmt.Errorf("%w: %#o (permission bits only)", ErrBadMode, o.Mode)
		}
		mode = o.Mode
	}
	if len(o.Meta) > 0 && !json.Valid(o.Meta) {
		return 0, fmt.Errorf("%w: not valid JSON", ErrBadMeta)
	}
	capacity, err := r.alloc.Capacity(o.Device)
	if err != nil {
		return 0, err
	}
	if o.Size > capacity {
		return 0, fmt.Errorf("%w: %d bytes exceeds device %d's %d bytes", ErrMoreThanDevice, o.Size, o.Device, capacity)
	}
	return mode, nil
}

// nextVersionLocked prepares a create of the next version of existing (nil
// when the name names nothing): again is the version a retried request
// already made, now opened once more; otherwise the new version takes the
// current one's owner, and its mode unless o sets one. mu is held.
func (r *Registry) nextVersionLocked(c Cred, o CreateOptions, existing *Segment, mode uint32) (again *Segment, owner Cred, _ uint32, err error) {
	owner = c
	if again := r.nextByOriginLocked(o.Origin); again != nil {
		if err := r.acquireLocked(c, again, o.ReadOnly); err != nil {
			return nil, owner, mode, err
		}
		return again, owner, mode, nil
	}
	if err := mayReplace(c, existing); err != nil {
		return nil, owner, mode, err
	}
	if existing != nil {
		// A new version of the same thing: its readers may read it.
		owner.UID, owner.GID = existing.uid, existing.gid
		if !o.UseMode {
			mode = existing.mode
		}
	}
	return nil, owner, mode, nil
}

// createExistingLocked answers a create of a name that names existing:
// the segment a first attempt of the same request made, or with ExistOK
// existing itself if it is what o describes. mu is held.
func (r *Registry) createExistingLocked(c Cred, o CreateOptions, existing *Segment) (*Segment, bool, error) {
	if o.Origin != "" && existing.origin == o.Origin {
		// This request's own segment: its first attempt was applied
		// and the reply lost.
		if o.Open {
			if err := r.acquireLocked(c, existing, o.ReadOnly); err != nil {
				return nil, false, err
			}
		}
		return existing, true, nil
	}
	if !o.ExistOK {
		return nil, false, fmt.Errorf("%w: %q", ErrExist, o.Name)
	}
	if existing.uncommitted {
		return nil, false, uncommittedError(existing)
	}
	if existing.slots != o.Slots || existing.slotBytes != o.SlotBytes {
		return nil, false, fmt.Errorf("%w: %q is %s, not %s", ErrExist, o.Name,
			describeLayout(existing.slots, existing.slotBytes), describeLayout(o.Slots, o.SlotBytes))
	}
	if o.Slots > 0 && !sameJSON(existing.meta, o.Meta) {
		// A channel's meta is its tensors' layout: both ends must agree.
		return nil, false, fmt.Errorf("%w: channel %q carries %s, not %s", ErrExist, o.Name, existing.meta, o.Meta)
	}
	if existing.size != o.Size || existing.device != o.Device {
		return nil, false, fmt.Errorf("%w: %q has size %d on device %d, not size %d on device %d",
			ErrExist, o.Name, existing.size, existing.device, o.Size, o.Device)
	}
	if o.Open {
		if err := r.acquireLocked(c, existing, o.ReadOnly); err != nil {
			return nil, false, err
		}
	}
	return existing, false, nil
}

// admitLocked checks a new segment against its device's budget and the
// caller's limits, and says the bytes it needs there. mu is held.
func (r *Registry) admitLocked(c Cred, o CreateOptions) (need int64, err error) {
	need = r.roundSize(o.Device, o.Size)
	if o.Memory != nil {
		need = o.Memory.Size()
	}
	if budget := r.tiers.cfg.Budgets[o.Device]; budget > 0 && need > budget {
		// No eviction could make room: say so, rather than blame the
		// segments that cannot move.
		return 0, fmt.Errorf("%w: %d bytes exceeds device %d's budget of %d bytes", ErrNoRoom, need, o.Device, budget)
	}
	descs := 1
	if o.Slots > 0 {
		descs = 2
	}
	if o.Size == 0 && o.Memory == nil {
		descs = 0 // an empty file holds no memory
	}
	if err := r.checkLimitsLocked(c, o.Device, need, descs, true); err != nil {
		return 0, err
	}
	return need, nil
}

// addCreatingLocked makes the new segment's record, still creating (opens
// of its name wait for it), and names it unless it is a next version. mu
// is held.
func (r *Registry) addCreatingLocked(owner Cred, o CreateOptions, mode uint32) *Segment {
	r.nextID++
	now := time.Now()
	s := &Segment{
		id:        r.nextID,
		name:      o.Name,
		size:      o.Size,
		device:    o.Device,
		created:   now,
		modified:  now,
		uid:       owner.UID,
		gid:       owner.GID,
		mode:      mode,
		meta:      append(json.RawMessage(nil), o.Meta...),
		linked:    !o.NextVersion,
		next:      o.NextVersion,
		version:   1,
		creating:  true,
		ready:     make(chan struct{}),
		ttl:       o.TTL,
		idle:      now,
		bound:     o.Bound,
		session:   o.Session,
		creator:   o.Creator,
		origin:    o.Origin,
		pulledBy:  o.PulledBy,
		slots:     o.Slots,
		slotBytes: o.SlotBytes,
		lastOpen:  now,
		resident:  o.Resident,
		published: o.Memory != nil,
		persist:   o.Persist,
		offer:     o.Offer,

		uncommitted: o.Uncommitted,
	}
	if s.linked {
		r.byName[o.Name] = s
	}
	return s
}

// finishCreateLocked ends the creation of s: with its memory (mem, fd its
// durable descriptor) it is recorded, journaled and opened as o asks; after
// err, or a registry closed meanwhile, it is undone. mu is held; the
// caller closes s.ready.
func (r *Registry) finishCreateLocked(c Cred, s *Segment, o CreateOptions, mem Memory, fd int, err error) (*Segment, bool, error) {
	s.creating = false
	if err == nil && r.closed {
		free(mem)
		err = ErrClosed
	}
	if err == nil && o.Open && mem == nil {
		err = ErrEmpty // a lease on nothing: the protocol never asks
	}
	if err != nil {
		free(mem)
		if s.linked {
			delete(r.byName, o.Name)
		}
		s.linked = false
		s.gone = true
		return nil, false, fmt.Errorf("allocate %d bytes on device %d: %w", o.Size, o.Device, err)
	}
	if mem != nil {
		s.mem = mem
		r.byID[s.id] = s
	}
	if o.Open {
		s.opens = 1
		s.addLease(c, 1)
	}
	if o.Pin {
		s.pins = 1
	}
	r.noteLocked(s, fd)
	o.Trace.Mark("journal")
	r.wakeLocked() // a name came to be: opens waiting for it look again
	return s, true, nil
}
