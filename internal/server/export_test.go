package server

// SetMaxWorkers bounds the workers that serve connections at once (see
// defaultWorkers); call before Serve.
func (s *Server) SetMaxWorkers(n int32) { s.maxWorkers = n }
