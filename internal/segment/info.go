package segment

import (
	"encoding/json"
	"sort"
	"strconv"
	"time"
)

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
	// Persist says the segment is durable (disk.go); Synced is when its
	// copy on disk was written (zero: none yet), Stale that it was opened
	// to be written since.
	Persist  bool
	Synced   time.Time
	Stale    bool
	Resident bool
	// Offer says the daemon offers it to its peers (peers.go).
	Offer bool
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

// PullOrigin is what a pull asked for by c with the request origin
// (session/id) records of the segment it makes (CreateOptions.PulledBy);
// "" for none. The asker's uid is part of it: a session is a name any
// client may say, and a segment's owner is not who asked for the pull.
func PullOrigin(c Cred, origin string) string {
	if origin == "" {
		return ""
	}
	return strconv.FormatUint(uint64(c.UID), 10) + ":" + origin
}

// MadeBy describes the committed segment name if c's pull request origin
// made it (PullOrigin): a pull sent again after a crash has what its first
// attempt made and committed, as a retried create does (CreateOptions.Origin).
func (r *Registry) MadeBy(c Cred, name, origin string) (Info, bool) {
	by := PullOrigin(c, origin)
	if by == "" {
		return Info{}, false
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	s, err := r.find(name)
	if err != nil || s.pulledBy != by || s.uncommitted {
		return Info{}, false
	}
	return r.infoLocked(s), true
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
		Persist:     s.persist,
		Offer:       s.offer,
		Stale:       s.onDisk && !s.diskClean,
	}
	if s.onDisk {
		inf.Synced = s.synced
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

// Segments describes every segment holding memory, named or unlinked but
// still open, in no particular order, without metadata. For metrics.
func (r *Registry) Segments() []Info {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]Info, 0, len(r.byID))
	for _, s := range r.byID {
		inf := r.infoLocked(s)
		inf.Meta = nil
		out = append(out, inf)
	}
	return out
}
