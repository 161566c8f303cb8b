package segment

import "time"

// Spill memory in parts (Parted, backend.partsMemory): how many parts an
// eviction may take, how they count against the daemon's limit of
// descriptors, and how the journal keeps them (a record a part beyond the
// first, the segment's record listing them all).

// maxSpillParts is the most parts an eviction's memory may have.
const maxSpillParts = 16

// spillPartsLocked is how many descriptors an eviction's memory may take:
// up to maxSpillParts, where the daemon's limit of descriptors
// (Limits.Segments) leaves room: a quarter of what is left at most, and
// the parts beyond each segment's first, of every segment and clean copy
// and of the evictions under way, an eighth of the limit at most, so
// that evictions, which no user's share bounds, never take from creates
// what the limit keeps for them. mu is held.
func (r *Registry) spillPartsLocked() int {
	l := r.limits.Segments
	if l <= 0 {
		return maxSpillParts
	}
	held, extra := r.descsLocked()
	return 1 + min(maxSpillParts-1, max(0, (l-held)/4), max(0, l/8-extra))
}

// descRoomLocked says whether n more descriptors fit under the daemon's
// limit of them. mu is held.
func (r *Registry) descRoomLocked(n int) bool {
	l := r.limits.Segments
	if l <= 0 {
		return true
	}
	held, _ := r.descsLocked()
	return held+n <= l
}

// descsLocked is what counts against the daemon's limit of descriptors:
// held, all of them, and extra, the parts of spill memory beyond each
// segment's first (clean copies too), both with those evictions under way
// may take. mu is held.
func (r *Registry) descsLocked() (held, extra int) {
	held, extra = r.tiers.extraParts, r.tiers.extraParts
	r.eachHeldLocked(func(s *Segment, _ int64, descs int) {
		held += descs
		extra += partsOf(s.mem) - 1 + cleanParts(s)
	})
	return held, extra
}

// cleanParts is how many descriptors s's clean copy holds, when it is in
// parts (a clean copy of one memfd is not counted: it is the one its
// eviction swaps back).
func cleanParts(s *Segment) int {
	if n := partsOf(s.clean); n > 1 {
		return n
	}
	return 0
}

// partsOf is how many descriptors mem takes.
func partsOf(mem Memory) int {
	if p, ok := mem.(Parted); ok {
		return max(1, len(p.Parts()))
	}
	return 1
}

// forgetPartsLocked journals that the parts of s's memory are gone.
func (r *Registry) forgetPartsLocked(s *Segment) {
	for _, p := range s.parts[min(1, len(s.parts)):] { // the first is its own
		r.forgetLocked(p.ID)
	}
	s.parts, s.partsOf = nil, nil
}

// putPartsLocked journals each part of s's memory but its first under a
// record of its own, with the part's descriptor, when the memory is made
// of several (Parted), and notes them in s for its own record; they go
// before that record, so that a restart never finds a record that names
// a part the journal does not hold. Parts journaled already for this
// memory (a replay to a new keeper) keep their records' IDs: a keeper
// that has them already takes the put again as the same.
func (r *Registry) putPartsLocked(s *Segment) {
	var ps []Memory
	if pm, ok := s.mem.(Parted); ok {
		ps = pm.Parts()
	}
	if len(ps) < 2 {
		s.parts, s.partsOf = nil, nil
		return
	}
	known := s.partsOf == s.mem && len(s.parts) == len(ps)
	parts := []Part{{ID: s.id, Size: ps[0].Size()}}
	for i, p := range ps[1:] {
		fd, err := p.FD()
		if err != nil {
			// A memfd's FD does not fail; were it to, the segment's record
			// would name a part that a restart does not find, and make it an
			// orphan, rather than lose the part's bytes silently.
			fd = -1
		}
		id := uint64(0)
		if known {
			id = s.parts[i+1].ID
		} else {
			r.nextID++
			id = r.nextID
		}
		rec := Record{ID: id, PartOf: s.id, Size: p.Size(), Alloc: p.Size(), Device: 0,
			UID: s.uid, GID: s.gid, Mode: 0o600, Created: time.Now().UnixNano(), Tier: OnHost.String()}
		rec.Modified = rec.Created
		r.journal.Put(rec, fd, -1)
		parts = append(parts, Part{ID: id, Size: p.Size()})
	}
	s.parts, s.partsOf = parts, s.mem
}

// strayPartLocked forgets a part's record that no segment took at a
// restart, and returns its memory, to be freed.
func (r *Registry) strayPartLocked(it Restored) Memory {
	if r.journal != nil {
		r.journal.Delete(it.Record.ID)
	}
	return it.Memory
}
