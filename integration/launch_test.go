package integration

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/testutil"
)

// Options say how Start runs a daemon. Every daemon serves host memory
// (--backend host), unless Args says otherwise later on the line.
type Options struct {
	// Socket is where the daemon listens; "" is a socket in a new
	// directory, which the test's commands then find through
	// $GPUSHM_SOCKET (the daemon's Socket says where).
	Socket string
	// Exe is the binary that runs; "" is the gpushm the tests run.
	Exe string
	// Args are the daemon's flags, after --socket and --backend.
	Args []string
	// NoFile, if not 0, is the descriptor limit the daemon runs under
	// (ulimit -n), for tests of its limits.
	NoFile int
	// Wrap, if set, makes the command that runs the daemon (a network
	// namespace's ip netns exec: testutil.Net.Command).
	Wrap func(name string, args ...string) *exec.Cmd
}

// Start runs 'gpushm daemon' as users do, a supervisor and its serving
// process, and waits until it serves. The test's end kills every process
// of the daemon, and writes the daemon's log if the test failed. It is the
// one way these tests start a daemon, but for a daemon started under a
// fake systemd (systemd_test.go) or in a mount namespace of its own
// (finddaemon_test.go), where what starts it is the point.
func Start(t *testing.T, o Options) *Daemon {
	t.Helper()
	if o.Socket == "" {
		o.Socket = filepath.Join(testutil.SocketDir(t), "gpushm.sock")
		t.Setenv("GPUSHM_SOCKET", o.Socket)
	}
	if o.Exe == "" {
		o.Exe = gpushmBin
	}
	d := &Daemon{socket: o.Socket, log: newDaemonLog(t), done: make(chan struct{})}
	args := append([]string{"daemon", "--socket", o.Socket, "--backend", "host"}, o.Args...)
	d.cmd = exec.Command(o.Exe, args...)
	if o.Wrap != nil {
		d.cmd = o.Wrap(o.Exe, args...)
	}
	if o.NoFile != 0 {
		script := "ulimit -n " + strconv.Itoa(o.NoFile) + ` && exec "$0" "$@"`
		d.cmd = exec.Command("sh", append([]string{"-c", script, o.Exe}, args...)...)
	}
	// A file, not a pipe: Wait must return when the supervisor exits, not
	// when every process that inherited its output (a serving process, a
	// supervisor that one started) has.
	d.cmd.Stderr, d.cmd.Stdout = d.log.f, d.log.f
	if err := d.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	d.pid = d.cmd.Process.Pid
	go func() { d.cmd.Wait(); close(d.done) }()
	t.Cleanup(func() {
		// Supervisors started by serving processes, and serving processes
		// whose supervisor is gone, are not our children.
		d.Kill()
		testutil.DumpDaemonLog(t, d.log.String())
	})
	d.waitServing(t, 0)
	return d
}

// Daemon is a 'gpushm daemon' that Start started (the supervisor).
type Daemon struct {
	cmd    *exec.Cmd
	socket string
	log    *daemonLog
	done   chan struct{}
	// pid is the supervisor now: the one started, or the one a serving
	// process started in place of a supervisor killed (waitSupervisor).
	pid int
}

// Kill kills every process of the daemon with SIGKILL (each stopped
// first, so that none starts another), and waits for the supervisor
// Start started.
func (d *Daemon) Kill() {
	testutil.KillDaemon(d.socket, nil)
	d.cmd.Process.Kill()
	<-d.done
}

// info asks the daemon, on a connection of its own that does not
// reconnect.
func (d *Daemon) info() (*gpushm.Info, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := gpushm.Dial(ctx, d.socket)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	c.SetReconnect(0)
	return c.Info(ctx)
}

