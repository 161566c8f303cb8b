package segment

import (
	"cmp"
	"encoding/json"
	"fmt"
	"slices"
)

// Versions: a writer makes the next version of a name as it makes any
// segment it fills before others read it (Uncommitted), with NextVersion:
// the new segment takes no name while its writer fills it, so readers of
// the name keep the current version. Commit then makes it current in one
// journaled step: the name names the new segment, the one it named loses
// its name (as after a rename over it) and is freed once its last reader
// closed it or moved on. A writer that dies before its commit leaves the
// current version in place, and its own goes as any uncommitted segment
// does. Readers learn of the change from the epoch page, which every
// change of what a name names moves, or by waiting for it (WaitVersion).
//
// A next version is bound to the segment its name named when it was made
// (replaces; none, for a name that named nothing): its commit replaces
// that segment and no other, and only for a committer who may remove it
// then. Without the binding a next version made of a name nobody had, or
// of the writer's own name that it then unlinked or renamed away, would
// take over whatever the name names at the commit, root's included; and a
// segment given away since (chown) would still be replaced by its former
// owner. Two writers of one version race as rename(2) with a check does:
// the first commit wins, the second is refused.

// VersionInfo is an earlier version of a name that someone still holds.
type VersionInfo struct {
	ID      uint64
	Version uint64
	Opens   int
	// PIDs are the processes holding it that the daemon could name.
	PIDs []int
}

type replacedVersion struct {
	s   *Segment
	mem Memory
}

// mayReplace checks that c may make a next version of cur, the name's
// current segment (nil: the name names none yet).
func mayReplace(c Cred, cur *Segment) error {
	switch {
	case cur == nil:
		return nil
	case cur.uncommitted:
		return uncommittedError(cur)
	case cur.slots > 0:
		return fmt.Errorf("%w: %q is a channel, which has no versions", ErrBadOption, cur.name)
	case cur.orphan != "":
		return fmt.Errorf("%w: %q: %s ('gpushm rm %s' removes it)", ErrOrphan, cur.name, cur.orphan, cur.name)
	}
	if err := mayRemove(c, cur); err != nil {
		return fmt.Errorf("%w (a next version replaces it)", err)
	}
	return nil
}

// nextByOriginLocked finds the next version a create with origin made: its
// first attempt was applied and the reply lost.
func (r *Registry) nextByOriginLocked(origin string) *Segment {
	if origin == "" {
		return nil
	}
	for _, s := range r.byID {
		if s.next && s.origin == origin && !s.gone {
			return s
		}
	}
	return nil
}

// makeCurrentLocked is Commit of a next version by c: s takes its name
// from the segment that has it, if any, in one journaled step. mu is held;
// Commit frees the replaced version's memory after letting go of it.
func (r *Registry) makeCurrentLocked(c Cred, s *Segment, origin string, meta json.RawMessage) error {
	cur := r.byName[s.name]
	if cur != nil && cur.creating {
		// A plain create of the name is in progress: it got there first.
		return fmt.Errorf("%w: %q is being created", ErrExist, s.name)
	}
	if err := stillReplaces(s, cur); err != nil {
		return err
	}
	if cur != nil && (cur.uncommitted || cur.slots > 0 || cur.orphan != "") {
		return fmt.Errorf("%w: %q is no longer a segment a version can replace: %w", ErrBadOption, s.name, mayReplace(Cred{}, cur))
	}
	if cur != nil {
		// Checked at the create too; the owner may have changed since.
		if err := mayRemove(c, cur); err != nil {
			return fmt.Errorf("%w (its next version replaces it, so the committer must be allowed to remove it; this version stays uncommitted: close it)", err)
		}
	}
	s.version = 1
	r.beginBatchLocked()
	if cur != nil {
		s.version = max(cur.version, 1) + 1
		// A durable name stays durable; its old copy goes once the new
		// one is on disk.
		s.persist = s.persist || cur.persist
		if s.persist {
			cur.heldBy = s
		}
		delete(r.byName, cur.name)
		cur.linked = false
		if mem := r.unlinkedLocked(cur); mem != nil {
			r.replaced = &replacedVersion{cur, mem}
		}
	}
	s.next, s.uncommitted, s.linked = false, false, true
	s.commitOrigin = origin
	if len(meta) > 0 {
		s.meta = append(json.RawMessage(nil), meta...)
	}
	r.byName[s.name] = s
	r.noteLocked(s, -1)
	r.endBatchLocked()
	if s.persist && r.tiers.cfg.Disk != nil {
		r.syncLater(s)
	}
	// Moves the epoch (clients' cached opens of the name are stale now)
	// and wakes WaitVersion.
	r.changed()
	return nil
}

// stillReplaces checks that the name of the next version s names what s
// was made to replace (cur, nil for nothing): a version made against one
// segment never replaces another, nor names a name whose segment went.
func stillReplaces(s *Segment, cur *Segment) error {
	const redo = "this version stays uncommitted: close it, and make a next version of the name as it is now"
	switch {
	case cur == nil && s.replaces == 0, cur != nil && cur.id == s.replaces:
		return nil
	case s.replaces == 0:
		return fmt.Errorf("%w: %q names segment %d now, made after this next version, which was made when the name named nothing and replaces nothing else; %s",
			ErrExist, s.name, cur.id, redo)
	case cur == nil:
		return fmt.Errorf("%w: %q no longer names segment %d, the version this one was made to replace (it was unlinked or renamed), and names nothing now; %s",
			ErrNotFound, s.name, s.replaces, redo)
	}
	return fmt.Errorf("%w: %q names segment %d now, not segment %d, the version this one was made to replace (it was unlinked, renamed or replaced since); %s",
		ErrExist, s.name, cur.id, s.replaces, redo)
}

// WaitVersion reports the segment name names when it is not the one with
// ID id (a reader's version): ready true and its Info. Otherwise it
// returns a channel closed at the next change that may alter that; the
// caller waits on it (with its own deadline) and asks again. An
// uncommitted segment under the name counts as no change.
func (r *Registry) WaitVersion(name string, id uint64) (inf Info, ready bool, changed <-chan struct{}, err error) {
	if err := ValidName(name); err != nil {
		return Info{}, false, nil, err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	s, err := r.find(name)
	if err != nil {
		return Info{}, false, nil, err
	}
	if s.id != id && !s.uncommitted {
		return r.infoLocked(s), true, nil, nil
	}
	if r.waiters == nil {
		r.waiters = make(chan struct{})
	}
	return Info{}, false, r.waiters, nil
}

// versionsLocked lists the earlier versions of cur's name that are still
// held, oldest first.
func (r *Registry) versionsLocked(cur *Segment) []VersionInfo {
	var out []VersionInfo
	for _, s := range r.byID {
		if s == cur || s.linked || s.next || s.gone || s.name != cur.name || s.slots > 0 {
			continue
		}
		v := VersionInfo{ID: s.id, Version: max(s.version, 1), Opens: s.opens}
		for k := range s.holders {
			v.PIDs = append(v.PIDs, k.proc.PID)
		}
		for k := range s.restored {
			v.PIDs = append(v.PIDs, k.proc.PID)
		}
		slices.Sort(v.PIDs)
		v.PIDs = slices.Compact(v.PIDs)
		out = append(out, v)
	}
	slices.SortFunc(out, func(a, b VersionInfo) int { return cmp.Compare(a.ID, b.ID) })
	return out
}
