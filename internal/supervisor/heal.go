package supervisor

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"strconv"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm/internal/wire"
)

// A supervisor is a process like any other, and SIGKILL ends it. The
// serving process holds the same descriptors it does (every segment's
// memory and control block in its registry; the listener, the epoch page
// and the daemon lock beside it), so when its supervisor dies it starts a
// new one: this binary again, exec'd (never a bare fork: the serving
// process may hold a CUDA context), in a session of its own so that it
// outlives the serving process. It hands it what the journal would have:
// every record with its descriptors, then "handed". The new supervisor
// adopts the running serving process (handover.go) and is from then on its
// supervisor in every way: it restarts it when it dies, upgrades it on
// SIGHUP, stops everything on SIGTERM.
//
// What the dead supervisor had not read yet died with it, but the
// registry has it all, so the new supervisor gets the whole state
// (Registry.Replay), not what went missing. Changes made while there is no
// supervisor are dropped (the replay carries them). Once the new one reads
// its control socket, the journal goes to it again, and the replay
// follows: a change journaled between the two is applied twice, which is
// harmless (a record is replaced by itself or a newer one, a deletion of
// what is gone does nothing). The replay holds the registry's lock while
// the new supervisor reads it, so changes wait that long (a pause that
// grows with the number of segments), and no descriptor has to be
// duplicated to wait for it: a registry near the descriptor limit could
// not hold a second copy of each.

// Healing is what Link.Heal needs from the serving process.
type Healing struct {
	// Replay puts every record to the journal (the Link) again and
	// returns the highest ID ever given out: Registry.Replay.
	Replay func() uint64
	// Adopted is told the new supervisor's pid once it holds everything.
	Adopted func(pid int)
	// Restarts is passed on, so that info's count goes on.
	Restarts int
	Log      *slog.Logger
}

// healing is a Link's state for replacing its supervisor; the Link's mu
// guards confirmed.
type healing struct {
	Healing
	wake      chan struct{} // one token: the supervisor is gone
	started   chan struct{} // closed by Heal: the callbacks are set
	confirmed bool          // the last supervisor started said "adopted"
}

// handshakeTimeout bounds the wait for a new supervisor to start reading,
// and each send to it while it takes the state: one that does neither is
// given up, and another started.
const handshakeTimeout = 30 * time.Second

// Heal lets this serving process replace its supervisor if it dies.
// Call it once the registry is journaling to l and restored; a supervisor
// lost before is replaced now. It does nothing unless the supervisor
// allowed it (Start.Heal).
func (l *Link) Heal(h Healing) {
	if h.Log == nil {
		h.Log = slog.Default()
	}
	l.mu.Lock()
	hl := l.heal
	if hl != nil {
		hl.Healing = h
	}
	l.mu.Unlock()
	if hl == nil {
		return
	}
	close(hl.started)
	go l.healLoop(hl)
}

// journalLocked sends one journal message to the supervisor; with none
// it is dropped, since the next one gets the whole state. l.mu is held.
func (l *Link) journalLocked(m msg, fd int) {
	b, err := json.Marshal(m)
	if err != nil && l.conn != nil {
		l.lostLocked(l.conn, fmt.Errorf("journal %s of segment %d: %w", m.T, m.ID, err))
		return
	}
	l.journalBytesLocked(m.T, m.ID, b, fd)
}

// journalBytesLocked sends b, a journal message of type t about segment
// id, encoded. l.mu is held.
func (l *Link) journalBytesLocked(t string, id uint64, b []byte, fd int) {
	if l.conn == nil {
		return
	}
	if err := sendBytes(l.conn, t, b, fd); err != nil {
		l.lostLocked(l.conn, fmt.Errorf("journal %s of segment %d: %w", t, id, err))
	}
}

// lostLocked handles the end of the control socket c: unless this process
// may replace its supervisor, it cannot keep its promises and Lost ends it.
// A process that parked its connections for a successor, or was told to
// exit, is not in a state to serve alone, and ends too. l.mu is held.
func (l *Link) lostLocked(c *wire.Conn, err error) {
	if c != l.conn {
		return // a supervisor already given up
	}
	if l.heal == nil || l.parked || l.ending {
		l.Lost(err)
		return
	}
	c.Shutdown() // its reader sees EOF and closes it
	l.conn = nil
	select {
	case l.heal.wake <- struct{}{}:
	default:
	}
}

// healLoop starts a supervisor each time the last one is gone. One that
// dies before it adopted this process is retried after a pause that
// doubles up to 5s, as the supervisor does for a serving process that
// dies at start.
func (l *Link) healLoop(h *healing) {
	delay := time.Duration(0)
	for range h.wake {
		l.mu.Lock()
		if h.confirmed {
			delay = 0
		}
		h.confirmed = false
		l.mu.Unlock()
		for {
			if delay > 0 {
				time.Sleep(delay)
			}
			h.Log.Warn("the supervisor died; starting a new one", "after", delay)
			err := l.replace(h)
			delay = min(max(2*delay, 100*time.Millisecond), 5*time.Second)
			if err == nil {
				break
			}
			h.Log.Error("start a new supervisor; trying again", "err", err, "in", delay)
		}
	}
}

