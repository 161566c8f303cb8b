package segment

import (
	"fmt"
	"time"
)

// The operations on tiers that clients ask for by name: evict, load, pin
// (tier.go has the moves themselves, disk.go the disk tier's).

// Evict moves the named segment to host memory now, and describes it
// then. The owner or root may; a segment already on host is left there.
func (r *Registry) Evict(c Cred, name string) (Info, error) { return r.EvictTo(c, name, OnHost) }

// EvictTo moves the named segment to host memory (a segment already
// there, or on disk, is left there) or to disk (from its device or from
// host memory), and describes it then. The owner or root may.
func (r *Registry) EvictTo(c Cred, name string, to Tier) (Info, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	s, err := r.findOwned(c, name)
	if err != nil {
		return Info{}, err
	}
	for s.moving != nil {
		r.waitLocked(s.moving)
	}
	if s.gone {
		return Info{}, fmt.Errorf("%w: %q was removed", ErrNotFound, name)
	}
	switch {
	case to == OnDisk && s.tier != OnDisk:
		err = r.toDiskLocked(s)
	case to == OnHost && s.tier == OnDevice:
		err = r.evictLocked(s)
	}
	if err != nil {
		return Info{}, err
	}
	return r.infoLocked(s), nil
}

// Load brings the named segment back to its device ahead of an open (a
// prefetch); it counts as an open for the order of eviction. Read access
// is enough.
func (r *Registry) Load(c Cred, name string) (Info, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	s, err := r.findNamed(name)
	if err != nil {
		return Info{}, err
	}
	if !allowed(c, s, Read) {
		return Info{}, fmt.Errorf("%w: read access to %q (mode %#o, owner %d:%d)", ErrPermission, s.name, s.mode, s.uid, s.gid)
	}
	if s.orphan != "" {
		return Info{}, fmt.Errorf("%w: %q: %s", ErrOrphan, s.name, s.orphan)
	}
	if s.mem == nil {
		return Info{}, fmt.Errorf("%w: %q has no memory yet", ErrEmpty, s.name)
	}
	if err := r.onDeviceLocked(s); err != nil {
		return Info{}, err
	}
	s.lastOpen = time.Now()
	return r.infoLocked(s), nil
}

// SetResident pins s to its device (on) or lets it move again. Pinning a
// segment on host restores it first. The owner or root may; it is
// journaled.
func (r *Registry) SetResident(c Cred, name string, on bool) (Info, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	s, err := r.findOwned(c, name)
	if err != nil {
		return Info{}, err
	}
	if on && s.mem != nil && s.orphan == "" {
		if err := r.onDeviceLocked(s); err != nil {
			return Info{}, err
		}
	}
	if s.resident != on && !s.gone {
		s.resident = on
		r.noteLocked(s, -1)
	}
	return r.infoLocked(s), nil
}

// findNamed checks name and finds its segment; mu is held (find may
// drop it while a creation finishes).
func (r *Registry) findNamed(name string) (*Segment, error) {
	if err := ValidName(name); err != nil {
		return nil, err
	}
	return r.find(name)
}

// findOwned is findNamed for a change only the owner or root may make.
func (r *Registry) findOwned(c Cred, name string) (*Segment, error) {
	s, err := r.findNamed(name)
	if err != nil {
		return nil, err
	}
	if err := mayRemove(c, s); err != nil {
		return nil, err
	}
	return s, nil
}

// WouldRestore reports whether opening name now would wait for its bytes
// to come back from host memory (or for a move to end): the server lets
// such an open leave its worker.
func (r *Registry) WouldRestore(name string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	s := r.byName[name]
	return s != nil && (s.tier == OnHost || s.moving != nil)
}
