package segment

import (
	"encoding/json"
	"errors"
	"fmt"
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
	pulledBy string // the pull request that made it (Registry.MadeBy)
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
	// parts are the journal's records of the parts of partsOf, memory
	// made of several descriptors (Parted), as last journaled; nil for
	// memory of one.
	parts   []Part
	partsOf Memory
	// The disk tier and durability (disk.go): persist makes the segment
	// durable; onDisk says a copy of it is on disk under DiskKey(id), and
	// diskClean that the copy holds its bytes as they are (no writable
	// open since it was written); synced is when it was written. heldBy is
	// the durable next version that replaced it, whose copy must be on
	// disk before this one's goes; supersedes are the keys of the copies
	// this one removes once its own is.
	persist    bool
	offer      bool   // offered to the daemon's peers (peers.go)
	diskFP     string // durablePrint of the record its copy has
	onDisk     bool
	diskClean  bool
	synced     time.Time
	heldBy     *Segment
	supersedes []string
	// diskOps counts the background writes of its record and removals of
	// its copy in flight; diskIdle is closed when it falls to 0 (waitDisk).
	diskOps  int
	diskIdle chan struct{}
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
	// remeta orders the rewrites of durable copies' records (disk.go).
	remeta sync.Mutex
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