// replace starts a new supervisor and hands it the state. A new supervisor
// lost during the handover (its death wakes healLoop again) is no error.
func (l *Link) replace(h *healing) error {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("control socket: %w", err)
	}
	ours, err := controlConn(fds[0])
	if err != nil {
		unix.Close(fds[0])
		unix.Close(fds[1])
		return err
	}
	theirs := os.NewFile(uintptr(fds[1]), "control")
	defer theirs.Close()
	timeout := unix.NsecToTimeval(handshakeTimeout.Nanoseconds())
	unix.SetsockoptTimeval(fds[0], unix.SOL_SOCKET, unix.SO_SNDTIMEO, &timeout)
	unix.SetsockoptTimeval(fds[0], unix.SOL_SOCKET, unix.SO_RCVTIMEO, &timeout)
	pidfd, err := unix.PidfdOpen(os.Getpid(), 0)
	if err != nil {
		ours.Close()
		return fmt.Errorf("pidfd_open: %w", err)
	}
	self := os.NewFile(uintptr(pidfd), "pidfd")
	defer self.Close()
	cmd := &exec.Cmd{
		// This very binary: it speaks this process's control protocol,
		// whatever is on disk now. An upgrade reads the disk again.
		Path: "/proc/self/exe",
		// A supervisor's name, not this process's (name.go), and the
		// daemon's flags.
		Args:       append([]string{SupervisorName}, os.Args[1:]...),
		Env:        append(childEnv(), envAdopt+"="+strconv.Itoa(os.Getpid())),
		Stdout:     os.Stdout,
		Stderr:     os.Stderr,
		ExtraFiles: []*os.File{theirs, l.listener, l.epoch, l.lock, self},
		// A session of its own: it must outlive this process, and a
		// terminal's hang-up or ^C is not meant for it.
		SysProcAttr: &syscall.SysProcAttr{Setsid: true},
	}
	// Descriptors opened without close-on-exec (go-fuse's /dev/fuse is
	// one) must not reach it: a FUSE connection it held would outlive this
	// process and hang the next one's mount.
	closeOnExecAll()
	if err := cmd.Start(); err != nil {
		ours.Close()
		return fmt.Errorf("start a supervisor: %w", err)
	}
	go cmd.Wait() // it is our child until this process ends: reap it
	pid := cmd.Process.Pid

	// It says when it reads; the journal goes to it from then on, and the
	// replay after.
	m, fd, err := recv(ours)
	closeFD(fd)
	if err == nil && m.T != tInit {
		err = fmt.Errorf("%w: %q first", wire.ErrProto, m.T)
	}
	if err != nil {
		ours.Close()
		cmd.Process.Kill()
		return fmt.Errorf("new supervisor %d: %w", pid, err)
	}
	none := unix.Timeval{}
	unix.SetsockoptTimeval(fds[0], unix.SOL_SOCKET, unix.SO_RCVTIMEO, &none)
	l.mu.Lock()
	l.conn = ours
	// The dead supervisor's record table goes with it: the replay puts
	// every record by message, and the new supervisor (this binary, with
	// the same flags) gets a table of its own once it has them.
	if l.table != nil {
		l.table.close()
		l.table = nil
	}
	l.mu.Unlock()
	l.startReading(ours)
	next := h.Replay()

	l.mu.Lock()
	defer l.mu.Unlock()
	if l.conn == ours {
		if l.tables {
			l.startTableLocked()
		}
		err := send(ours, msg{T: tHanded, NextID: next, Restarts: h.Restarts, PID: os.Getpid()}, -1)
		if err == nil {
			unix.SetsockoptTimeval(fds[0], unix.SOL_SOCKET, unix.SO_SNDTIMEO, &none)
			h.Log.Info("handed everything to a new supervisor", "pid", pid)
			return nil
		}
		l.lostLocked(ours, fmt.Errorf("hand the state to supervisor %d: %w", pid, err))
	}
	cmd.Process.Kill()
	return nil
}

// adopted notes that the supervisor at the other end holds everything.
func (h *healing) adopted(l *Link, pid int) {
	select {
	case <-h.started:
	default:
		return // not ours: no supervisor was started
	}
	l.mu.Lock()
	h.confirmed = true
	l.mu.Unlock()
	h.Log.Info("a new supervisor holds every segment", "pid", pid)
	if h.Adopted != nil {
		h.Adopted(pid)
	}
}

// errNoSupervisor is what a control message meets while no supervisor is
// there to take it.
var errNoSupervisor = errors.New("no supervisor")

// closeOnExecAll marks every descriptor from 3 on close-on-exec; those a
// child is meant to have are dup'd into it by exec.Cmd.
func closeOnExecAll() {
	if unix.CloseRange(3, ^uint(0), unix.CLOSE_RANGE_CLOEXEC) == nil {
		return
	}
	// Before Linux 5.11.
	ents, _ := os.ReadDir("/proc/self/fd")
	for _, e := range ents {
		if fd, err := strconv.Atoi(e.Name()); err == nil && fd >= 3 {
			unix.CloseOnExec(fd)
		}
	}
}