// waitServing waits until a serving process other than notPID answers.
func (d *Daemon) waitServing(t *testing.T, notPID int) *gpushm.Info {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		inf, err := d.info()
		if err == nil && inf.PID != notPID {
			return inf
		}
		if !testutil.Alive(d.pid) {
			t.Fatalf("the supervisor %d exited\n%s", d.pid, d.log.String())
		}
		if time.Now().After(deadline) {
			t.Fatalf("no serving process other than %d within 60s (last: %v)", notPID, err)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// waitGraceOver waits until the serving process's grace period has ended.
func (d *Daemon) waitGraceOver(t *testing.T) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); ; {
		inf, err := d.info()
		if err != nil {
			t.Fatal(err)
		}
		if inf.Grace <= 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("grace period still running after 30s: %s left", inf.Grace)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Stop sends SIGTERM to the supervisor and expects a clean exit.
func (d *Daemon) Stop(t *testing.T) {
	t.Helper()
	if d.pid != d.cmd.Process.Pid {
		d.stopAdopted(t)
		return
	}
	d.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-d.done:
	case <-time.After(30 * time.Second):
		t.Fatal("daemon ignored SIGTERM for 30s")
	}
	if !d.cmd.ProcessState.Success() {
		t.Fatalf("daemon exit after SIGTERM: %v", d.cmd.ProcessState)
	}
}

// Crash kills the serving process with SIGKILL and waits until the
// supervisor's next one answers.
func (d *Daemon) Crash(t *testing.T) {
	t.Helper()
	d.Restart(t, false)
}

// Upgrade has the supervisor start the binary on disk as the new serving
// process (SIGHUP), and waits until that one answers.
func (d *Daemon) Upgrade(t *testing.T) {
	t.Helper()
	d.Restart(t, true)
}

// Socket is where the daemon listens.
func (d *Daemon) Socket() string { return d.socket }

// Restart kills the serving process (kill -9) or, with upgrade,
// asks the supervisor for an upgrade (SIGHUP), and waits until a new
// serving process serves.
func (d *Daemon) Restart(t *testing.T, upgrade bool) {
	t.Helper()
	inf, err := d.info()
	if err != nil {
		t.Fatal(err)
	}
	if upgrade {
		syscall.Kill(d.pid, syscall.SIGHUP)
	} else {
		syscall.Kill(inf.PID, syscall.SIGKILL)
	}
	d.waitServing(t, inf.PID)
}

// daemonLog is the daemon's output, in a file that every process of the
// daemon writes to.
type daemonLog struct{ f *os.File }

func newDaemonLog(t *testing.T) *daemonLog {
	t.Helper()
	f, err := os.Create(filepath.Join(t.TempDir(), "daemon.log"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return &daemonLog{f}
}

func (l *daemonLog) String() string {
	b, _ := os.ReadFile(l.f.Name())
	return string(b)
}

// KillSupervisor SIGKILLs the supervisor and waits until the serving
// process has started another, which holds every segment; the serving
// process must be the same one, so that no client noticed.
func (d *Daemon) KillSupervisor(t *testing.T) *gpushm.Info {
	t.Helper()
	before, err := d.info()
	if err != nil {
		t.Fatal(err)
	}
	if before.SupervisorPID != d.pid {
		t.Fatalf("info says supervisor %d, want %d", before.SupervisorPID, d.pid)
	}
	if err := syscall.Kill(d.pid, syscall.SIGKILL); err != nil {
		t.Fatalf("kill supervisor %d: %v", d.pid, err)
	}
	now := d.waitSupervisor(t, d.pid)
	if now.PID != before.PID {
		t.Fatalf("serving process %d replaced by %d when its supervisor died", before.PID, now.PID)
	}
	return now
}

// waitSupervisor waits until a supervisor other than notPID holds the
// daemon, and makes it the one d signals.
func (d *Daemon) waitSupervisor(t *testing.T, notPID int) *gpushm.Info {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		inf, err := d.info()
		if err == nil && inf.SupervisorPID != notPID {
			if !testutil.Alive(inf.SupervisorPID) {
				t.Fatalf("info says supervisor %d, which is not running", inf.SupervisorPID)
			}
			d.pid = inf.SupervisorPID
			return inf
		}
		if time.Now().After(deadline) {
			t.Fatalf("no supervisor other than %d within 60s (last: %v)", notPID, err)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// stopAdopted stops a supervisor that is not this test's child: SIGTERM,
// then it and every other process of the daemon must be gone, and it must
// have exited 0 (read while it is a zombie, which it stays here).
func (d *Daemon) stopAdopted(t *testing.T) {
	t.Helper()
	syscall.Kill(d.pid, syscall.SIGTERM)
	for deadline := time.Now().Add(30 * time.Second); testutil.Alive(d.pid); {
		if time.Now().After(deadline) {
			t.Fatalf("supervisor %d ignored SIGTERM for 30s", d.pid)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if state, status, ok := testutil.ProcStat(d.pid); ok && state == "Z" && (!status.Exited() || status.ExitStatus() != 0) {
		t.Fatalf("supervisor %d exit after SIGTERM: %#x", d.pid, int(status))
	}
	if !strings.Contains(d.log.String(), `msg=stopped role=supervisor`) {
		t.Fatalf("supervisor %d did not say it stopped", d.pid)
	}
}

// syncBuffer collects a process's output while the test reads it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// memfds counts a process's descriptors of segment memfds (not the epoch
// page).
func memfds(t *testing.T, pid int) int {
	t.Helper()
	dir := fmt.Sprintf("/proc/%d/fd", pid)
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, e := range ents {
		// Segments' memfds, and the host memory evicted ones live in.
		if l, err := os.Readlink(filepath.Join(dir, e.Name())); err == nil &&
			(strings.HasPrefix(l, "/memfd:gpushm (deleted)") || strings.HasPrefix(l, "/memfd:gpushm-spill (deleted)")) {
			n++
		}
	}
	return n
}

// pooled is how many memfds the serving process may hold for no segment:
// its pool's allocations made ahead of time, once none is being made
// (-1 while one is, which no count equals), and the spill memory it keeps
// for the next eviction of its size.
func pooled(inf *gpushm.Info) int {
	spare := 0
	if inf.Tiers != nil {
		// Spill memory kept for the next eviction of its size.
		spare = inf.Tiers.Spare
	}
	switch {
	case inf.Pool == nil:
		return spare
	case inf.Pool.Filling > 0:
		return -1
	}
	return inf.Pool.Ready + spare
}

// children lists a process's children (each thread's: a child belongs to
// the thread that forked it).
func children(pid int) []int {
	tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/children", pid))
	var out []int
	for _, task := range tasks {
		b, _ := os.ReadFile(task)
		for _, f := range strings.Fields(string(b)) {
			n, _ := strconv.Atoi(f)
			out = append(out, n)
		}
	}
	return out
}

// checkDaemonLog fails if the daemon logged an error other than the
// deaths of serving processes the test caused.
func checkDaemonLog(t *testing.T, log string) {
	t.Helper()
	for _, line := range strings.Split(log, "\n") {
		if strings.Contains(line, "level=ERROR") && !strings.Contains(line, `msg="serving process died; restarting it"`) {
			t.Errorf("daemon logged an error: %s", line)
		}
	}
}

// nonMemFDs counts a process's descriptors other than memfds: sockets,
// pidfds, the lock, the listener, what a replacement of the supervisor
// could leak.
func nonMemFDs(t *testing.T, pid int) (int, []string) {
	t.Helper()
	dir := fmt.Sprintf("/proc/%d/fd", pid)
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var links []string
	for _, e := range ents {
		if l, err := os.Readlink(filepath.Join(dir, e.Name())); err == nil && !strings.HasPrefix(l, "/memfd:") {
			links = append(links, l)
		}
	}
	slices.Sort(links)
	return len(links), links
}
