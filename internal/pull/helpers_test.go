package pull

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm/internal/testutil"
)

// TestMain runs the helpers when the test binary is started as one (the
// package's helpers exec os.Executable with __pull).
func TestMain(m *testing.M) {
	RunIfHelper()
	if os.Geteuid() != 0 {
		HelperUser = "" // only root can start them as a user of their own
	}
	// Two nodes talk over tcp; here, over loopback.
	os.Setenv("UCX_TLS", "tcp")
	os.Setenv("UCX_NET_DEVICES", "lo")
	if g := os.Getenv(daemonEnv); g != "" {
		os.Exit(fetchingDaemon(g))
	}
	os.Exit(m.Run())
}

// daemonEnv makes the test binary a daemon that fetches the grant the
// variable holds, for TestHelpersDieWithTheDaemon, until it is killed.
const daemonEnv = "GPUSHM_TEST_FETCHING_DAEMON"

func fetchingDaemon(grant string) int {
	var g Grant
	if err := json.Unmarshal([]byte(grant), &g); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	dst, err := unix.MemfdCreate("pull-test", unix.MFD_CLOEXEC)
	if err == nil {
		err = unix.Ftruncate(dst, g.Size)
	}
	if err == nil {
		err = Fetch(context.Background(), dst, g.Size, g, FetchOptions{Board: -1, Stall: time.Minute})
	}
	fmt.Fprintln(os.Stderr, "the fetch ended:", err)
	return 1
}

