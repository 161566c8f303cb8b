package segment

import (
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Memory is one allocation: a descriptor another process can map, and the
// means to free it. FD may block until the descriptor exists (a backend may
// export it in the background) and may fail; it returns the same descriptor
// every time it succeeds. Free closes the descriptor.
type Memory interface {
	FD() (int, error)
	Size() int64
	Free() error
}

// Allocator is what the registry needs of a backend.
type Allocator interface {
	// Allocate returns at least size bytes on device. Out of memory must
	// unwrap to syscall.ENOMEM, out of descriptors to syscall.EMFILE.
	Allocate(device int, size int64) (Memory, error)
	// Capacity is the device's total memory; an unknown device is an error
	// that unwraps to ErrNoDevice.
	Capacity(device int) (int64, error)
	// HandleType names what Memory.FD is ("memfd", "cuda_fd").
	HandleType() string
}

// Cred identifies the process asking.
type Cred struct {
	UID, GID uint32
	// Proc is the process, when it can be named, and Session its client
	// session: the leases it takes are journaled under them (leases.go).
	// The zero Process is anonymous.
	Proc    Process
	Session string
}

// Process names one process for as long as it lives: its pid and its
// start time (the kernel's, in clock ticks after boot), so that a process
// that reuses the pid later is not taken for it. The zero Process, or one
// without a start time, is unknown.
type Process struct {
	PID   int
	Start uint64
}

// Known reports whether p names a process.
func (p Process) Known() bool { return p.PID > 0 && p.Start > 0 }

// Root is the credential of the superuser.
var Root = Cred{}

// DefaultMode is the mode of a segment created without one.
const DefaultMode = 0o600

// MaxName is the longest name, in bytes, as for a file name.
const MaxName = 255

// Permission bits for Acquire.
const (
	Read  = 4
	Write = 2
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
	// Trace, when set, times the steps of the create: check (validation,
	// the name, limits), alloc or alloc-pool, export (waiting for the
	// memory's descriptor), journal.
	Trace *Trace
}

// Info is a snapshot of a segment's state.
type Info struct {
	ID         uint64
	Name       string
	Size       int64
	AllocSize  int64
	Device     int
	HandleType string
	UID, GID   uint32
	Mode       uint32
	Opens      int
	Created    time.Time
	Meta       json.RawMessage
	Linked     bool
	// Pins counts in-daemon references (FUSE open files); unlike Opens they
	// do not mean the memory is mapped elsewhere.
	Pins int
	// Modified is the time of the last write, resize or SetTimes.
	Modified time.Time
	// TTL and Bound are the lifetime asked for at creation; Idle is when
	// the segment was last seen neither open nor pinned.
	TTL   time.Duration
	Bound bool
	Idle  time.Time
	// Orphan, when not empty, says why the segment cannot be served: it
	// survived a restart in a state the daemon could not prove.
	Orphan string
	// Doubt says the segment was restored after a restart and clients may
	// still be reclaiming their leases on it.
	Doubt bool
	// Slots, SlotBytes and Stride describe a channel (Slots > 0).
	Slots     int
	SlotBytes int64
	Stride    int64
	// Uncommitted: its creator is still filling it (commit.go).
	Uncommitted bool
	// Version counts the segments the name has named, this one included
	// (versions.go); Next marks a next version not yet made current.
	// Versions, filled by Stat only, are the name's earlier versions
	// that are still held.
	Version  uint64
	Next     bool
	Versions []VersionInfo
	// Sources (Stat only) are the ranges the daemon filled from files.
	Sources []Source
	// RDMA: an RDMA engine can register the memory (GPUDirect RDMA with
	// VMM); cuda memory on a device that allows it, never host memory.
	RDMA bool
	// Tier is where its bytes live; LastOpen when it was last opened (or
	// created, or loaded); Resident that it is pinned to its device.
	Tier     Tier
	LastOpen time.Time
	Resident bool
}

// Segment is one allocation in the registry.
type Segment struct {
	id      uint64
	device  int
	created time.Time
	ready   chan struct{} // closed when creation finished, either way

	// io orders the daemon's own copies against replacing or freeing mem:
	// ReadAt and WriteAt hold it shared, Resize and freeing exclusively. It
	// is taken before Registry.mu, never while holding it.
	io sync.RWMutex
	// changes counts what may have changed the bytes since the daemon
	// last read them: its own writes and resizes, each counted once done,
	// and every lease taken, counted before the descriptor goes out
	// (Stamp, files.go).
	changes atomic.Uint64

	// Guarded by Registry.mu. mem changes only while io is held
	// exclusively and opens is 0, so a lease holder may read it unlocked.
	size     int64 // logical size, at most mem.Size()
	creating bool  // the first allocation is in progress
	name     string
	uid, gid uint32
	mode     uint32
	meta     json.RawMessage
	opens    int  // leases: the descriptor went to a process that may map it
	pins     int  // in-daemon references: keep the memory, map nothing elsewhere
	linked   bool // reachable by name
	gone     bool // retired: unnamed and unreferenced, its memory freed
	mem      Memory
	modified time.Time
	// Lifetimes (lifetime.go): ttl > 0 ends the segment once it has been
	// neither open nor pinned for ttl since idle; bound marks a segment that
	// ends with its creator's connection (the server ends it).
	ttl   time.Duration
	idle  time.Time
	bound bool
	// Durability (journal.go): session, creator and origin identify who
	// made the segment (its client, its process, its request); saved says
	// the journal holds a record; doubt marks a segment restored after a
	// restart whose leases may still be reclaimed, and wasInUse one whose
	// TTL clock was stopped then; orphan says why it cannot be served.
	session  string
	creator  Process
	origin   string
	saved    bool
	doubt    bool
	wasInUse bool
	orphan   string
	// Leases by process (leases.go): holders counts the leases taken in
	// this process by each process that could be named, anon those of
	// processes that could not; restored are the leases a previous
	// serving process journaled, kept for their processes until they
	// exit or reclaim them, and restoredAnon its anonymous ones, which
	// the grace period waits for. opens counts all but restoredAnon.
	holders      map[holderKey]int
	anon         int
	restored     map[holderKey]int
	restoredAnon int
	// A channel's layout (slots > 0); its memory is a ChannelMemory.
	slots     int
	slotBytes int64
	// Committing (commit.go): uncommitted until its creator commits it;
	// commitOrigin names the request that did.
	uncommitted  bool
	commitOrigin string
	// Versions (versions.go): version counts the segments the name has
	// named (0 in records of older daemons: 1); next marks a next version
	// not yet made current, which holds no name, and replaces is the ID of
	// the segment the name named when it was made (0: none), the only one
	// its commit may replace.
	version  uint64
	next     bool
	replaces uint64
	// Tiers (tier.go): where the bytes live, when it was last opened,
	// whether it is pinned to its device, whether its memory came from a
	// client; moving is closed when a move between tiers ends, nil while
	// none runs.
	tier      Tier
	lastOpen  time.Time
	resident  bool
	published bool
	moving    chan struct{}
	copying   bool // moving, past waiting for room
	// clean, for a segment on its device, is host memory that holds the
	// same bytes: the copy it was restored from, kept while every open
	// since was read-only, so that evicting it again is a swap rather
	// than a copy (tier.go). Not journaled: a cache.
	clean Memory
	// sources are the ranges the daemon filled from files; foreign says
	// that someone but its owner and root could write it (sources.go).
	sources []Source
	foreign bool
}

// ID is unique for the registry's lifetime; IDs are never reused.
func (s *Segment) ID() uint64 { return s.id }

// FD is the segment's descriptor, owned by the registry. Valid while the
// caller holds a lease.
func (s *Segment) FD() (int, error) { return s.mem.FD() }

// Registry maps names to segments.
type Registry struct {
	alloc Allocator

	mu     sync.Mutex
	byName map[string]*Segment
	byID   map[uint64]*Segment // every segment holding memory, named or not
	nextID uint64
	closed bool
	// changed runs, with mu held, whenever a name stops naming the segment it
	// named; clients use it to invalidate cached mappings.
	changed func()
	limits  Limits
	// journal, when set, receives every durable change (journal.go).
	journal    Journal
	batching   bool     // changes go to batch, not yet to journal
	batch      []Change // held for one Batch (journal.go)
	graceUntil time.Time
	ctlAlloc   Allocator // control blocks of channels (host memory)
	// removed, if set, is told of a channel whose name went (unlink,
	// rename over it), outside the lock, before its memory is freed.
	removed func(*Segment)
	// waiters is closed, and set to nil, at the next change that may end
	// an open's wait for a commit (commit.go); nil while nobody waits.
	waiters chan struct{}
	// replaced is the version a commit just replaced, with its memory if
	// nothing holds it; Commit frees it once it lets go of mu.
	replaced *replacedVersion
	tiers    tierState
	// restoredBy indexes the segments holding restored leases by holder
	// (leases.go); a segment whose holder took them back since stays
	// listed until the holder's leases end.
	restoredBy map[holderKey][]*Segment
	// background frees host memory that nothing needs any more off the
	// path of the request that let it go (a restore's source: half a
	// second at 4 GiB).
	background sync.WaitGroup
}

// New returns an empty registry allocating through alloc. changed, if not
// nil, is called whenever a name's binding is removed.
func New(alloc Allocator, changed func()) *Registry {
	if changed == nil {
		changed = func() {}
	}
	r := &Registry{
		alloc:  alloc,
		byName: make(map[string]*Segment),
		byID:   make(map[uint64]*Segment),
		tiers:  tierState{reserved: map[int]int64{}, peak: map[int]int64{}},
	}
	// Whatever makes a name stop naming its segment may also end an open's
	// wait for a commit (commit.go).
	r.changed = func() {
		changed()
		r.wakeLocked()
	}
	return r
}

// ValidName reports why name cannot name a segment, or nil.
func ValidName(name string) error {
	switch {
	case name == "":
		return fmt.Errorf("%w: empty", ErrBadName)
	case len(name) > MaxName:
		return fmt.Errorf("%w: %d bytes, limit %d", ErrNameLong, len(name), MaxName)
	case name == "." || name == "..":
		return fmt.Errorf("%w: %q", ErrBadName, name)
	case strings.ContainsAny(name, "/\x00"):
		return fmt.Errorf("%w: %q contains '/' or NUL", ErrBadName, name)
	}
	return nil
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
		slots:     o.Slots,
		slotBytes: o.SlotBytes,
		lastOpen:  now,
		resident:  o.Resident,
		published: o.Memory != nil,

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

// find finds a named, ready segment, waiting out a creation in progress.
// mu must be held; it may be released and retaken while waiting.
func (r *Registry) find(name string) (*Segment, error) {
	for {
		if r.closed {
			return nil, ErrClosed
		}
		s := r.byName[name]
		if s == nil {
			return nil, fmt.Errorf("%w: %q", ErrNotFound, name)
		}
		if !s.creating {
			return s, nil
		}
		r.waitLocked(s.ready)
	}
}

func allowed(c Cred, s *Segment, want uint32) bool { return permits(c, s.uid, s.gid, s.mode, want) }

// Allows reports whether c may have want access (Read, Write, or both) to
// the segment inf describes, as an open checks it.
func (inf *Info) Allows(c Cred, want uint32) bool {
	return permits(c, inf.UID, inf.GID, inf.Mode, want)
}

// permits is the check of a file's mode: the owner's bits for its owner,
// the group's for its group, the others' for everyone else; root may do
// anything.
func permits(c Cred, uid, gid, mode, want uint32) bool {
	if c.UID == 0 {
		return true
	}
	switch {
	case c.UID == uid:
		mode >>= 6
	case c.GID == gid:
		mode >>= 3
	}
	return mode&want == want
}

func (r *Registry) acquireLocked(c Cred, s *Segment, readOnly bool) error {
	want, what := uint32(Read|Write), "read-write"
	if readOnly {
		want, what = Read, "read"
	}
	if !allowed(c, s, want) {
		return fmt.Errorf("%w: %s access to %q (mode %#o, owner %d:%d)", ErrPermission, what, s.name, s.mode, s.uid, s.gid)
	}
	if s.orphan != "" {
		return fmt.Errorf("%w: %q: %s ('gpushm rm %s' removes it)", ErrOrphan, s.name, s.orphan, s.name)
	}
	if s.mem == nil {
		return fmt.Errorf("%w: %q has 0 bytes and no memory yet (write or truncate it first)", ErrEmpty, s.name)
	}
	// What goes out is the device's descriptor: bring s back first if it
	// was evicted (the lock is dropped meanwhile).
	if err := r.onDeviceLocked(s); err != nil {
		return err
	}
	if !readOnly {
		r.dirtyLocked(s)
	}
	if !readOnly || r.readersWrite() {
		r.grantWriteLocked(c, s)
	}
	s.opens++
	s.changes.Add(1)
	s.addLease(c, 1)
	s.lastOpen = time.Now()
	r.noteLocked(s, -1)
	return nil
}

// Acquire opens a segment by name: the caller holds a lease until Release.
func (r *Registry) Acquire(c Cred, name string, readOnly bool) (*Segment, error) {
	if err := ValidName(name); err != nil {
		return nil, err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	s, err := r.find(name)
	if err != nil {
		return nil, err
	}
	if s.uncommitted {
		return nil, uncommittedError(s)
	}
	if err := r.acquireLocked(c, s, readOnly); err != nil {
		return nil, err
	}
	return s, nil
}

// Release ends one lease on s that an anonymous process took; the memory
// is freed when s is unlinked and this was its last lease.
func (r *Registry) Release(s *Segment) error { return r.ReleaseBy(s, Cred{}) }

// drop ends one reference that *count (s.opens or s.pins) counts, and frees
// s's memory if that was s's last reference of any kind.
func (r *Registry) drop(s *Segment, count *int, op, what string) error {
	r.mu.Lock()
	if *count <= 0 {
		r.mu.Unlock()
		return fmt.Errorf("%s %q: no %s held", op, s.name, what)
	}
	*count--
	if s.ttl > 0 && s.opens+s.pins == 0 && !s.gone {
		if now := time.Now(); now.After(s.idle) {
			s.idle = now
		}
		s.wasInUse = false
		r.noteLocked(s, -1)
	}
	mem := r.detachLocked(s)
	r.mu.Unlock()
	return s.free(mem)
}

// detachLocked retires an unlinked segment that nothing references any
// more and returns its memory, for the caller to free with Segment.free
// outside the lock.
func (r *Registry) detachLocked(s *Segment) Memory {
	if s.linked || s.opens > 0 || s.pins > 0 || s.gone || s.creating || s.doubt {
		return nil
	}
	s.gone = true
	delete(r.byID, s.id)
	mem := s.mem
	s.mem = nil
	r.dirtyLocked(s)
	r.noteLocked(s, -1)
	return mem
}

// free frees memory that was s's, once no copy of the daemon's own (ReadAt,
// WriteAt) still runs on it.
func (s *Segment) free(mem Memory) error {
	if mem == nil {
		return nil
	}
	s.io.Lock()
	defer s.io.Unlock()
	return free(mem)
}

func free(mem Memory) error {
	if mem == nil {
		return nil
	}
	if err := mem.Free(); err != nil {
		return fmt.Errorf("free: %w", err)
	}
	return nil
}

// Unlink removes name at once. Only the owner or root may unlink.
func (r *Registry) Unlink(c Cred, name string) error {
	if err := ValidName(name); err != nil {
		return err
	}
	r.mu.Lock()
	s, err := r.find(name)
	if err != nil {
		r.mu.Unlock()
		return err
	}
	if c.UID != 0 && c.UID != s.uid {
		r.mu.Unlock()
		return fmt.Errorf("%w: %q belongs to uid %d", ErrNotOwner, name, s.uid)
	}
	delete(r.byName, name)
	s.linked = false
	r.changed()
	mem := r.unlinkedLocked(s)
	r.mu.Unlock()
	r.channelRemoved(s)
	return s.free(mem)
}

// unlinkedLocked journals a segment whose name just went: freed now, or
// kept unnamed while referenced.
func (r *Registry) unlinkedLocked(s *Segment) Memory {
	mem := r.detachLocked(s)
	if !s.gone {
		r.noteLocked(s, -1)
	}
	return mem
}

// Discard unlinks s if its name still names it: the undo of a Create whose
// caller could not finish (the descriptor could not be made, say).
func (r *Registry) Discard(s *Segment) error {
	r.mu.Lock()
	if !s.linked || r.byName[s.name] != s {
		r.mu.Unlock()
		return nil
	}
	delete(r.byName, s.name)
	s.linked = false
	r.changed()
	mem := r.unlinkedLocked(s)
	r.mu.Unlock()
	r.channelRemoved(s)
	return free(mem)
}

// Stat describes the named segment.
func (r *Registry) Stat(name string) (Info, error) {
	if err := ValidName(name); err != nil {
		return Info{}, err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	s, err := r.find(name)
	if err != nil {
		return Info{}, err
	}
	inf := r.infoLocked(s)
	inf.Versions = r.versionsLocked(s)
	inf.Sources = sourcesOf(s)
	return inf, nil
}

// Info describes s, named or not.
func (r *Registry) Info(s *Segment) Info {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.infoLocked(s)
}

func (r *Registry) infoLocked(s *Segment) Info {
	inf := Info{
		ID:         s.id,
		Name:       s.name,
		Size:       s.size,
		Device:     s.device,
		HandleType: r.alloc.HandleType(),
		UID:        s.uid,
		GID:        s.gid,
		Mode:       s.mode,
		Opens:      s.opens,
		Created:    s.created,
		Meta:       s.meta,
		Linked:     s.linked,
		Pins:       s.pins,
		Modified:   s.modified,
		TTL:        s.ttl,
		Bound:      s.bound,
		Idle:       s.idle,
		Orphan:     s.orphan,
		Doubt:      s.doubt,
		Slots:      s.slots,
		SlotBytes:  s.slotBytes,

		Uncommitted: s.uncommitted,
		Version:     max(s.version, 1),
		Next:        s.next,
		Tier:        s.tier,
		LastOpen:    s.lastOpen,
		Resident:    s.resident,
	}
	if s.slots > 0 {
		inf.Stride = channelStride(s.slotBytes)
	}
	if s.mem != nil {
		inf.AllocSize = s.mem.Size()
		if m, ok := s.mem.(interface{ RDMA() bool }); ok {
			inf.RDMA = m.RDMA()
		}
	}
	return inf
}

// List returns up to limit named segments whose names sort after after, in
// name order, without their metadata. limit <= 0 means all.
func (r *Registry) List(after string, limit int) []Info {
	r.mu.Lock()
	defer r.mu.Unlock()
	names := make([]string, 0, len(r.byName))
	for name, s := range r.byName {
		if name > after && !s.creating {
			names = append(names, name)
		}
	}
	sort.Strings(names)
	if limit > 0 && len(names) > limit {
		names = names[:limit]
	}
	out := make([]Info, len(names))
	for i, name := range names {
		out[i] = r.infoLocked(r.byName[name])
		out[i].Meta = nil
	}
	return out
}

// Usage is what the registry holds.
type Usage struct {
	Segments int   // holding memory, named or not
	Named    int   // reachable by name
	Bytes    int64 // allocated bytes
	Opens    int
}

// Usage sums the registry.
func (r *Registry) Usage() Usage {
	r.mu.Lock()
	defer r.mu.Unlock()
	u := Usage{Segments: len(r.byID), Named: len(r.byName)}
	for _, s := range r.byID {
		u.Bytes += s.mem.Size()
		u.Opens += s.opens
	}
	return u
}

// Close frees every segment, leased or not, and refuses further work. The
// memory of segments that other processes still map stays alive in those
// processes until they unmap it.
func (r *Registry) Close() error {
	r.mu.Lock()
	r.closed = true
	type held struct {
		s   *Segment
		mem Memory
	}
	mems := make([]held, 0, len(r.byID))
	for _, s := range r.byID {
		mems = append(mems, held{s, s.mem})
		s.mem = nil
		r.dirtyLocked(s)
	}
	for _, s := range r.byName {
		s.linked = false
		s.gone = true
	}
	for _, h := range mems {
		h.s.linked = false
		h.s.gone = true
	}
	r.byID = make(map[uint64]*Segment)
	r.byName = make(map[string]*Segment)
	r.changed()
	r.mu.Unlock()
	var errs []error
	for _, h := range mems {
		errs = append(errs, h.s.free(h.mem))
	}
	r.background.Wait()
	return errors.Join(errs...)
}
