package segment

import (
	"cmp"
	"fmt"
	"slices"
	"time"
)

// Leases are bound to processes, as creators are. Each lease is counted
// under the process that took it (Cred.Proc, named by the server when the
// connection was accepted), and every change is journaled with the
// segment's record: which processes hold how many leases. A restarted
// daemon keeps those leases (restored) for their processes, whether or not
// they reconnect: while such a process lives the segment is open, so it is
// neither evicted, nor freed once unlinked, nor expired. The server watches
// the processes and ends their leases when they exit (EndHolds); a process
// that reconnects takes its leases back (Reclaim), from then on held by its
// connection. Leases of a process that could not be named (one of a pid
// namespace the daemon cannot see) are journaled as a count only, and only
// the grace period keeps them, as before leases were journaled.

// Holder is one process's leases on a segment, as journaled.
type Holder struct {
	PID   int    `json:"pid"`
	Start uint64 `json:"start"`
	N     int    `json:"n"`
}

// maxHolders bounds the processes a record names: with a protocol
// message's worth of meta, a record of 512 holders (about 40 bytes each)
// still fits in one control message. The leases of processes past it are
// journaled as anonymous ones, which only the grace period keeps.
const maxHolders = 512

// addLease counts n leases that p took on s (opens already counts them).
// mu is held.
func (s *Segment) addLease(p Process, n int) {
	if !p.Known() {
		s.anon += n
		return
	}
	if s.holders == nil {
		s.holders = make(map[Process]int)
	}
	s.holders[p] += n
}

// dropLease uncounts one lease of p's on s. mu is held.
func (s *Segment) dropLease(p Process) {
	switch {
	case p.Known() && s.holders[p] > 0:
		if s.holders[p]--; s.holders[p] == 0 {
			delete(s.holders, p)
		}
	case s.anon > 0:
		s.anon--
	}
}

// holdersLocked are s's leases as a record carries them: every process
// holding some, restored or taken since, in pid order, and the count of
// anonymous ones (with those of processes past maxHolders).
func (s *Segment) holdersLocked() ([]Holder, int) {
	all := make(map[Process]int, len(s.holders)+len(s.restored))
	for p, n := range s.holders {
		all[p] += n
	}
	for p, n := range s.restored {
		all[p] += n
	}
	hs := make([]Holder, 0, len(all))
	for p, n := range all {
		hs = append(hs, Holder{PID: p.PID, Start: p.Start, N: n})
	}
	slices.SortFunc(hs, func(a, b Holder) int {
		return cmp.Or(cmp.Compare(a.PID, b.PID), cmp.Compare(a.Start, b.Start))
	})
	anon := s.anon + s.restoredAnon
	if len(hs) > maxHolders {
		for _, h := range hs[maxHolders:] {
			anon += h.N
		}
		hs = hs[:maxHolders]
	}
	if len(hs) == 0 {
		hs = nil
	}
	return hs, anon
}

// restoreLeases takes a record's leases as s's restored ones, opens
// included. mu is held.
func (s *Segment) restoreLeases(rec *Record) {
	for _, h := range rec.Holders {
		p := Process{PID: h.PID, Start: h.Start}
		if !p.Known() || h.N <= 0 {
			continue
		}
		if s.restored == nil {
			s.restored = make(map[Process]int)
		}
		s.restored[p] += h.N
		s.opens += h.N
	}
	s.restoredAnon = max(rec.Anon, 0)
}

// ReleaseBy ends one lease that process p took on s (p as the Cred of the
// Acquire, Create or Reclaim that took it); the memory is freed when s is
// unlinked and this was its last lease.
func (r *Registry) ReleaseBy(s *Segment, p Process) error {
	r.mu.Lock()
	if s.opens <= 0 {
		r.mu.Unlock()
		return fmt.Errorf("release %q: no lease held", s.name)
	}
	s.opens--
	s.dropLease(p)
	r.idleLocked(s)
	mem := r.detachLocked(s)
	if !s.gone {
		r.noteLocked(s, -1)
	}
	r.mu.Unlock()
	return s.free(mem)
}

// idleLocked starts a TTL segment's idle clock if nothing holds it any
// more; the caller journals the change.
func (r *Registry) idleLocked(s *Segment) {
	if s.ttl > 0 && s.opens+s.pins == 0 && !s.gone {
		if now := time.Now(); now.After(s.idle) {
			s.idle = now
		}
		s.wasInUse = false
	}
}

// reclaimLocked counts n leases that p takes back after a restart: those
// journaled for p (restored) become leases of p's connection, the rest
// are new. mu is held.
func (s *Segment) reclaimLocked(p Process, n int) {
	back := 0
	if p.Known() {
		back = min(n, s.restored[p])
		if back > 0 {
			if s.restored[p] -= back; s.restored[p] == 0 {
				delete(s.restored, p)
			}
		}
	}
	s.opens += n - back
	s.addLease(p, n)
}

// RestoredHolders lists the processes that hold restored leases: those
// the server watches, to end them when the process exits.
func (r *Registry) RestoredHolders() []Process {
	r.mu.Lock()
	defer r.mu.Unlock()
	seen := map[Process]bool{}
	var out []Process
	r.eachSegmentLocked(func(s *Segment) {
		for p := range s.restored {
			if !seen[p] {
				seen[p] = true
				out = append(out, p)
			}
		}
	})
	return out
}

// EndHolds ends the restored leases of p, a process that exited (or that
// cannot be watched, once the grace period is over): what only they kept
// may be freed, evicted or expired from now on. It returns how many ended.
func (r *Registry) EndHolds(p Process) int {
	type freed struct {
		s   *Segment
		mem Memory
	}
	var mems []freed
	n := 0
	r.mu.Lock()
	r.eachSegmentLocked(func(s *Segment) {
		k := s.restored[p]
		if k == 0 {
			return
		}
		delete(s.restored, p)
		s.opens -= k
		n += k
		r.idleLocked(s)
		if mem := r.detachLocked(s); mem != nil {
			mems = append(mems, freed{s, mem})
		}
		if !s.gone {
			r.noteLocked(s, -1)
		}
	})
	r.mu.Unlock()
	for _, f := range mems {
		f.s.free(f.mem)
	}
	return n
}

// eachSegmentLocked calls fn for every segment, named or not, once; fn
// may retire the segment. mu is held.
func (r *Registry) eachSegmentLocked(fn func(*Segment)) {
	segs := make([]*Segment, 0, len(r.byID)+len(r.byName))
	for _, s := range r.byID {
		segs = append(segs, s)
	}
	for _, s := range r.byName {
		if r.byID[s.id] != s {
			segs = append(segs, s)
		}
	}
	for _, s := range segs {
		fn(s)
	}
}
