package integration

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpushm/gpushm/internal/supervisor"
	"github.com/gpushm/gpushm/internal/testutil"
)

// The supervisor: killed, it is started again by the serving process,
// which clients never notice; its processes' names.

// TestSurviveSupervisorNames: ps tells the daemon's processes apart
// (internal/supervisor/name.go), and a supervisor the serving process
// started in place of a dead one is named as the first, not "exe" after
// the /proc/self/exe it is exec'd through.
func TestSurviveSupervisorNames(t *testing.T) {
	sock := filepath.Join(testutil.SocketDir(t), "gpushm.sock")
	d := Start(t, Options{Socket: sock})
	inf, err := d.info()
	if err != nil {
		t.Fatal(err)
	}
	// The first supervisor keeps the argv[0] it was started with.
	checkProcName(t, "supervisor", d.pid, supervisor.SupervisorName, gpushmBin, sock)
	checkProcName(t, "serving process", inf.PID, supervisor.ServingName, supervisor.ServingName, sock)
	d.KillSupervisor(t)
	checkProcName(t, "supervisor started by the serving process", d.pid, supervisor.SupervisorName, supervisor.SupervisorName, sock)
	checkProcName(t, "serving process", inf.PID, supervisor.ServingName, supervisor.ServingName, sock)
	d.Stop(t)
}

// checkProcName checks a daemon process's comm (what ps -e and pgrep
// read) and its command line (ps -o args): argv[0], then the daemon's
// arguments, which still name its socket.
func checkProcName(t *testing.T, role string, pid int, comm, argv0, socket string) {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.TrimSpace(string(b)); got != comm {
		t.Errorf("%s %d: comm %q, want %q", role, pid, got, comm)
	}
	b, err = os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil {
		t.Fatal(err)
	}
	args := strings.Split(strings.TrimSuffix(string(b), "\x00"), "\x00")
	if args[0] != argv0 || len(args) < 2 || args[1] != "daemon" || !slices.Contains(args, socket) {
		t.Errorf("%s %d: command line %q, want %q daemon ... %s ...", role, pid, args, argv0, socket)
	}
}

