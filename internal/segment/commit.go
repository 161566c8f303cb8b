package segment

import (
	"encoding/json"
	"errors"
	"fmt"
	"syscall"
)

// Committing: a segment created Uncommitted takes its name at once, so that
// a second writer of the name fails before it copies anything, but only its
// creator holds it open until the creator commits it: Acquire and Pin
// refuse it (ErrUncommitted), TryAcquire waits for it. It ends with its
// creator, as a Bound segment does; the server discards it when its
// creator's connection ends or the creator closes it. Commit makes it an
// ordinary segment in one journaled step. Until then no reader has it, so
// whatever the creator wrote, half or all, nobody has read it.

// ErrUncommitted: the segment's creator is still filling it.
var ErrUncommitted = &Error{"segment is not committed yet", syscall.EAGAIN}

func uncommittedError(s *Segment) error {
	return fmt.Errorf("%w: %q is still being written (its writer has not committed it; open with a wait to wait for it)", ErrUncommitted, s.name)
}

// wakeLocked ends every wait of TryAcquire's callers, who look again; mu is
// held.
func (r *Registry) wakeLocked() {
	if r.waiters != nil {
		close(r.waiters)
		r.waiters = nil
	}
}

// ByID finds a segment holding memory, named or not, by its ID.
func (r *Registry) ByID(id uint64) (*Segment, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	s := r.byID[id]
	if s == nil || s.gone {
		return nil, fmt.Errorf("%w: id %d", ErrNotFound, id)
	}
	return s, nil
}

// Commit makes the uncommitted segment s openable by its name. Whether the
// caller is s's creator is the caller's business; c is the committer, who
// must be allowed to remove what a next version replaces (versions.go).
// origin names the committing request (as CreateOptions.Origin does): a
// commit retried with the same origin succeeds again, any other commit of
// a committed segment is an error. A segment whose name was removed
// meanwhile stays uncommitted: ErrExist when the name now names another
// segment, else ErrNotFound. meta, when not empty, replaces s's meta in
// the same journaled step (what the creator learned while filling it:
// put's checksums); it must be valid JSON (ErrBadMeta), and its size is
// the caller's to bound, as for a create's.
func (r *Registry) Commit(c Cred, s *Segment, origin string, meta json.RawMessage) error {
	if len(meta) > 0 && !json.Valid(meta) {
		return fmt.Errorf("%w: not valid JSON", ErrBadMeta)
	}
	r.mu.Lock()
	defer func() {
		// A version made current replaced one, which goes once nobody
		// holds it: freed here, outside the lock.
		old := r.replaced
		r.replaced = nil
		r.mu.Unlock()
		if old != nil {
			old.s.free(old.mem)
		}
	}()
	switch {
	case s.gone:
		return fmt.Errorf("%w: segment %d was removed", ErrNotFound, s.id)
	case !s.uncommitted && origin != "" && s.commitOrigin == origin:
		return nil // this request's own commit, its reply lost
	case !s.uncommitted:
		return fmt.Errorf("%w: %q is committed already (or was not created uncommitted)", ErrBadOption, s.name)
	case s.orphan != "":
		return fmt.Errorf("%w: %q: %s", ErrOrphan, s.name, s.orphan)
	case s.next:
		return r.makeCurrentLocked(c, s, origin, meta)
	case !s.linked && r.byName[s.name] != nil:
		return fmt.Errorf("%w: %q names another segment now (this one was removed before it was committed)", ErrExist, s.name)
	case !s.linked:
		return fmt.Errorf("%w: %q was removed before it was committed", ErrNotFound, s.name)
	}
	s.uncommitted = false
	s.commitOrigin = origin
	if len(meta) > 0 {
		s.meta = append(json.RawMessage(nil), meta...)
	}
	r.noteLocked(s, -1)
	if s.persist && r.tiers.cfg.Disk != nil {
		r.syncLater(s)
	}
	// Clients' cached opens need no epoch move: nobody but the creator could
	// open the name while it was uncommitted, and it named nothing else.
	r.wakeLocked()
	return nil
}

// Watch is what an open waiting for a commit remembers between two tries.
type Watch struct {
	seen *Segment // the uncommitted segment the name named, if any
}

// Seen reports whether the name named an uncommitted segment at some try.
func (w *Watch) Seen() bool { return w.seen != nil }

// TryAcquire is Acquire for an open that may wait for a commit. When name
// names a committed segment, it takes a lease as Acquire does. When the name
// does not exist, or names a segment that is not committed yet, it returns
// no segment and a channel that is closed at the next change that may
// alter that; the caller waits on it (with its own deadline) and tries
// again with the same w. An uncommitted segment the caller saw that loses
// its name without being committed (its writer died, or gave up) ends the
// wait with ErrNotFound.
func (r *Registry) TryAcquire(c Cred, name string, readOnly bool, w *Watch) (*Segment, <-chan struct{}, error) {
	if err := ValidName(name); err != nil {
		return nil, nil, err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	s, err := r.find(name)
	if err != nil && !errors.Is(err, ErrNotFound) {
		return nil, nil, err
	}
	if s != nil && !s.uncommitted {
		if err := r.acquireLocked(c, s, readOnly); err != nil {
			return nil, nil, err
		}
		return s, nil, nil
	}
	if w.seen != nil && w.seen != s && w.seen.uncommitted {
		return nil, nil, fmt.Errorf("%w: %q went before its writer committed it", ErrNotFound, name)
	}
	if s != nil {
		want, what := uint32(Read|Write), "read-write"
		if readOnly {
			want, what = Read, "read"
		}
		if !allowed(c, s, want) {
			// Fail now rather than at the commit: a mode is seldom widened
			// while its segment is being written.
			return nil, nil, fmt.Errorf("%w: %s access to %q (mode %#o, owner %d:%d)", ErrPermission, what, s.name, s.mode, s.uid, s.gid)
		}
		w.seen = s
	}
	if r.waiters == nil {
		r.waiters = make(chan struct{})
	}
	return nil, r.waiters, nil
}
