package segment

import "time"

// Expire ends every named segment with a TTL that has been neither open nor
// pinned for its TTL, as of now, and returns their names. The idle clock of
// a segment in use restarts whenever Expire sees it in use, so callers run
// Expire often (the server: a few times a second); a segment expires at most
// that period late, never early.
func (r *Registry) Expire(now time.Time) []string {
	type freed struct {
		s   *Segment
		mem Memory
	}
	var names []string
	var mems []freed
	r.mu.Lock()
	for name, s := range r.byName {
		if s.ttl <= 0 || s.creating {
			continue
		}
		if s.opens > 0 || s.pins > 0 {
			s.idle = now
			continue
		}
		if s.doubt && s.wasInUse {
			// Open when the daemon stopped: its clients may yet reclaim it.
			continue
		}
		if now.Sub(s.idle) < s.ttl {
			continue
		}
		delete(r.byName, name)
		s.linked = false
		names = append(names, name)
		if mem := r.unlinkedLocked(s); mem != nil {
			mems = append(mems, freed{s, mem})
		}
	}
	if len(names) > 0 {
		r.changed()
	}
	r.mu.Unlock()
	for _, f := range mems {
		f.s.free(f.mem)
	}
	return names
}
