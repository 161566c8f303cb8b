package server

// SetMaxWorkers bounds the workers that serve connections at once (see
// defaultWorkers); call before Serve.
func (s *Server) SetMaxWorkers(n int32) { s.maxWorkers = n }

// SetMaxSpinners bounds the workers that poll for a request at once (see
// defaultSpinners); call before Serve.
func (s *Server) SetMaxSpinners(n int32) { s.maxSpinners = n }

// Spinning is how many workers poll for a request now.
func (s *Server) Spinning() int32 { return s.spinning.Load() }
