package server

// SetMaxWorkers bounds the workers that serve connections at once (see
// defaultWorkers); call before Serve.
func (s *Server) SetMaxWorkers(n int32) { s.maxWorkers = n }

// SetMaxSpinners bounds the workers that poll for a request at once (see
// defaultSpinners); call before Serve.
func (s *Server) SetMaxSpinners(n int32) { s.maxSpinners = n }

// Spinning is how many workers poll for a request now.
func (s *Server) Spinning() int32 { return s.spinning.Load() }

// SpinningFor is how many workers poll for uid's connections now.
func (s *Server) SpinningFor(uid uint32) int32 {
	s.mu.Lock()
	spins := s.userSpins[uid]
	s.mu.Unlock()
	if spins == nil {
		return 0
	}
	return spins.Load()
}
