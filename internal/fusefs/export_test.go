package fusefs

// SetLendReads sets whether views mounted from now on lend host memory to
// their replies; off, they read ahead instead, as on GPU memory. It
// returns the setting to restore.
func SetLendReads(on bool) (was bool) {
	was, lendReads = lendReads, on
	return was
}

// ReadAheadServed counts the requests s answered from bytes read ahead.
func ReadAheadServed(s *Server) int64 { return s.fs.raServed.Load() }
