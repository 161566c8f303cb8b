package integration

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpushm/gpushm/internal/testutil"
)

// TestDaemonDetach: 'daemon --detach' returns once its daemon answers, so
// that the next command of a script finds it (the README's block), says
// its pid and log, and writes nothing of the daemon's to the terminal; a
// daemon that cannot start is said so, with its log's end, and a non-zero
// exit.
func TestDaemonDetach(t *testing.T) {
	dir := testutil.SocketDir(t)
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

// TestDetachAttacks: what the log path and the command line could do to a
// --detach, from another user or by accident: a FIFO, another user's file
// or directory, --detach=1 (each child detaching again), and a descriptor
// the caller holds, which must not live on in the daemon.
func TestDetachAttacks(t *testing.T) {
	requireRoot(t)
	dir := testutil.SocketDir(t)
	os.Chmod(dir, 0o755)
	sock := filepath.Join(dir, "gpushm.sock")
	other := filepath.Join(dir, "others")
	os.Mkdir(other, 0o755)
	os.Chown(other, 65534, 65534)
	fifo := filepath.Join(dir, "fifo.log")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	open := filepath.Join(dir, "open.log")
	os.WriteFile(open, nil, 0o666)
	os.Chmod(open, 0o666)
	for _, tc := range []struct{ log, why string }{
		{fifo, "not a regular file"},
		{open, "others may write it"},
		{filepath.Join(other, "daemon.log"), "not this user's"},
		{filepath.Join(other, "sub", "daemon.log"), "not this user's"},
	} {
		done := make(chan result, 1)
		go func() {
			done <- cli(t, nil, "daemon", "--detach", "--socket", sock, "--backend", "host", "--log-file", tc.log)
		}()
		select {
		case r := <-done:
			if r.code == 0 || !strings.Contains(r.stderr, tc.why) {
				t.Errorf("--log-file %s: exit %d, stderr %q; want a refusal saying %q", tc.log, r.code, r.stderr, tc.why)
			}
		case <-time.After(30 * time.Second):
			t.Fatalf("--log-file %s: still running after 30 s", tc.log)
		}
	}

	// --detach=1, and a descriptor held by the caller.
	held, err := os.Create(filepath.Join(dir, "held.lock"))
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	cmd := exec.Command(gpushmBin, "daemon", "--detach=1", "--socket", sock, "--backend", "host", "--log-file", filepath.Join(dir, "d.log"))
	cmd.ExtraFiles = []*os.File{held}
	r := runCmd(t, cmd)
	m := regexp.MustCompile(`\(pid (\d+)\)`).FindStringSubmatch(r.stderr)
	if r.code != 0 || m == nil {
		t.Fatalf("daemon --detach=1: exit %d, %q", r.code, r.stderr)
	}
	pid, _ := strconv.Atoi(m[1])
	defer func() {
		syscall.Kill(pid, syscall.SIGTERM)
		for i := 0; i < 500 && syscall.Kill(pid, 0) == nil; i++ {
			time.Sleep(10 * time.Millisecond)
		}
	}()
	cmdline, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if strings.Contains(string(cmdline), "--detach") {
		t.Errorf("the daemon's command line still detaches: %q", cmdline)
	}
	fds, _ := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	for _, e := range fds {
		if l, _ := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", pid, e.Name())); strings.HasSuffix(l, "held.lock") {
			t.Errorf("the daemon holds the caller's descriptor %s (fd %s)", l, e.Name())
		}
	}
}
