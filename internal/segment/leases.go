package segment

import (
	"cmp"
	"fmt"
	"hash/fnv"
	"slices"
	"time"
)

// Leases are bound to processes, as creators are. Each lease is counted
// under the process that took it (Cred.Proc, named by the server when the
// connection was accepted) and the client session it took it in
// (Cred.Session), and every change is journaled with the segment's record:
// which processes hold how many leases. A restarted daemon keeps those
// leases (restored) for their processes, whether or not they reconnect:
// while such a process lives the segment is open, so it is neither
// evicted, nor freed once unlinked, nor expired. The server watches the
// processes and ends their leases when they exit (EndHolds). A client that
// reconnects takes its leases back (Reclaim), from then on held by its
// connection, and then ends those of its session it did not take back
// (EndSessionHolds): leases whose open or close the crash cut off, which
// the client does not hold. Leases of a process that could not be named
// (one of a pid namespace the daemon cannot see) are journaled as a count
// only, and only the grace period keeps them, as before leases were
// journaled.

// Holder is the leases one process took in one client session on a
// segment, as journaled: the process, a hash of the session (Session is
// up to 128 bytes, the hash 8), and how many.
type Holder struct {
	PID     int    `json:"pid"`
	Start   uint64 `json:"start"`
	Session uint64 `json:"sid,omitempty"`
	N       int    `json:"n"`
}

// holderKey names who holds leases: a process and a session's hash.
type holderKey struct {
	proc Process
	sid  uint64
}

// keyOf is the holder c's leases are counted under; ok is false for an
// anonymous process.
func keyOf(c Cred) (k holderKey, ok bool) {
	if !c.Proc.Known() {
		return holderKey{}, false
	}
	return holderKey{c.Proc, sessionID(c.Session)}, true
}

// sessionID hashes a client session (FNV-1a, 64 bits); 0 for none.
func sessionID(session string) uint64 {
	if session == "" {
		return 0
	}
	h := fnv.New64a()
	h.Write([]byte(session))
	return max(h.Sum64(), 1)
}

// maxHolders bounds the holders a record names: with a protocol message's
// worth of meta, a record of 256 holders (about 60 bytes each) still fits
// in one control message, two of them in a batch. The leases of holders
// past it are journaled as anonymous ones, which only the grace period
// keeps.
const maxHolders = 256

// addLease counts n leases that c took on s (opens already counts them).
// mu is held.
func (s *Segment) addLease(c Cred, n int) {
	k, ok := keyOf(c)
	if !ok {
		s.anon += n
		return
	}
	if s.holders == nil {
		s.holders = make(map[holderKey]int)
	}
	s.holders[k] += n
}

// dropLease uncounts one lease of c's on s. mu is held.
func (s *Segment) dropLease(c Cred) {
	k, ok := keyOf(c)
	switch {
	case ok && s.holders[k] > 0:
		if s.holders[k]--; s.holders[k] == 0 {
			delete(s.holders, k)
		}
	case s.anon > 0:
		s.anon--
	}
}

// holdersLocked are s's leases as a record carries them: every process
// holding some, restored or taken since, in pid order, and the count of
// anonymous ones (with those of processes past maxHolders).
func (s *Segment) holdersLocked() ([]Holder, int) {
	all := make(map[holderKey]int, len(s.holders)+len(s.restored))
	for k, n := range s.holders {
		all[k] += n
	}
	for k, n := range s.restored {
		all[k] += n
	}
	hs := make([]Holder, 0, len(all))
	for k, n := range all {
		hs = append(hs, Holder{PID: k.proc.PID, Start: k.proc.Start, Session: k.sid, N: n})
	}
	slices.SortFunc(hs, func(a, b Holder) int {
		return cmp.Or(cmp.Compare(a.PID, b.PID), cmp.Compare(a.Start, b.Start), cmp.Compare(a.Session, b.Session))
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
// included, and indexes them by holder. mu is held.
func (r *Registry) restoreLeases(s *Segment, rec *Record) {
	for _, h := range rec.Holders {
		k := holderKey{Process{PID: h.PID, Start: h.Start}, h.Session}
		if !k.proc.Known() || h.N <= 0 {
			continue
		}
		if s.restored == nil {
			s.restored = make(map[holderKey]int)
		}
		if s.restored[k] == 0 {
			if r.restoredBy == nil {
				r.restoredBy = make(map[holderKey][]*Segment)
			}
			r.restoredBy[k] = append(r.restoredBy[k], s)
		}
		s.restored[k] += h.N
		s.opens += h.N
	}
	s.restoredAnon = max(rec.Anon, 0)
}

// ReleaseBy ends one lease on s that c took (c as in the Acquire, Create
// or Reclaim that took it); the memory is freed when s is unlinked and
// this was its last lease.
func (r *Registry) ReleaseBy(s *Segment, c Cred) error {
	r.mu.Lock()
	if s.opens <= 0 {
		r.mu.Unlock()
		return fmt.Errorf("release %q: no lease held", s.name)
	}
	s.opens--
	s.dropLease(c)
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

// reclaimLocked counts n leases that c takes back after a restart: those
// journaled for c's process and session (restored) become leases of its
// connection, the rest are new. mu is held.
func (s *Segment) reclaimLocked(c Cred, n int) {
	back := 0
	if k, ok := keyOf(c); ok {
		back = min(n, s.restored[k])
		if back > 0 {
			if s.restored[k] -= back; s.restored[k] == 0 {
				delete(s.restored, k)
			}
		}
	}
	s.opens += n - back
	s.changes.Add(1)
	s.addLease(c, n)
}

// RestoredHolders lists the processes that hold restored leases: those
// the server watches, to end them when the process exits.
func (r *Registry) RestoredHolders() []Process {
	r.mu.Lock()
	defer r.mu.Unlock()
	seen := map[Process]bool{}
	var out []Process
	for k := range r.restoredBy {
		if !seen[k.proc] {
			seen[k.proc] = true
			out = append(out, k.proc)
		}
	}
	return out
}

// EndHolds ends the restored leases of p, a process that exited (or that
// cannot be watched, once the grace period is over): what only they kept
// may be freed, evicted or expired from now on. It returns how many ended.
func (r *Registry) EndHolds(p Process) int {
	return r.endHolds(func(k holderKey) bool { return k.proc == p })
}

// EndSessionHolds ends the restored leases that c's process took in c's
// session and did not take back: a client that reconnected and reclaimed
// what it holds does not hold those (their open or close was cut off by
// the crash). It returns how many ended.
func (r *Registry) EndSessionHolds(c Cred) int {
	k, ok := keyOf(c)
	if !ok {
		return 0
	}
	return r.endHolds(func(h holderKey) bool { return h == k })
}

// endHolds ends the restored leases of the holders that match takes.
func (r *Registry) endHolds(match func(holderKey) bool) int {
	type freed struct {
		s   *Segment
		mem Memory
	}
	var mems []freed
	n := 0
	r.mu.Lock()
	for h, segs := range r.restoredBy {
		if !match(h) {
			continue
		}
		delete(r.restoredBy, h)
		for _, s := range segs {
			k := s.restored[h] // 0 if taken back since
			if k == 0 || s.gone {
				continue
			}
			delete(s.restored, h)
			s.opens -= k
			n += k
			r.idleLocked(s)
			if mem := r.detachLocked(s); mem != nil {
				mems = append(mems, freed{s, mem})
			}
			if !s.gone {
				r.noteLocked(s, -1)
			}
		}
	}
	r.mu.Unlock()
	for _, f := range mems {
		f.s.free(f.mem)
	}
	return n
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
		r.writtenLocked(s)
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