// memfd makes a memfd of size bytes, filled with data when not nil, and
// closes it at the test's end.
func memfd(t *testing.T, size int64, data []byte) int {
	t.Helper()
	fd, err := unix.MemfdCreate("pull-test", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	if err := unix.Ftruncate(fd, size); err != nil {
		t.Fatal(err)
	}
	if data != nil {
		if _, err := unix.Pwrite(fd, data, 0); err != nil {
			t.Fatal(err)
		}
	}
	return fd
}

func contents(t *testing.T, fd int, size int64) []byte {
	t.Helper()
	b := make([]byte, size)
	if _, err := unix.Pread(fd, b, 0); err != nil {
		t.Fatal(err)
	}
	return b
}

func random(t *testing.T, n int64) []byte {
	b := make([]byte, n)
	rand.Read(b)
	return b
}

func lend(t *testing.T, fd int, size int64, board int) *Lender {
	t.Helper()
	l, err := Lend(fd, size, Host, board)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

// TestLendFetch moves a segment of three chunks and a bit between two
// helper processes, every byte compared, the progress reported up to the
// size.
func TestLendFetch(t *testing.T) {
	testutil.RequireUCX(t)
	size := int64(3*Chunk + 4097)
	want := random(t, size)
	l := lend(t, memfd(t, size, want), size, -1)
	dst := memfd(t, size, nil)
	var last int64
	if err := Fetch(context.Background(), dst, size, l.Grant, FetchOptions{Board: -1, Progress: func(d int64) { last = d }}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(contents(t, dst, size), want) {
		t.Fatal("the fetched bytes differ from the lent ones")
	}
	if last != size {
		t.Errorf("the last progress said %d bytes, want %d", last, size)
	}
}

// TestChain: a node still fetching a segment lends what it has to the
// next, which gets every chunk only once its own lender's fetch has it.
// Three fetches in a chain, started together, end equal to the source.
func TestChain(t *testing.T) {
	testutil.RequireUCX(t)
	size := int64(5*Chunk + 12345)
	want := random(t, size)
	src := lend(t, memfd(t, size, want), size, -1)
	var (
		wg   sync.WaitGroup
		errs = make([]error, 3)
		dsts []int
	)
	grant := src.Grant
	for k := range 3 {
		dst, bd := memfd(t, size, nil), memfd(t, BoardSize(size), nil)
		dsts = append(dsts, dst)
		g := grant
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[k] = Fetch(context.Background(), dst, size, g, FetchOptions{Board: bd})
		}()
		// The next node lends this one's segment as it fills.
		grant = lend(t, dst, size, bd).Grant
	}
	wg.Wait()
	for k, dst := range dsts {
		if errs[k] != nil {
			t.Fatalf("node %d: %v", k+1, errs[k])
		}
		if !bytes.Equal(contents(t, dst, size), want) {
			t.Fatalf("node %d's bytes differ from the source's", k+1)
		}
	}
}

// TestFetchCatchesWrongBytes: a lender that serves one wrong byte fails
// the fetch, naming the chunk.
func TestFetchCatchesWrongBytes(t *testing.T) {
	testutil.RequireUCX(t)
	t.Setenv(corruptEnv, "1")
	size := int64(2*Chunk + 1)
	l := lend(t, memfd(t, size, random(t, size)), size, -1)
	err := Fetch(context.Background(), memfd(t, size, nil), size, l.Grant, FetchOptions{Board: -1})
	if err == nil || !strings.Contains(err.Error(), "fails its checksum") {
		t.Fatalf("Fetch from a lender of a wrong byte = %v, want a checksum failure", err)
	}
}

// TestFetchStall: a lender that stops (SIGSTOP, as a partitioned node
// whose packets no longer arrive) fails the fetch after the stall time
// with an error that says so; and a chain whose upstream fetch stalls
// does too.
func TestFetchStall(t *testing.T) {
	testutil.RequireUCX(t)
	size := int64(4 * Chunk)
	l := lend(t, memfd(t, size, random(t, size)), size, -1)
	syscall.Kill(l.cmd.Process.Pid, syscall.SIGSTOP)
	defer syscall.Kill(l.cmd.Process.Pid, syscall.SIGCONT)
	start := time.Now()
	err := Fetch(context.Background(), memfd(t, size, nil), size, l.Grant, FetchOptions{Board: -1, Stall: 2 * time.Second})
	if err == nil || !strings.Contains(err.Error(), "2s") {
		t.Fatalf("Fetch from a stopped lender = %v, want a stall after 2s", err)
	}
	t.Logf("after %v: %v", time.Since(start), err)

	// A chain's lender whose board never moves: nothing is staged.
	mid := memfd(t, size, nil)
	cl := lend(t, mid, size, memfd(t, BoardSize(size), nil))
	err = Fetch(context.Background(), memfd(t, size, nil), size, cl.Grant, FetchOptions{Board: -1, Stall: time.Second})
	if err == nil || !strings.Contains(err.Error(), "staged nothing") {
		t.Fatalf("Fetch from a chain that never fills = %v, want a stall", err)
	}
}

// TestHelpersDrop: run as root, a helper drops to HelperUser, with no
// supplementary groups, cannot be traced by that user's other processes
// (not dumpable), and gains nothing by exec (no_new_privs). UCX over tcp
// lets whoever reaches its port write anywhere in it (internal/ucx's
// TestPeerPut): this is what they would take over.
func TestHelpersDrop(t *testing.T) {
	testutil.RequireUCX(t)
	if os.Geteuid() != 0 {
		t.Skip("needs root: a helper drops privileges only from root")
	}
	size := int64(Chunk)
	l := lend(t, memfd(t, size, random(t, size)), size, -1)
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", l.cmd.Process.Pid))
	if err != nil {
		t.Fatal(err)
	}
	ids, err := helperIDs()
	if err != nil {
		t.Fatal(err)
	}
	uid := ids[1]
	want := []string{"Uid: " + uid + " " + uid + " " + uid + " " + uid, "Groups:", "NoNewPrivs: 1", "CapEff: 0000000000000000"}
	if !noPIDNamespace.Load() {
		// Its own PID namespace, where it is 1: what it forks dies with it.
		want = append(want, fmt.Sprintf("NSpid: %d 1", l.cmd.Process.Pid))
	}
	for _, want := range want {
		found := false
		for line := range strings.Lines(string(status)) {
			found = found || strings.Join(strings.Fields(line), " ") == want
		}
		if !found {
			t.Errorf("the lender's /proc/PID/status has no line %q:\n%s", want, status)
		}
	}
	// Not dumpable: /proc/PID/mem and the descriptors are root's.
	var st syscall.Stat_t
	if err := syscall.Stat(fmt.Sprintf("/proc/%d/fd", l.cmd.Process.Pid), &st); err != nil {
		t.Fatal(err)
	}
	if st.Uid != 0 {
		t.Errorf("the lender's /proc/PID/fd belongs to uid %d: it is dumpable, so its user's processes can take its segment", st.Uid)
	}
}

// TestFetchLenderDies: a lender killed mid-fetch fails it at once, not
// after the stall time.
func TestFetchLenderDies(t *testing.T) {
	testutil.RequireUCX(t)
	size := int64(16 * Chunk)
	l := lend(t, memfd(t, size, random(t, size)), size, -1)
	done := make(chan error, 1)
	go func() {
		done <- Fetch(context.Background(), memfd(t, size, nil), size, l.Grant, FetchOptions{Board: -1, Stall: time.Minute, Progress: func(d int64) {
			if d > 0 {
				l.cmd.Process.Kill()
			}
		}})
	}()
	select {
	case err := <-done:
		if err == nil {
			t.Log("the fetch finished before the kill took effect")
		} else if errors.Is(err, context.DeadlineExceeded) || strings.Contains(err.Error(), "1m0s") {
			t.Fatalf("a dead lender was found only after the stall time: %v", err)
		}
	case <-time.After(50 * time.Second):
		t.Fatal("the fetch from a killed lender did not end")
	}
}

// TestHelpersLogAside: what UCX logs goes to standard output by default;
// in a helper it must not land in the protocol the daemon reads there.
func TestHelpersLogAside(t *testing.T) {
	testutil.RequireUCX(t)
	t.Setenv("UCX_LOG_LEVEL", "debug")
	size := int64(Chunk + 1)
	want := random(t, size)
	l := lend(t, memfd(t, size, want), size, -1)
	dst := memfd(t, size, nil)
	if err := Fetch(context.Background(), dst, size, l.Grant, FetchOptions{Board: -1}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(contents(t, dst, size), want) {
		t.Fatal("the fetched bytes differ from the lent ones")
	}
}

// TestHelperOutlivesItsThread: PR_SET_PDEATHSIG fires when the thread
// that started a helper ends, not the process; and the daemon ends
// threads (the server's reapers, after a burst of connections any local
// user can make, lock a thread and return). A lender started on a thread
// that then ends must go on serving, whether it dropped to HelperUser or
// kept the daemon's user (a daemon that is not root).
func TestHelperOutlivesItsThread(t *testing.T) {
	testutil.RequireUCX(t)
	defer func(u string) { HelperUser = u }(HelperUser)
	for _, HelperUser = range []string{HelperUser, ""} {
		size := int64(Chunk + 1)
		want := random(t, size)
		src := memfd(t, size, want)
		started := make(chan *Lender, 1)
		go func() {
			// This goroutine's thread ends with it, as a reaper's does.
			runtime.LockOSThread()
			l, err := Lend(src, size, Host, -1)
			if err != nil {
				t.Error(err)
			}
			started <- l
		}()
		l := <-started
		if l == nil {
			t.FailNow()
		}
		t.Cleanup(func() { l.Close() })
		time.Sleep(200 * time.Millisecond)
		dst := memfd(t, size, nil)
		if err := Fetch(context.Background(), dst, size, l.Grant, FetchOptions{Board: -1, Stall: 5 * time.Second}); err != nil {
			t.Fatalf("helpers' user %q: a fetch from a lender whose starting thread ended: %v", HelperUser, err)
		}
		if !bytes.Equal(contents(t, dst, size), want) {
			t.Fatalf("helpers' user %q: the fetched bytes differ from the lent ones", HelperUser)
		}
	}
}

// TestHelpersDieWithTheDaemon: a daemon killed leaves no helper behind,
// even one that dropped to HelperUser (the kernel clears the parent-death
// signal as a process's user changes): a fetcher left running would go on
// filling memory nobody accounts for, from a lender that goes on serving.
func TestHelpersDieWithTheDaemon(t *testing.T) {
	testutil.RequireUCX(t)
	size := int64(2 * Chunk)
	// A chain's lender whose board never moves: the fetch waits.
	l := lend(t, memfd(t, size, nil), size, memfd(t, BoardSize(size), nil))
	grant, err := json.Marshal(l.Grant)
	if err != nil {
		t.Fatal(err)
	}
	daemon := exec.Command(os.Args[0])
	daemon.Env = append(os.Environ(), daemonEnv+"="+string(grant))
	daemon.Stderr = os.Stderr
	if err := daemon.Start(); err != nil {
		t.Fatal(err)
	}
	defer daemon.Wait()
	defer daemon.Process.Kill()
	fetcher := 0
	for deadline := time.Now().Add(10 * time.Second); fetcher == 0; time.Sleep(5 * time.Millisecond) {
		if fetcher = childNamed(daemon.Process.Pid, "gpushm-fetch"); fetcher == 0 && time.Now().After(deadline) {
			t.Fatal("the daemon started no fetcher within 10s")
		}
	}
	// Once it dropped to its user, if it does.
	time.Sleep(300 * time.Millisecond)
	daemon.Process.Kill()
	daemon.Wait()
	for deadline := time.Now().Add(5 * time.Second); named(fetcher, "gpushm-fetch"); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			syscall.Kill(fetcher, syscall.SIGKILL)
			t.Fatalf("fetcher %d still runs 5s after its daemon was killed", fetcher)
		}
	}
}

// childNamed is a child of parent whose argv[0] is name, or 0.
func childNamed(parent int, name string) int {
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || !named(pid, name) {
			continue
		}
		stat, _ := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		// The fields after the command's name: the state, then the parent.
		if i := bytes.LastIndexByte(stat, ')'); i > 0 {
			if f := strings.Fields(string(stat[i+1:])); len(f) > 1 && f[1] == strconv.Itoa(parent) {
				return pid
			}
		}
	}
	return 0
}

