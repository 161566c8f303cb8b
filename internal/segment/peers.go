package segment

// Offers to peers: a segment its owner offers is listed to the daemon's
// peers on other nodes (internal/peer), who may pull it. Nothing is offered
// unless its owner says so.

// SetOffer offers the named segment to the daemon's peers (on) or takes
// it back, and describes it then. The owner or root may; it is journaled.
func (r *Registry) SetOffer(c Cred, name string, on bool) (Info, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	s, err := r.findOwned(c, name)
	if err != nil {
		return Info{}, err
	}
	if s.offer != on && !s.gone {
		s.offer = on
		r.noteLocked(s, -1)
	}
	return r.infoLocked(s), nil
}

// Offers describes the segments offered to peers that a peer may be told
// of: named, committed, not orphaned, not channels.
func (r *Registry) Offers() []Info {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []Info
	for _, s := range r.byName {
		if s.offer && s.linked && !s.uncommitted && s.orphan == "" && s.slots == 0 && !s.gone {
			out = append(out, r.infoLocked(s))
		}
	}
	return out
}
