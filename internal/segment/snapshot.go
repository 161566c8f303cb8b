package segment

// Segments describes every segment holding memory, named or unlinked but
// still open, in no particular order, without metadata. For metrics.
func (r *Registry) Segments() []Info {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]Info, 0, len(r.byID))
	for _, s := range r.byID {
		inf := r.infoLocked(s)
		inf.Meta = nil
		out = append(out, inf)
	}
	return out
}