// named says whether pid runs with argv[0] name.
func named(pid int, name string) bool {
	cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	return err == nil && strings.HasPrefix(string(cmdline), name+"\x00")
}

// TestStoppedFetcher: another process of the helpers' user stops a
// fetcher (it may: same user); the fetch fails once the fetcher has said
// nothing for longer than its stall times allow, instead of holding the
// pull, and its name, for ever.
func TestStoppedFetcher(t *testing.T) {
	testutil.RequireUCX(t)
	if os.Geteuid() != 0 {
		t.Skip("needs root: the helpers drop to their user only from root")
	}
	ids, err := helperIDs()
	if err != nil || len(ids) < 4 {
		t.Skipf("no helpers' user: %v", err)
	}
	uid, _ := strconv.ParseUint(ids[1], 10, 32)
	gid, _ := strconv.ParseUint(ids[3], 10, 32)
	defer func(d time.Duration) { StartTime = d }(StartTime)
	StartTime = 2 * time.Second
	const stall = time.Second

	size := int64(8 * Chunk)
	l := lend(t, memfd(t, size, random(t, size)), size, -1)
	for try := 1; ; try++ {
		done := make(chan error, 1)
		start := time.Now()
		go func() {
			done <- Fetch(context.Background(), memfd(t, size, nil), size, l.Grant, FetchOptions{Board: -1, Stall: stall})
		}()
		// The attacker: the fetcher stopped as soon as it is of its user.
		stopped := 0
		for stopped == 0 && len(done) == 0 {
			if pid := childNamed(os.Getpid(), "gpushm-fetch"); pid > 0 {
				kill := exec.Command("/bin/kill", "-STOP", strconv.Itoa(pid))
				kill.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}}
				if kill.Run() == nil {
					stopped = pid
				}
			}
			time.Sleep(100 * time.Microsecond)
		}
		if stopped == 0 {
			if err := <-done; err != nil {
				t.Fatal(err)
			}
			if try == 20 {
				t.Skip("the fetch ended before its fetcher could be stopped, 20 times")
			}
			continue
		}
		select {
		case err := <-done:
			if err == nil {
				t.Log("the fetch ended before its fetcher was stopped")
				continue
			}
			if !strings.Contains(err.Error(), "said nothing") {
				t.Fatalf("a fetch whose fetcher was stopped: %v, want it killed as silent", err)
			}
			t.Logf("try %d, after %v: %v", try, time.Since(start).Round(time.Millisecond), err)
		case <-time.After(4*stall + StartTime + 10*time.Second):
			if named(stopped, "gpushm-fetch") {
				syscall.Kill(stopped, syscall.SIGKILL)
			}
			<-done
			t.Fatalf("a fetch whose fetcher was stopped still ran %v later", time.Since(start).Round(time.Second))
		}
		return
	}
}

