package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm"
)

// detachWait bounds how long 'daemon --detach' waits for its daemon to
// answer (a daemon restoring many segments after a crash takes longest).
const detachWait = 60 * time.Second

// detachedEnv marks the daemon a --detach started: it never detaches
// again, whatever its command line says.
const detachedEnv = "GPUSHM_DETACHED"

// detach starts this command again without --detach, in a session of its
// own, its output appended to logPath, and returns once its daemon answers
// on socket: what a script (or a pasted README) needs before its next
// command. The daemon's pid and log are said on standard error.
func detach(ctx context.Context, socket, mount, logPath string) error {
	// Its answer must be the new daemon's: one serving there already
	// would answer for it.
	dctx, cancel := context.WithTimeout(ctx, time.Second)
	if c, err := gpushm.Dial(dctx, socket); err == nil {
		c.Close()
		cancel()
		return fmt.Errorf("--detach: a daemon serves %s already ('gpushm --socket %s info' says which)", socket, socket)
	}
	cancel()
	logf, err := openLog(logPath)
	if err != nil {
		return fmt.Errorf("--detach: its log %s: %w", logPath, err)
	}
	defer logf.Close()
	start, _ := logf.Seek(0, io.SeekEnd)
	self, err := os.Executable()
	if err != nil {
		return fmt.Errorf("--detach: %w", err)
	}
	// What this process inherited without close-on-exec (a script's lock,
	// a job server's pipe) must not live on in the daemon.
	closeOnExec()
	cmd := exec.Command(self, foreground(argv)...)
	cmd.Env = append(os.Environ(), detachedEnv+"=1")
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("--detach: %w", err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	pid := cmd.Process.Pid
	deadline := time.Now().Add(detachWait)
	for {
		if ours(ctx, socket, pid) && (mount == "" || mounted(mount)) {
			fmt.Fprintf(Stderr, "gpushm: daemon serving on %s (pid %d); its log: %s\n", socket, pid, logPath)
			return nil
		}
		select {
		case err := <-exited:
			return fmt.Errorf("--detach: the daemon exited (%v) before it served; its log (%s) ends:\n%s", err, logPath, logTail(logf, start))
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("--detach: the daemon (pid %d) did not answer on %s within %s; it goes on; its log: %s", pid, socket, detachWait, logPath)
		}
	}
}

// ours says whether the daemon answering on socket is the one started as
// pid (its supervisor, or with --supervise=false the serving process):
// two --detach racing for one socket must not both take the winner's
// answer for their own.
func ours(ctx context.Context, socket string, pid int) bool {
	dctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	c, err := gpushm.Dial(dctx, socket)
	if err != nil {
		return false
	}
	defer c.Close()
	inf, err := c.Info(dctx)
	return err == nil && (inf.SupervisorPID == pid || inf.PID == pid)
}

// openLog opens path for appending, made if missing, as the daemon's log:
// a regular file of this user's (or root's) that nobody else may write,
// in directories nobody else may change (sticky ones such as /tmp aside),
// never through another user's link; never blocking (a FIFO is refused).
func openLog(path string) (*os.File, error) {
	path = filepath.Clean(path)
	dir := filepath.Dir(path)
	if err := trustedDirs(dir); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	if err := trustedDirs(dir); err != nil {
		return nil, err
	}
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_APPEND|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0o600)
	if err != nil {
		return nil, err
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		f.Close()
		return nil, err
	}
	euid := uint32(os.Geteuid())
	switch {
	case st.Mode&unix.S_IFMT != unix.S_IFREG:
		err = errors.New("not a regular file")
	case st.Uid != euid && st.Uid != 0:
		err = fmt.Errorf("owned by uid %d, not this user", st.Uid)
	case st.Mode&0o022 != 0:
		err = fmt.Errorf("mode %#o: others may write it", st.Mode&0o777)
	}
	if err == nil {
		err = unix.SetNonblock(int(f.Fd()), false)
	}
	if err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// trustedDirs checks dir and every directory above it that exists: owned
// by this user or root, and writable by nobody else unless sticky; a link
// on the way only if root's or this user's.
func trustedDirs(dir string) error {
	euid := uint32(os.Geteuid())
	for d := dir; ; d = filepath.Dir(d) {
		var st unix.Stat_t
		if err := unix.Lstat(d, &st); err == nil {
			switch {
			case st.Uid != euid && st.Uid != 0:
				return fmt.Errorf("%s is uid %d's, not this user's", d, st.Uid)
			case st.Mode&unix.S_IFMT == unix.S_IFDIR && st.Mode&0o022 != 0 && st.Mode&unix.S_ISVTX == 0:
				return fmt.Errorf("%s (mode %#o) may be changed by others", d, st.Mode&0o7777)
			}
		} else if !errors.Is(err, os.ErrNotExist) {
			return err
		}
		if d == filepath.Dir(d) {
			return nil
		}
	}
}

// closeOnExec marks every descriptor from 3 up close-on-exec.
func closeOnExec() {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return
	}
	for _, e := range ents {
		if fd, err := strconv.Atoi(e.Name()); err == nil && fd > 2 {
			unix.CloseOnExec(fd)
		}
	}
}

// mounted says whether dir is a mount point: on another file system than
// its parent (the FUSE view, with --mount, comes after the socket).
func mounted(dir string) bool {
	var st, up syscall.Stat_t
	return syscall.Stat(dir, &st) == nil && syscall.Stat(filepath.Join(dir, ".."), &up) == nil && st.Dev != up.Dev
}

// foreground is args without --detach (in any spelling) and --log-file:
// the daemon's own command line.
func foreground(args []string) []string {
	var out []string
	for i := 0; i < len(args); i++ {
		switch a := args[i]; {
		case a == "--detach" || strings.HasPrefix(a, "--detach=") || strings.HasPrefix(a, "--log-file="):
		case a == "--log-file":
			i++
		default:
			out = append(out, a)
		}
	}
	return out
}

// logTail is the last lines the daemon wrote to f past start (at most the
// last 16 KiB of them).
func logTail(f *os.File, start int64) string {
	end, err := f.Seek(0, io.SeekEnd)
	if err != nil || end <= start {
		return ""
	}
	from := max(start, end-16<<10)
	b := make([]byte, end-from)
	n, _ := f.ReadAt(b, from)
	lines := strings.Split(strings.TrimSpace(string(b[:n])), "\n")
	return strings.Join(lines[max(0, len(lines)-20):], "\n")
}

// defaultDaemonLog is where a detached daemon's output goes: the user's
// state directory ($XDG_STATE_HOME, else ~/.local/state), never a shared
// one where another user could have put a link; for root, whose
// environment may be a user's (sudo -E), /var/log/gpushm.
func defaultDaemonLog() string {
	if os.Geteuid() == 0 {
		return "/var/log/gpushm/daemon.log"
	}
	dir := os.Getenv("XDG_STATE_HOME")
	if dir == "" {
		home, err := os.UserHomeDir()
		if err != nil {
			home = "/"
		}
		dir = filepath.Join(home, ".local", "state")
	}
	return filepath.Join(dir, "gpushm", "daemon.log")
}
