package bench

import "syscall"

// RaiseNofile raises this process's descriptor limit for a benchmark or a
// test that holds many connections: the soft limit to the hard one, and
// both to want where the process may (as root). It returns the soft limit
// now; processes started from here, a daemon among them, inherit it.
// (The daemon itself only takes its hard limit: raiseNOFILE.)
func RaiseNofile(want uint64) (uint64, error) {
	var l syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &l); err != nil {
		return 0, err
	}
	if want > l.Max {
		n := syscall.Rlimit{Cur: want, Max: want}
		if syscall.Setrlimit(syscall.RLIMIT_NOFILE, &n) == nil {
			return want, nil
		}
	}
	if l.Cur < l.Max {
		n := syscall.Rlimit{Cur: l.Max, Max: l.Max}
		if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &n); err != nil {
			return l.Cur, err
		}
		return l.Max, nil
	}
	return l.Cur, nil
}
