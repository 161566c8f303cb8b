package server

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"strconv"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/wire"
)

// Processes outlive connections: after a serving process crashed, a client
// process lives on without a connection to the new one until its next
// call. What such a process holds (a channel's role, its creator-bound
// segments) ends when the process ends, which its pidfd tells, not when a
// timer guesses that it did. A process is named by its pid and its start
// time (segment.Process), so that one that reuses the pid is not taken for
// it.

// procStart is a process's start time (clock ticks after boot, field 22
// of /proc/PID/stat): with the pid, it names one process, not whatever
// reuses the pid later.
func procStart(pid int) (uint64, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, err
	}
	// The command name (field 2) is in parentheses and may hold spaces.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, fmt.Errorf("/proc/%d/stat: unreadable", pid)
	}
	f := bytes.Fields(b[i+1:])
	if len(f) < 20 {
		return 0, fmt.Errorf("/proc/%d/stat: unreadable", pid)
	}
	return strconv.ParseUint(string(f[19]), 10, 64)
}

// identify names the process pid is now (for a process recorded earlier:
// is it still the one?). A pid of 0 or an unreadable /proc gives an
// unknown process. A connection's process is named at accept
// (peerProcess), never by identify.
func identify(pid int) segment.Process {
	if pid <= 0 {
		return segment.Process{}
	}
	start, err := procStart(pid)
	if err != nil {
		return segment.Process{PID: pid}
	}
	return segment.Process{PID: pid, Start: start}
}

// Self names this process, for what the daemon makes itself that must
// not outlive it (a pull's uncommitted segment): a restarted serving
// process ends it at once, as it ends what a client that died while the
// daemon was down had made (StartGrace).
func Self() segment.Process { return identify(os.Getpid()) }

// peerProcess names the process that made the connection wc, whose
// SO_PEERCRED pid is pid, as the connection is accepted: never later,
// since a connection handed to another process (SCM_RIGHTS, a fork) after
// the first one exited would otherwise be taken for whatever process
// reuses the pid. The kernel's SO_PEERPIDFD (Linux 6.5+) is a pidfd of the
// process that connected: the start time read in /proc is that process's
// if the pidfd shows it alive after the read (it held the pid throughout).
// Without SO_PEERPIDFD a pidfd_open of pid does the same, for a process
// that has not exited before the accept. A process already gone, one of a
// pid namespace the daemon cannot see (pid 0), or an unreadable /proc give
// an unknown process: what it makes that must outlive the serving process
// ends with the grace period after a restart, as for any client that
// cannot be watched. The pidfd is closed before peerProcess returns: the
// pid and the start time name the process from then on (openProcess), and
// an idle connection costs no second descriptor.
func peerProcess(wc *wire.Conn, pid int) segment.Process {
	if pid <= 0 {
		return segment.Process{}
	}
	fd, err := wc.PeerPidfd()
	if errors.Is(err, wire.ErrNoPeerPidfd) {
		fd, err = unix.PidfdOpen(pid, 0)
	}
	if err != nil {
		// Gone already (a reaped peer, on a kernel that gives no pidfd
		// of one): never look its pid up, which may be another's now.
		return segment.Process{PID: pid}
	}
	defer unix.Close(fd)
	start, err := procStart(pid)
	if err != nil || exited(fd) {
		return segment.Process{PID: pid}
	}
	return segment.Process{PID: pid, Start: start}
}

// errExited: the process has exited, or its pid names another process now.
var errExited = errors.New("the process has exited")

