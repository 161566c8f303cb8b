package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/gpushm/gpushm"
)

// detachWait bounds how long 'daemon --detach' waits for its daemon to
// answer (a daemon restoring many segments after a crash takes longest).
const detachWait = 60 * time.Second

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
	if err := os.MkdirAll(filepath.Dir(logPath), 0o700); err != nil {
		return fmt.Errorf("--detach: its log: %w", err)
	}
	logf, err := os.OpenFile(logPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return fmt.Errorf("--detach: its log: %w", err)
	}
	defer logf.Close()
	start, _ := logf.Seek(0, 2)
	self, err := os.Executable()
	if err != nil {
		return fmt.Errorf("--detach: %w", err)
	}
	cmd := exec.Command(self, foreground(os.Args[1:])...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("--detach: %w", err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	deadline := time.Now().Add(detachWait)
	for {
		dctx, cancel := context.WithTimeout(ctx, time.Second)
		c, err := gpushm.Dial(dctx, socket)
		cancel()
		if err == nil {
			c.Close()
		}
		if err == nil && (mount == "" || mounted(mount)) {
			fmt.Fprintf(os.Stderr, "gpushm: daemon serving on %s (pid %d); its log: %s\n", socket, cmd.Process.Pid, logPath)
			return nil
		}
		select {
		case err := <-exited:
			return fmt.Errorf("--detach: the daemon exited (%v) before it served; its log (%s) ends:\n%s", err, logPath, logTail(logPath, start))
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("--detach: the daemon (pid %d) did not answer on %s within %s; it goes on; its log: %s", cmd.Process.Pid, socket, detachWait, logPath)
		}
	}
}

// mounted says whether dir is a mount point: on another file system than
// its parent (the FUSE view, with --mount, comes after the socket).
func mounted(dir string) bool {
	var st, up syscall.Stat_t
	return syscall.Stat(dir, &st) == nil && syscall.Stat(filepath.Join(dir, ".."), &up) == nil && st.Dev != up.Dev
}

// foreground is args without --detach and --log-file: the daemon's own
// command line.
func foreground(args []string) []string {
	var out []string
	for i := 0; i < len(args); i++ {
		switch a := args[i]; {
		case a == "--detach" || a == "--detach=true" || strings.HasPrefix(a, "--log-file="):
		case a == "--log-file":
			i++
		default:
			out = append(out, a)
		}
	}
	return out
}

// logTail is what the daemon wrote to path past start, its last lines.
func logTail(path string, start int64) string {
	b, err := os.ReadFile(path)
	if err != nil || int64(len(b)) < start {
		return ""
	}
	lines := strings.Split(string(bytes.TrimSpace(b[start:])), "\n")
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