// TestHelpersInAUserNamespace: a daemon whose root is a user namespace's
// (unshare -Ur), where file owners show as 65534, cannot drop its helpers
// to a user of their own: the lend fails, saying why, and no helper runs
// as that root.
func TestHelpersInAUserNamespace(t *testing.T) {
	testutil.RequireUCX(t)
	size := int64(Chunk)
	if os.Getenv("GPUSHM_PULL_USERNS") != "" {
		_, err := Lend(memfd(t, size, random(t, size)), size, Host, -1)
		if err == nil || !strings.Contains(err.Error(), "a daemon in a user namespace cannot") {
			t.Fatalf("Lend as a user namespace's root = %v, want a refusal naming the user namespace", err)
		}
		return
	}
	if os.Getuid() != 0 {
		t.Skip("HelperUser is empty where the tests are not root: nothing to drop")
	}
	unshare, err := exec.LookPath("unshare")
	if err != nil {
		t.Skip("no unshare (util-linux)")
	}
	cmd := exec.Command(unshare, "-Ur", os.Args[0], "-test.run", "^TestHelpersInAUserNamespace$", "-test.count", "1", "-test.v")
	cmd.Env = append(os.Environ(), "GPUSHM_PULL_USERNS=1")
	out, err := cmd.CombinedOutput()
	if err != nil && strings.Contains(string(out), "unshare failed") {
		t.Skipf("no user namespaces here: %s", out)
	}
	if err != nil || !strings.Contains(string(out), "--- PASS: TestHelpersInAUserNamespace") {
		t.Fatalf("in a user namespace: %v\n%s", err, out)
	}
}