// openProcess opens a pidfd of p, non-blocking (for Go's poller). The pidfd
// is opened before the start time is read: when it matches, the process
// the pidfd refers to is p, which held the pid before and after. It fails
// with errExited when p is gone, and with another error when that cannot
// be known (pidfds unsupported, p unknown).
func openProcess(p segment.Process) (*os.File, error) {
	if !p.Known() {
		return nil, fmt.Errorf("process %d: unknown start time", p.PID)
	}
	fd, err := unix.PidfdOpen(p.PID, unix.PIDFD_NONBLOCK)
	if errors.Is(err, unix.ESRCH) {
		return nil, errExited
	}
	if err != nil {
		return nil, fmt.Errorf("pidfd_open %d: %w", p.PID, err)
	}
	start, err := procStart(p.PID)
	switch {
	case err == nil && start != p.Start:
		err = errExited
	case err != nil && exited(fd):
		err = errExited // reaped while we read
	}
	if err != nil {
		unix.Close(fd)
		return nil, err
	}
	return os.NewFile(uintptr(fd), "pidfd:"+strconv.Itoa(p.PID)), nil
}

// exited reports whether the process of a pidfd has exited (the pidfd is
// readable), without waiting.
func exited(pidfd int) bool {
	fds := []unix.PollFd{{Fd: int32(pidfd), Events: unix.POLLIN}}
	for {
		n, err := unix.Poll(fds, 0)
		if err == unix.EINTR {
			continue
		}
		return err == nil && n > 0
	}
}

// exitWatch is a watched process: its pidfd, and what to do when it
// exits, by key.
type exitWatch struct {
	f   *os.File
	fns map[any]func()
}

// onExit runs fn, in a goroutine of the server's, once p has exited; not
// if the server stops first. A later onExit of the same p and key replaces
// fn. One pidfd serves every fn of a process, and waiting costs a
// goroutine parked in Go's poller, not a thread. It returns errExited,
// without running fn, if p is gone already, and another error if p cannot
// be watched.
func (s *Server) onExit(p segment.Process, key any, fn func()) error {
	s.mu.Lock()
	if w := s.exits[p]; w != nil {
		w.fns[key] = fn
		s.mu.Unlock()
		return nil
	}
	s.mu.Unlock()
	f, err := openProcess(p)
	if err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if w := s.exits[p]; w != nil {
		w.fns[key] = fn
		f.Close()
		return nil
	}
	if s.exits == nil {
		s.exits = make(map[segment.Process]*exitWatch)
	}
	w := &exitWatch{f: f, fns: map[any]func(){key: fn}}
	s.exits[p] = w
	s.watchers.Add(1)
	go s.waitExit(p, w)
	return nil
}

// waitExit waits for w's process to exit and runs its functions; while the
// server is parked it keeps them for Resume (a successor that takes over
// checks the processes again itself).
func (s *Server) waitExit(p segment.Process, w *exitWatch) {
	defer s.watchers.Done()
	defer w.f.Close()
	rc, err := w.f.SyscallConn()
	if err == nil {
		// Read waits in the poller until the pidfd is readable, and asks
		// again: it returns once the function says it is done.
		err = rc.Read(func(fd uintptr) bool { return exited(int(fd)) })
	}
	s.mu.Lock()
	stopped := s.exits[p] != w // stopWatching took it
	if !stopped {
		delete(s.exits, p)
	}
	fns := make([]func(), 0, len(w.fns))
	for _, fn := range w.fns {
		fns = append(fns, fn)
	}
	if err == nil && !stopped && s.parking {
		s.exitedParked = append(s.exitedParked, fns...)
		fns = nil
	}
	s.mu.Unlock()
	if stopped {
		return
	}
	if err != nil {
		// Not expected of a pidfd; the connections still end what they
		// hold, and the next restart looks at the process again.
		s.log.Error("cannot wait for a client process to exit", "pid", p.PID, "err", err)
		return
	}
	for _, fn := range fns {
		fn()
	}
}

// stopWatching ends every wait for a process, without running what waited,
// and waits for the goroutines; for a server that stops.
func (s *Server) stopWatching() {
	s.mu.Lock()
	for _, w := range s.exits {
		w.f.Close() // wakes its waitExit
	}
	s.exits = nil
	s.mu.Unlock()
	s.watchers.Wait()
}
