package main

import (
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestDaemonDetach: 'daemon --detach' returns once its daemon answers, so
// that the next command of a script finds it (the README's block), says
// its pid and log, and writes nothing of the daemon's to the terminal; a
// daemon that cannot start is said so, with its log's end, and a non-zero
// exit.
func TestDaemonDetach(t *testing.T) {
	dir := socketDir(t)
	sock, logf := filepath.Join(dir, "gpushm.sock"), filepath.Join(dir, "state", "daemon.log")
	r := cli(t, nil, "daemon", "--detach", "--socket", sock, "--backend", "host", "--log-file", logf)
	m := regexp.MustCompile(`serving on \S+ \(pid (\d+)\); its log: (\S+)`).FindStringSubmatch(r.stderr)
	if r.code != 0 || m == nil || m[2] != logf || r.stdout != "" {
		t.Fatalf("daemon --detach: exit %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}
	pid, _ := strconv.Atoi(m[1])
	t.Cleanup(func() {
		syscall.Kill(pid, syscall.SIGTERM)
		for i := 0; i < 500 && syscall.Kill(pid, 0) == nil; i++ {
			time.Sleep(10 * time.Millisecond)
		}
	})
	// At once, no wait: it answers.
	if r := cli(t, nil, "--socket", sock, "info"); r.code != 0 {
		t.Fatalf("info right after daemon --detach: exit %d, %s", r.code, r.stderr)
	}
	if b, err := os.ReadFile(logf); err != nil || !strings.Contains(string(b), "msg=serving") {
		t.Fatalf("the daemon's log %s: %v\n%s", logf, err, b)
	}
	if st, err := os.Stat(logf); err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("the daemon's log: %v, %v; want mode 0600", st, err)
	}

	// A second daemon on the same socket refuses to start: said, exit 1.
	r = cli(t, nil, "daemon", "--detach", "--socket", sock, "--backend", "host", "--log-file", logf)
	if r.code == 0 || !strings.Contains(r.stderr, "a daemon serves "+sock+" already") {
		t.Fatalf("a second daemon --detach on a served socket: exit %d, stderr %q", r.code, r.stderr)
	}
	// One that exits before it serves: its log's end is said.
	r = cli(t, nil, "daemon", "--detach", "--socket", filepath.Join(dir, "other.sock"), "--backend", "nonesuch", "--log-file", logf)
	if r.code == 0 || !strings.Contains(r.stderr, "exited") || !strings.Contains(r.stderr, "nonesuch") {
		t.Fatalf("a daemon --detach that cannot start: exit %d, stderr %q", r.code, r.stderr)
	}
	if r := cli(t, nil, "daemon", "--socket", sock, "--log-file", logf); r.code != 2 {
		t.Fatalf("--log-file without --detach: exit %d, stderr %q; want 2", r.code, r.stderr)
	}
}

// TestDetachedLogIgnoresRootsEnvironment: as root, whose environment may
// be a user's (sudo -E), the default log is /var/log/gpushm's, never under
// $XDG_STATE_HOME or $HOME, where that user could have put a link.
func TestDetachedLogIgnoresRootsEnvironment(t *testing.T) {
	attacker := t.TempDir()
	t.Setenv("XDG_STATE_HOME", attacker)
	t.Setenv("HOME", attacker)
	got := defaultDaemonLog()
	if os.Geteuid() == 0 {
		if got != "/var/log/gpushm/daemon.log" {
			t.Fatalf("root's default log: %s, want /var/log/gpushm/daemon.log", got)
		}
		return
	}
	if got != filepath.Join(attacker, "gpushm", "daemon.log") {
		t.Fatalf("a user's default log: %s, want under its $XDG_STATE_HOME", got)
	}
}