// TestSurviveSupervisor: the supervisor SIGKILLed again and again under
// working clients. Each time the serving process starts a new one and
// hands it everything, and serves on: no client notices (not even a
// reconnection), every acknowledged segment keeps its bytes, and nothing
// leaks. The last supervisor still upgrades on SIGHUP, holds the lock,
// is the one 'gpushm info' names, and stops everything on SIGTERM.
func TestSurviveSupervisor(t *testing.T) {
	kills := 20
	if n, err := strconv.Atoi(os.Getenv("GPUSHM_SUPERVISOR_KILLS")); err == nil {
		kills = n
	}
	dir := testutil.SocketDir(t)
	os.Chmod(dir, 0o755)
	sock := filepath.Join(dir, "gpushm.sock")
	d := Start(t, Options{Socket: sock, Args: []string{"--grace", "3s"}})
	seen := []int{d.pid}

	// One replacement first, without clients, so that what the serving
	// process holds from then on (a supervisor child among them) is the
	// measure for leaks.
	inf := d.KillSupervisor(t)
	srv := inf.PID
	seen = append(seen, srv, d.pid)
	var clients []*chaosClient
	for k := range 8 {
		var extra []string
		if k == 2 && os.Getuid() == 0 {
			extra = append(extra, "CHAOS_UID=4242")
		}
		clients = append(clients, startChaosClient(t, sock, k, extra...))
	}
	askAll(t, clients, "verify")
	base, baseFDs := nonMemFDs(t, srv)

	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 15))
	var took []time.Duration
	for i := range kills {
		time.Sleep(time.Duration(5+rng.IntN(40)) * time.Millisecond)
		start := time.Now()
		d.KillSupervisor(t)
		took = append(took, time.Since(start))
		seen = append(seen, d.pid)
		askAll(t, clients, "verify")
		if got := memfds(t, d.pid); got == 0 {
			t.Fatalf("round %d: supervisor %d holds no segment", i, d.pid)
		}
	}
	slices.Sort(took)
	t.Logf("%d supervisor kills; SIGKILL to a new supervisor holding everything: p50 %s, max %s", kills,
		took[len(took)/2].Round(time.Millisecond), took[len(took)-1].Round(time.Millisecond))
	// The serving process's descriptors other than segments are no more
	// than after the first replacement: no control socket, pidfd or
	// descriptor queued for a new supervisor stays behind. (Fewer is
	// fine: a worker that goes idle for long enough ends, with its
	// eventfd.)
	for deadline := time.Now().Add(10 * time.Second); ; {
		n, fds := nonMemFDs(t, srv)
		if n <= base {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("serving process: %d descriptors other than segments after %d replacements, %d before\nnow:    %v\nbefore: %v",
				n, kills, base, fds, baseFDs)
		}
		time.Sleep(50 * time.Millisecond)
	}

	// 'gpushm info' names the new supervisor, and the lock file too: a
	// second daemon on the socket is refused, naming it.
	if out := mustRun(t, nil, "--socket", sock, "info"); !strings.Contains(out, fmt.Sprintf("serving %d, supervisor %d,", srv, d.pid)) {
		t.Fatalf("gpushm info after %d replacements (supervisor %d):\n%s", kills, d.pid, out)
	}
	r := cli(t, nil, "daemon", "--socket", sock, "--backend", "host")
	if r.code == 0 || !strings.Contains(r.stderr, fmt.Sprintf("pid %d holds", d.pid)) {
		t.Fatalf("a second daemon on the socket: exit %d, %s", r.code, r.stderr)
	}

	// An upgrade from the replaced supervisor, then a replacement of the
	// supervisor whose serving process is its own child.
	syscall.Kill(d.pid, syscall.SIGHUP)
	up := d.waitServing(t, srv)
	if up.SupervisorPID != d.pid || up.Restarts != 0 {
		t.Fatalf("after the upgrade: supervisor %d, %d restarts; want %d, 0", up.SupervisorPID, up.Restarts, d.pid)
	}
	seen = append(seen, up.PID)
	askAll(t, clients, "verify")
	d.KillSupervisor(t)
	seen = append(seen, d.pid)
	askAll(t, clients, "verify")

	for k, line := range askAll(t, clients, "stop") {
		if !strings.HasSuffix(line, "reconnects=0") {
			t.Errorf("client %d: %s: a supervisor's death or the upgrade dropped a connection", k, line)
		}
	}
	for _, cc := range clients {
		if err := cc.cmd.Wait(); err != nil {
			t.Fatalf("client exit: %v\n%s", err, cc.errs.String())
		}
	}
	// Every client removed its own: no segment and no memfd is left in
	// either process, and the daemon is these two processes.
	waitAllRemoved(t, d)
	d.Stop(t)
	for _, pid := range seen {
		if testutil.Alive(pid) {
			t.Errorf("process %d of the daemon still runs after the stop", pid)
		}
	}
	if procs := testutil.DaemonProcs(sock); len(procs) > 0 {
		t.Errorf("daemon processes left after the stop: %v", procs)
	}
	if _, err := os.Stat(sock); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("socket left after the stop: %v", err)
	}
}

// waitAllRemoved waits until d holds no segment, neither of its processes
// a memfd (but the serving process's pool), and the daemon is these two
// processes.
func waitAllRemoved(t *testing.T, d *Daemon) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; {
		inf, err := d.info()
		if err != nil {
			t.Fatal(err)
		}
		supFDs, srvFDs := memfds(t, d.pid), memfds(t, inf.PID)
		procs := testutil.DaemonProcs(d.socket)
		want := []int{d.pid, inf.PID}
		slices.Sort(want)
		if inf.Usage.Segments == 0 && inf.Usage.Named == 0 && supFDs == 0 && srvFDs == pooled(inf) && slices.Equal(procs, want) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after every client removed its own: usage %+v, supervisor memfds %d, serving process memfds %d (pool %+v), daemon processes %v (want %v)",
				inf.Usage, supFDs, srvFDs, inf.Pool, procs, want)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
