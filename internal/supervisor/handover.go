package supervisor

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm/internal/wire"
)

// Adopting reports whether this process was started by a serving process
// whose supervisor died, to be its supervisor (heal.go).
func Adopting() bool { return os.Getenv(envAdopt) != "" }

// Handover is what a serving process whose supervisor died passes to the
// one it starts: the descriptors a supervisor holds beside the segments,
// and the serving process itself. The segments come over the control
// socket when Run adopts it.
type Handover struct {
	Listener, Epoch, Lock *os.File
	conn                  *wire.Conn
	pidfd                 int
	pid                   int
}

// ErrHandover wraps what went wrong while adopting a serving process that
// is still alive: it serves on, and starts another supervisor, so the
// socket file and the lock are still its.
var ErrHandover = errors.New("adopt the serving process")

// TakeHandover takes over the descriptors a serving process passed.
func TakeHandover() (*Handover, error) {
	v := os.Getenv(envAdopt)
	os.Unsetenv(envAdopt)
	pid, err := strconv.Atoi(v)
	if err != nil || pid <= 0 {
		return nil, fmt.Errorf("%s=%q: not started by a gpushm serving process", envAdopt, v)
	}
	for _, fd := range []int{fdControl, fdListener, fdEpoch, fdLock, fdPidfd} {
		if _, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0); err != nil {
			return nil, fmt.Errorf("descriptor %d from the serving process: %w", fd, err)
		}
		unix.CloseOnExec(fd)
	}
	conn, err := controlConn(fdControl)
	if err != nil {
		return nil, fmt.Errorf("control socket: %w", err)
	}
	h := &Handover{
		Listener: os.NewFile(fdListener, "listener"),
		Epoch:    os.NewFile(fdEpoch, "epoch"),
		Lock:     os.NewFile(fdLock, "lock"),
		conn:     conn, pidfd: fdPidfd, pid: pid,
	}
	if !isListener(h.Listener) {
		h.close()
		return nil, fmt.Errorf("descriptor %d from the serving process is not a listening socket", fdListener)
	}
	return h, nil
}

func (h *Handover) close() {
	h.conn.Close()
	h.Listener.Close()
	h.Epoch.Close()
	h.Lock.Close()
	closeFD(h.pidfd)
}

// adopt says it reads ("init"), takes the state the serving process hands
// over (the journal's messages, then "handed"), says it holds it
// ("adopted"), and makes that process the one supervised. One that dies
// meanwhile is restarted by Run with what it handed.
func (s *Supervisor) adopt(ctx context.Context) error {
	h := s.cfg.Handover
	c := &child{conn: h.conn, msgs: make(chan ctl, 64), exited: make(chan struct{}), table: -1,
		started: time.Now(), pid: h.pid, pidfd: &pidfd{fd: h.pidfd}}
	go s.readChild(c)
	go func() {
		c.pidfd.wait()
		c.err = exitStatus(c.pid)
		c.conn.Shutdown()
		close(c.exited)
	}()
	// The serving process waits for this before it journals to us: from
	// now on, what it sends is read.
	send(c.conn, msg{T: tInit, PID: os.Getpid()}, -1)
	deadline := time.After(5 * time.Minute)
	for {
		select {
		case m, ok := <-c.msgs:
			if !ok {
				select {
				case <-c.exited:
				case <-time.After(5 * time.Second):
					// Alive, and gave up on this supervisor: it starts
					// another.
					return fmt.Errorf("%w %d: it hung up before it handed over", ErrHandover, c.pid)
				}
				s.log.Error("the serving process died while handing over; restarting it with what it handed",
					"pid", c.pid, "segments", s.st.Len())
				s.cur = c
				return nil
			}
			if m.m.T != tHanded {
				s.apply(c, m)
				continue
			}
			s.st.nextID = max(s.st.nextID, m.m.NextID)
			s.restarts = m.m.Restarts
			// Only now is this the supervisor clients are told of: it
			// holds everything, and its signals are handled.
			send(c.conn, msg{T: tAdopted, PID: os.Getpid()}, -1)
			c.ready = true
			s.cur = c
			s.log.Warn("adopted the serving process: its supervisor died", "pid", c.pid, "segments", s.st.Len())
			return nil
		case <-deadline:
			return fmt.Errorf("%w %d: no state within 5m", ErrHandover, c.pid)
		case <-ctx.Done():
			return fmt.Errorf("%w %d: %w", ErrHandover, c.pid, ctx.Err())
		}
	}
}

// pidfd is an adopted serving process's pidfd, closed once it exited so
// that a kill never reaches a process that reused its number.
type pidfd struct {
	mu sync.Mutex
	fd int // -1 once closed
}

// wait blocks until the process exited, then closes the pidfd.
func (p *pidfd) wait() {
	fds := []unix.PollFd{{Fd: int32(p.fd), Events: unix.POLLIN}}
	for {
		if _, err := unix.Poll(fds, -1); err != unix.EINTR {
			break
		}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	unix.Close(p.fd)
	p.fd = -1
}

func (p *pidfd) kill() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.fd >= 0 {
		unix.PidfdSendSignal(p.fd, unix.SIGKILL, nil, 0)
	}
}

// errStatusUnknown is the exit status of a process that is not our child
// once its parent reaped it.
var errStatusUnknown = errors.New("exit status unknown (not this supervisor's child)")

// exitStatus reads an exited process's status from /proc while it is a
// zombie (its parent, not us, reaps it).
func exitStatus(pid int) error {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return errStatusUnknown
	}
	// Fields after the command's closing parenthesis: state is the 3rd
	// field of the line, exit_code the 52nd.
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 {
		return errStatusUnknown
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 50 || f[0] != "Z" {
		return errStatusUnknown
	}
	code, err := strconv.Atoi(f[49])
	if err != nil {
		return errStatusUnknown
	}
	ws := syscall.WaitStatus(code)
	switch {
	case ws.Exited() && ws.ExitStatus() == 0:
		return nil
	case ws.Exited():
		return fmt.Errorf("exit status %d", ws.ExitStatus())
	case ws.Signaled():
		return fmt.Errorf("signal: %v", ws.Signal())
	}
	return errStatusUnknown
}
