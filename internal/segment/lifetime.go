package segment

import (
	"fmt"
	"time"
)

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
	r.retireDiskLocked(s)
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
	err = s.free(mem)
	// A durable segment's copy (or, while it is open, its record saying
	// it has no name) is off the disk before rm returns: a reboot right
	// after it must not bring the name back.
	r.waitDisk(s)
	return err
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
