package testutil

// What the tests of daemons as processes share: finding and killing a
// daemon's processes, a directory for its socket, its log when a test
// fails.

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// ProcStat reads a process's state letter and, for a zombie, its wait
// status; ok is false when there is no such process.
func ProcStat(pid int) (state string, status syscall.WaitStatus, ok bool) {
	f := statFields(pid)
	if len(f) < 50 {
		return "", 0, false
	}
	code, _ := strconv.Atoi(f[49])
	return f[0], syscall.WaitStatus(code), true
}

// Alive reports whether pid is a process that has not exited (a zombie
// has: nobody may reap a process whose parent died, here).
func Alive(pid int) bool {
	state, _, ok := ProcStat(pid)
	return ok && state != "Z"
}

// DaemonProcs lists the live 'gpushm daemon' processes on socket: its
// supervisor and serving processes, whoever started them.
func DaemonProcs(socket string) []int {
	return procsWhose(func(args []string) bool {
		return slices.Contains(args, "daemon") && slices.Contains(args, socket)
	})
}

// procsWhose lists the live processes whose arguments ok takes, by pid.
func procsWhose(ok func(args []string) bool) []int {
	ents, _ := os.ReadDir("/proc")
	var out []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
		if err != nil {
			continue
		}
		if ok(strings.Split(string(b), "\x00")) && Alive(pid) {
			out = append(out, pid)
		}
	}
	slices.Sort(out)
	return out
}

// PidsNamed lists the live processes whose first argument is name (a
// helper the daemon starts, gpushm-lend).
func PidsNamed(name string) []int {
	return procsWhose(func(args []string) bool { return args[0] == name })
}

// ChildrenNamed is PidsNamed of this process's children alone: a test's
// own helpers, not those of tests of other packages running beside it.
func ChildrenNamed(name string) []int {
	var out []int
	for _, pid := range PidsNamed(name) {
		if parent(pid) == os.Getpid() {
			out = append(out, pid)
		}
	}
	return out
}

// parent is pid's parent's pid, or 0.
func parent(pid int) int {
	f := statFields(pid)
	if len(f) < 2 {
		return 0
	}
	ppid, _ := strconv.Atoi(f[1])
	return ppid
}

// statFields are the fields of /proc/PID/stat after the command's name
// (which may hold spaces and parentheses): the state first; nil when
// unreadable.
func statFields(pid int) []string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return nil
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return nil
	}
	return strings.Fields(string(b[i+1:]))
}

// KillDaemon ends every process of the daemon on socket at once, as a
// crash of the machine would, and reaps cmd (if not nil), the one the
// test started.
// Killing the supervisor alone does not end a daemon: its serving process
// starts another. So each is stopped first, so that none can react to
// another's death, then killed, until none is left.
func KillDaemon(socket string, cmd *exec.Cmd) {
	for quiet := 0; quiet < 3; {
		procs := DaemonProcs(socket)
		if len(procs) == 0 {
			quiet++
			time.Sleep(10 * time.Millisecond)
			continue
		}
		quiet = 0
		for _, pid := range procs {
			syscall.Kill(pid, syscall.SIGSTOP)
		}
		for _, pid := range procs {
			syscall.Kill(pid, syscall.SIGKILL)
		}
	}
	if cmd != nil {
		cmd.Process.Kill()
		cmd.Wait()
	}
}

// SocketDir makes a directory for a socket, removed when the test ends:
// not t.TempDir, whose paths can pass a socket's 108 bytes.
func SocketDir(t testing.TB) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "gpushm-cli-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// DumpDaemonLog writes a failed test's daemon log to stderr, its last lines
// only, at cleanup: that is before the test's own output, so the failure
// itself is what a log read from its end shows first.
func DumpDaemonLog(t testing.TB, log string) {
	if !t.Failed() {
		return
	}
	const keep = 200
	lines := strings.Split(strings.TrimRight(log, "\n"), "\n")
	head := fmt.Sprintf("=== %s: daemon log", t.Name())
	if len(lines) > keep {
		head += fmt.Sprintf(", its last %d lines of %d", keep, len(lines))
		lines = lines[len(lines)-keep:]
	}
	fmt.Fprintf(os.Stderr, "%s:\n%s\n=== end of %s's daemon log\n", head, strings.Join(lines, "\n"), t.Name())
}

// MemTotal is this machine's memory in bytes, as the host backend sees it.
func MemTotal(t testing.TB) int64 {
	t.Helper()
	var si unix.Sysinfo_t
	if err := unix.Sysinfo(&si); err != nil {
		t.Fatal(err)
	}
	return int64(si.Totalram) * int64(si.Unit)
}
