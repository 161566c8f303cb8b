package segment

import (
	"encoding/json"
	"errors"
	"fmt"
	"syscall"
	"time"
)

// The operations in this file serve the FUSE view, where a segment is also
// a file: they work on a *Segment the caller found once (an inode), not only
// on a name, and they follow the rules of files in a sticky, world-writable
// directory such as /dev/shm.

// Permission bit for Access, after Read and Write.
const Exec = 1

// Rename flags, as renameat2(2) takes them.
const (
	RenameNoReplace = 1 << 0
	RenameExchange  = 1 << 1
)

// Lookup finds a named segment without taking a lease, for callers that
// keep the *Segment as an identity (the FUSE view's inodes).
func (r *Registry) Lookup(name string) (*Segment, Info, error) {
	if err := ValidName(name); err != nil {
		return nil, Info{}, err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	s, err := r.find(name)
	if err != nil {
		return nil, Info{}, err
	}
	return s, r.infoLocked(s), nil
}

// Access reports whether c may access s as want (Read, Write, Exec bits)
// says, by the segment's mode as for a file. Root may read and write
// anything, and execute what has any execute bit.
func (r *Registry) Access(c Cred, s *Segment, want uint32) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.accessLocked(c, s, want)
}

func (r *Registry) accessLocked(c Cred, s *Segment, want uint32) error {
	if s.gone {
		return fmt.Errorf("%w: segment %d was removed", ErrNotFound, s.id)
	}
	ok := allowed(c, s, want)
	if c.UID == 0 && want&Exec != 0 {
		ok = s.mode&0o111 != 0
	}
	if !ok {
		return fmt.Errorf("%w: access %o to %q (mode %#o, owner %d:%d)", ErrPermission, want, s.name, s.mode, s.uid, s.gid)
	}
	return nil
}

// Pin checks that c may access s as want says and takes a pin on s: like a
// lease, a pin keeps the memory after the name is unlinked, until Unpin;
// unlike a lease, it says that no other process maps the memory, so the
// segment may still be resized. The FUSE view pins a segment for each open
// file. A segment already retired (unlinked, last reference gone) cannot be
// pinned again.
func (r *Registry) Pin(c Cred, s *Segment, want uint32) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := r.accessLocked(c, s, want); err != nil {
		return err
	}
	if s.uncommitted {
		// Its creator is still filling it through a mapping of its own.
		return uncommittedError(s)
	}
	if s.tier == OnDisk || s.moving != nil && onDisk(s.mem) {
		// The daemon reads and writes memory, never a file of the disk
		// tier: the bytes come back to their device first, as for an open.
		if err := r.onDeviceLocked(s); err != nil {
			return err
		}
	}
	if want&Write != 0 {
		r.writtenLocked(s)
		r.grantWriteLocked(c, s)
	}
	s.pins++
	return nil
}

// Stamp tells whether bytes the daemon read from s earlier may be served
// as s's bytes now, for a reader that reads ahead (the FUSE view): they
// may if the stamp is the one taken before reading them, and quiet. The
// stamp changes with every change the daemon makes or lets a process make
// (its own writes and resizes, once done; every lease taken, before the
// descriptor goes out). quiet is false while a process may write the
// memory unseen: a socket client holds it open (a lease holder writes
// through its own mapping, and on a GPU even a read-only one can), its
// publisher kept the memfd it published, or a restart left its leases in
// doubt.
func (r *Registry) Stamp(s *Segment) (stamp uint64, quiet bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return s.changes.Load(), s.opens == 0 && s.restoredAnon == 0 && !s.doubt && !s.published && !s.gone
}

// Unpin ends one pin on s; the memory is freed when s is unlinked and this
// was its last reference.
func (r *Registry) Unpin(s *Segment) error { return r.drop(s, &s.pins, "unpin", "pin") }

// mayRemove is the sticky-directory rule: only the owner or root may
// unlink or rename a segment, or replace it by renaming over it.
func mayRemove(c Cred, s *Segment) error {
	if c.UID != 0 && c.UID != s.uid {
		return fmt.Errorf("%w: %q belongs to uid %d", ErrNotOwner, s.name, s.uid)
	}
	return nil
}

// Rename gives segment from the name to. An existing to is replaced (and
// freed once unreferenced) unless flags has RenameNoReplace; with
// RenameExchange the two names swap and both must exist. The caller must
// own from (and to, if it exists) or be root. Clients that cache mappings
// by name see the change through the changed hook.
func (r *Registry) Rename(c Cred, from, to string, flags uint32) error {
	if err := ValidName(from); err != nil {
		return err
	}
	if err := ValidName(to); err != nil {
		return err
	}
	if flags&^(RenameNoReplace|RenameExchange) != 0 || flags == RenameNoReplace|RenameExchange {
		return fmt.Errorf("rename: flags %#x: %w", flags, syscall.EINVAL)
	}
	r.mu.Lock()
	src, err := r.find(from)
	if err != nil {
		r.mu.Unlock()
		return err
	}
	// find may have let go of mu while waiting; look at to afterwards, and
	// then check src is still what from names.
	dst, err := r.find(to)
	if err != nil && !errors.Is(err, ErrNotFound) {
		r.mu.Unlock()
		return err
	}
	if r.byName[from] != src {
		r.mu.Unlock()
		return fmt.Errorf("%w: %q changed during rename", ErrNotFound, from)
	}
	if err := mayRemove(c, src); err != nil {
		r.mu.Unlock()
		return err
	}
	// An uncommitted segment is committed under the name it was made with,
	// so it keeps that name; replacing it is removing it, as unlink may.
	for _, s := range []*Segment{src, dst} {
		if s != nil && s.uncommitted && (s == src || flags&RenameExchange != 0) {
			r.mu.Unlock()
			return fmt.Errorf("rename: %q is not committed yet: %w", s.name, syscall.EBUSY)
		}
	}
	if src == dst {
		r.mu.Unlock()
		return nil
	}
	switch {
	case flags&RenameExchange != 0:
		if dst == nil {
			r.mu.Unlock()
			return fmt.Errorf("%w: %q (exchange needs both names)", ErrNotFound, to)
		}
		if err := mayRemove(c, dst); err != nil {
			r.mu.Unlock()
			return err
		}
		r.byName[from], r.byName[to] = dst, src
		src.name, dst.name = to, from
		r.changed()
		r.beginBatchLocked()
		r.noteLocked(src, -1)
		r.noteLocked(dst, -1)
		r.endBatchLocked()
		r.mu.Unlock()
		r.waitDisk(src, dst)
		return nil
	case dst != nil && flags&RenameNoReplace != 0:
		r.mu.Unlock()
		return fmt.Errorf("%w: %q", ErrExist, to)
	}
	if dst != nil {
		if err := mayRemove(c, dst); err != nil {
			r.mu.Unlock()
			return err
		}
	}
	// The target's end and the move are one change to the journal: a
	// restart after it finds both done, or neither.
	r.beginBatchLocked()
	var mem Memory
	if dst != nil {
		dst.linked = false
		mem = r.unlinkedLocked(dst)
	}
	delete(r.byName, from)
	r.byName[to] = src
	src.name = to
	r.changed()
	r.noteLocked(src, -1)
	r.endBatchLocked()
	r.mu.Unlock()
	var ferr error
	if dst != nil {
		r.channelRemoved(dst)
		ferr = dst.free(mem)
	}
	// Durable copies' records say what the names are now, and the
	// replaced target's copy is gone, before rename returns (Unlink).
	r.waitDisk(src, dst)
	return ferr
}

// SetMode changes s's permission bits. Only the owner or root may.
func (r *Registry) SetMode(c Cred, s *Segment, mode uint32) error {
	if mode&^0o777 != 0 {
		return fmt.Errorf("%w: %#o (permission bits only)", ErrBadMode, mode)
	}
	r.mu.Lock()
	if err := r.ownerLocked(c, s); err != nil {
		r.mu.Unlock()
		return err
	}
	if s.mode != mode {
		s.mode = mode
		// A client may reuse a cached open without asking again; make it
		// ask, so that a narrower mode takes effect.
		r.changed()
		r.noteLocked(s, -1)
	}
	r.mu.Unlock()
	// A durable copy's record has the new mode before chmod returns: a
	// reboot must not serve the segment with the mode it was narrowed
	// from.
	r.waitDisk(s)
	return nil
}

// SetOwner changes s's owner: uid or gid < 0 leaves that one alone. As for
// files, only root may give a segment away; the owner may change its group
// to its own (primary) group.
func (r *Registry) SetOwner(c Cred, s *Segment, uid, gid int64) error {
	if uid > int64(^uint32(0)) || gid > int64(^uint32(0)) {
		return fmt.Errorf("%w: uid %d, gid %d (at most %d)", ErrBadOwner, uid, gid, ^uint32(0))
	}
	r.mu.Lock()
	err := r.setOwnerLocked(c, s, uid, gid)
	r.mu.Unlock()
	if err != nil {
		return err
	}
	r.waitDisk(s) // as SetMode
	return nil
}

func (r *Registry) setOwnerLocked(c Cred, s *Segment, uid, gid int64) error {
	if s.gone {
		return fmt.Errorf("%w: segment %d was removed", ErrNotFound, s.id)
	}
	if c.UID != 0 {
		switch {
		case uid >= 0 && uint32(uid) != s.uid:
			return fmt.Errorf("%w: only root may change the owner of %q", ErrNotOwner, s.name)
		case gid >= 0 && uint32(gid) != s.gid && (c.UID != s.uid || uint32(gid) != c.GID):
			return fmt.Errorf("%w: only root, or the owner to its own group, may change the group of %q", ErrNotOwner, s.name)
		}
	}
	changed := false
	if uid >= 0 && uint32(uid) != s.uid {
		s.uid, changed = uint32(uid), true
	}
	if gid >= 0 && uint32(gid) != s.gid {
		s.gid, changed = uint32(gid), true
	}
	if changed {
		// Whoever held write access under the old owner may still write:
		// the files' ranges were trusted for the old owner's sake.
		s.foreign, s.sources = true, nil
		r.changed()
		r.noteLocked(s, -1)
	}
	return nil
}

// SetTimes sets s's modification time. As utimensat(2) has it, the owner
// or root may set any time; setting it to now (now true) is also allowed to
// whoever may write.
func (r *Registry) SetTimes(c Cred, s *Segment, t time.Time, now bool) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := r.ownerLocked(c, s); err != nil {
		if !now || r.accessLocked(c, s, Write) != nil {
			return err
		}
	}
	s.modified = t
	r.noteLocked(s, -1)
	return nil
}

// SetMeta replaces s's user metadata (JSON; empty removes it). Only the
// owner or root may.
func (r *Registry) SetMeta(c Cred, s *Segment, meta json.RawMessage) error {
	if len(meta) > 0 && !json.Valid(meta) {
		return fmt.Errorf("%w: not valid JSON", ErrBadMeta)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := r.ownerLocked(c, s); err != nil {
		return err
	}
	if len(meta) == 0 {
		s.meta = nil
	} else {
		s.meta = append(json.RawMessage(nil), meta...)
	}
	r.noteLocked(s, -1)
	return nil
}

func (r *Registry) ownerLocked(c Cred, s *Segment) error {
	if s.gone {
		return fmt.Errorf("%w: segment %d was removed", ErrNotFound, s.id)
	}
	if c.UID != 0 && c.UID != s.uid {
		return fmt.Errorf("%w: %q belongs to uid %d", ErrNotOwner, s.name, s.uid)
	}
	return nil
}

// Memory returns s's memory, for a copy into or out of it while the
// caller holds a lease or a pin on s (which keeps the memory from being
// freed or replaced); nil for a segment without memory.
func (r *Registry) Memory(s *Segment) Memory {
	r.mu.Lock()
	defer r.mu.Unlock()
	return s.mem
}
