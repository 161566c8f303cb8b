package integration

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/testutil"
	"github.com/gpushm/gpushm/internal/wire"
)

// TestSurvivePidReuse: a process (A) connects, hands its connection to
// another process and exits; a process unrelated to either (B) then gets
// A's pid, and the connection's new owner makes a temporary segment over
// it. The segment is A's: after a SIGKILL of the serving process it ends
// at once, since A is gone, rather than living as long as B. It all runs
// in a pid namespace of its own (pidnsMain), where nothing else takes pids
// and /proc/sys/kernel/ns_last_pid chooses the next one.
func TestSurvivePidReuse(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("needs root: a pid namespace, to give a process the pid of one that exited")
	}
	dir := testutil.SocketDir(t)
	os.Chmod(dir, 0o755)
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), "GPUSHM_TEST_PIDNS="+dir)
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWPID | syscall.CLONE_NEWNS, Pdeathsig: syscall.SIGKILL}
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "ok pid reuse\n") {
		log, _ := os.ReadFile(filepath.Join(dir, "daemon.log"))
		t.Fatalf("in a pid namespace: %v\n%s\ndaemon:\n%s", err, out, log)
	}
	t.Logf("%s", out)
}

// pidnsMain is TestSurvivePidReuse's process 1 of a new pid namespace: it
// mounts a /proc of the namespace, runs a daemon there on a socket in dir,
// and plays the connection's new owner.
func pidnsMain(dir string) error {
	os.Unsetenv("GPUSHM_TEST_PIDNS") // the daemon and A are gpushm
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("make mounts private: %w", err)
	}
	if err := unix.Mount("proc", "/proc", "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return fmt.Errorf("mount /proc: %w", err)
	}
	sock := filepath.Join(dir, "gpushm.sock")
	logf, err := os.Create(filepath.Join(dir, "daemon.log"))
	if err != nil {
		return err
	}
	daemon := exec.Command(gpushmBin, "daemon", "--socket", sock, "--backend", "host", "--grace", "1s")
	daemon.Stdout, daemon.Stderr = logf, logf
	if err := daemon.Start(); err != nil {
		return err
	}
	defer func() {
		daemon.Process.Signal(syscall.SIGTERM)
		daemon.Wait()
	}()
	if _, err := pidnsInfo(sock, 0); err != nil {
		return err
	}
	fd, pid, err := connectionOfA(sock)
	if err != nil {
		return err
	}
	b, err := takePID(pid)
	if err != nil {
		return err
	}
	defer func() { b.Process.Kill(); b.Wait() }()
	fmt.Printf("A was pid %d, B is pid %d\n", pid, b.Process.Pid)

	// Over A's connection, and over one of this process's own (alive
	// throughout: its segment stays), a temporary segment each.
	wc, err := wire.NewConn(fd)
	if err != nil {
		return err
	}
	defer wc.Close()
	if err := rawCall(wc, `{"id":2,"op":"create","name":"inherited","size":4096,"lifetime":"connection"}`); err != nil {
		return fmt.Errorf("create over A's connection: %w", err)
	}
	own, err := wire.Dial(sock)
	if err != nil {
		return err
	}
	defer own.Close()
	if err := rawCall(own, `{"id":1,"op":"hello","version":1}`); err != nil {
		return err
	}
	if err := rawCall(own, `{"id":2,"op":"create","name":"own","size":4096,"lifetime":"connection"}`); err != nil {
		return err
	}

	inf, err := pidnsInfo(sock, 0)
	if err != nil {
		return err
	}
	syscall.Kill(inf.PID, syscall.SIGKILL)
	if _, err := pidnsInfo(sock, inf.PID); err != nil {
		return err
	}
	if err := waitOnlyOwn(sock, pid); err != nil {
		return err
	}
	if err := b.Process.Signal(syscall.Signal(0)); err != nil {
		return fmt.Errorf("B: %w", err)
	}
	fmt.Println("ok pid reuse")
	return nil
}

// pidnsInfo waits until a serving process other than notPID answers on
// sock, for pidnsMain.
func pidnsInfo(sock string, notPID int) (*gpushm.Info, error) {
	ctx := context.Background()
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		c, err := gpushm.Dial(ctx, sock)
		if err == nil {
			c.SetReconnect(0)
			var inf *gpushm.Info
			inf, err = c.Info(ctx)
			c.Close()
			if err == nil && inf.PID != notPID {
				return inf, nil
			}
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("no serving process other than %d: %v", notPID, err)
		}
	}
}

// connectionOfA runs A, at a pid above any the daemon's threads took,
// which connects to sock and hands its connection over; it returns that
// connection and A's pid, once A has exited.
func connectionOfA(sock string) (fd, pid int, err error) {
	if err := setLastPID(9999); err != nil {
		return 0, 0, err
	}
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return 0, 0, err
	}
	theirs := os.NewFile(uintptr(pair[1]), "pair")
	a := exec.Command(os.Args[0])
	a.Env = append(os.Environ(), "GPUSHM_TEST_PASSCONN="+sock)
	a.ExtraFiles = []*os.File{theirs}
	a.Stderr = os.Stderr
	stdin, err := a.StdinPipe()
	if err != nil {
		return 0, 0, err
	}
	if err := a.Start(); err != nil {
		return 0, 0, err
	}
	theirs.Close()
	fd, err = recvFD(pair[0])
	if err != nil {
		return 0, 0, fmt.Errorf("the connection from A: %w", err)
	}
	pid = a.Process.Pid
	stdin.Close()
	if err := a.Wait(); err != nil {
		return 0, 0, fmt.Errorf("A: %w", err)
	}
	return fd, pid, nil
}

// takePID starts B, which gets A's pid, in a later clock tick than A
// started in. A process is named by its pid and its start time, which
// /proc gives in clock ticks (10 ms): only a pid namespace whose owner
// sets ns_last_pid, as this test does, can hand a pid on within one tick;
// outside one, cycling through the pids takes far longer.
func takePID(pid int) (*exec.Cmd, error) {
	time.Sleep(30 * time.Millisecond)
	for try := 0; ; try++ {
		if err := setLastPID(pid - 1); err != nil {
			return nil, err
		}
		b := exec.Command("sleep", "1000")
		if err := b.Start(); err != nil {
			return nil, err
		}
		if b.Process.Pid == pid {
			return b, nil
		}
		b.Process.Kill()
		b.Wait()
		if try == 100 {
			return nil, fmt.Errorf("pid %d never came free for B", pid)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// waitOnlyOwn waits until, after the restart and its grace period, the
// daemon on sock holds only "own": A made "inherited", and A (pid) is
// gone though B holds its pid.
func waitOnlyOwn(sock string, pid int) error {
	ctx := context.Background()
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		inf, err := pidnsInfo(sock, 0)
		if err != nil {
			return err
		}
		if inf.Grace > 0 {
			continue
		}
		c, err := gpushm.Dial(ctx, sock)
		if err != nil {
			return err
		}
		segs, err := c.List(ctx)
		c.Close()
		if err != nil {
			return err
		}
		var names []string
		for _, s := range segs {
			names = append(names, s.Name)
		}
		if slices.Equal(names, []string{"own"}) {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("after the restart and its grace period, with B (pid %d) alive: %v, want [own] (A made \"inherited\", and A is gone)", pid, names)
		}
	}
}

// passConnMain is A of TestSurvivePidReuse: it connects to the daemon at
// sock, says hello, sends the connection over descriptor 3 and exits once
// its stdin closes.
func passConnMain(sock string) error {
	c, err := wire.Dial(sock)
	if err != nil {
		return err
	}
	if err := rawCall(c, `{"id":1,"op":"hello","version":1}`); err != nil {
		return err
	}
	if err := unix.Sendmsg(3, []byte{0}, unix.UnixRights(c.FD()), nil, 0); err != nil {
		return err
	}
	io.Copy(io.Discard, os.Stdin)
	return nil
}

// setLastPID makes pid+1 the next pid of this pid namespace (if free).
func setLastPID(pid int) error {
	return os.WriteFile("/proc/sys/kernel/ns_last_pid", []byte(strconv.Itoa(pid)), 0)
}

// recvFD receives one descriptor over the stream socket fd.
func recvFD(fd int) (int, error) {
	buf, oob := make([]byte, 1), make([]byte, unix.CmsgSpace(4))
	_, oobn, _, _, err := unix.Recvmsg(fd, buf, oob, unix.MSG_CMSG_CLOEXEC)
	if err != nil {
		return -1, err
	}
	msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
	if err != nil || len(msgs) != 1 {
		return -1, fmt.Errorf("control message: %v (%d)", err, len(msgs))
	}
	fds, err := unix.ParseUnixRights(&msgs[0])
	if err != nil || len(fds) != 1 {
		return -1, fmt.Errorf("rights: %v %v", fds, err)
	}
	return fds[0], nil
}

// rawCall sends one request and fails on an error reply.
func rawCall(c *wire.Conn, msg string) error {
	if err := c.Send([]byte(msg), -1); err != nil {
		return err
	}
	b, fd, err := c.Recv()
	if err != nil {
		return err
	}
	if fd >= 0 {
		unix.Close(fd)
	}
	rep, err := wire.DecodeReply(b)
	if err != nil {
		return err
	}
	if rep.Error != nil {
		return errors.New(rep.Error.Code + ": " + rep.Error.Message)
	}
	return nil
}

// testBackend is the backend the lease survival tests run the daemon on:
// host memory, or what GPUSHM_TEST_BACKEND names (cuda on a GPU machine).
func testBackend() []string {
	if b := os.Getenv("GPUSHM_TEST_BACKEND"); b != "" {
		return []string{"--backend", b}
	}
	return nil
}

// TestSurviveStoppedHolder: a client that maps a segment and writes it is
// stopped (SIGSTOP) for 60 seconds, through 5 SIGKILLs of the serving
// process, each followed by a grace period (1 s) that ends long before the
// client can reconnect. Its leases are journaled under its process, so
// they hold while it lives: the segment may not be evicted (EBUSY
// throughout), a segment it holds that was unlinked is not freed, and
// what it writes after SIGCONT is what a new reader reads. When it exits,
// what only it held goes.
func TestSurviveStoppedHolder(t *testing.T) {
	stopped, kills := 60*time.Second, 5
	if testing.Short() {
		stopped = 10 * time.Second
	}
	dir := testutil.SocketDir(t)
	sock := filepath.Join(dir, "gpushm.sock")
	d := Start(t, Options{Socket: sock, Args: append([]string{"--grace", "1s"}, testBackend()...)})
	ctx := context.Background()
	c := dialOnce(t, sock)
	if _, _, err := c.CreateOnly(ctx, "unlinked", 4096, nil); err != nil {
		t.Fatal(err)
	}
	holder := startHolder(t, sock, 0, "stopped") // stopped-temp, and stopped, mapped and written
	if got := holder.ask(t, 0, "open unlinked"); got != "ok open" {
		t.Fatal(got)
	}
	if err := c.Unlink(ctx, "unlinked"); err != nil {
		t.Fatal(err)
	}
	c.Close()
	held := d.waitServing(t, 0).Usage.Segments // stopped, stopped-temp, unlinked
	if held != 3 {
		t.Fatalf("%d segments hold memory, want 3", held)
	}
	holder.cmd.Process.Signal(syscall.SIGSTOP)
	t.Cleanup(func() { holder.cmd.Process.Signal(syscall.SIGCONT) })
	var atStop uint64
	check := func(when string) {
		t.Helper()
		c := dialOnce(t, sock)
		defer c.Close()
		if _, err := c.Evict(ctx, "stopped"); !errors.Is(err, syscall.EBUSY) {
			t.Fatalf("%s: evict of a segment its stopped holder maps: %v, want EBUSY", when, err)
		}
		inf, err := c.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if inf.Usage.Segments != held {
			t.Fatalf("%s: %d segments hold memory, want %d (the unlinked one its stopped holder maps included)", when, inf.Usage.Segments, held)
		}
		b, _ := segmentBytes(t, c, "stopped")
		if n := binary.LittleEndian.Uint64(b); atStop == 0 {
			atStop = n
		} else if n != atStop {
			t.Fatalf("%s: the stopped holder's segment reads %d, it read %d when the holder stopped", when, n, atStop)
		}
	}
	time.Sleep(10 * time.Millisecond) // a write in flight lands
	check("stopped")
	for i := range kills {
		time.Sleep(stopped / time.Duration(kills))
		d.Crash(t)
		check(fmt.Sprintf("right after restart %d", i+1))
		d.waitGraceOver(t)
		check(fmt.Sprintf("after restart %d and its grace period", i+1))
	}
	holder.cmd.Process.Signal(syscall.SIGCONT)
	var n uint64
	for deadline := time.Now().Add(10 * time.Second); n <= atStop+100; time.Sleep(10 * time.Millisecond) {
		if _, err := fmt.Sscanf(holder.ask(t, 0, "count"), "ok %d", &n); err != nil {
			t.Fatal(err)
		}
		if time.Now().After(deadline) {
			t.Fatalf("the holder made %d writes, %d when stopped: it does not run", n, atStop)
		}
	}
	c = dialOnce(t, sock)
	defer c.Close()
	b, _ := segmentBytes(t, c, "stopped")
	if got := binary.LittleEndian.Uint64(b); got < n {
		t.Fatalf("a new reader reads write %d of the holder, which had made %d since SIGCONT (%d before): its writes went elsewhere", got, n, atStop)
	}
	if got := holder.ask(t, 0, "op"); !strings.HasPrefix(got, "ok reconnects=") {
		t.Fatalf("the holder's first call after SIGCONT: %s", got)
	}
	if got := holder.ask(t, 0, "exit"); got != "ok bye" {
		t.Fatalf("holder exit: %s", got)
	}
	holder.cmd.Wait()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		inf, err := c.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if inf.Usage.Segments == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after the holder exited: %d segments hold memory, want 1 (stopped: the unlinked one and its temporary one go)", inf.Usage.Segments)
		}
	}
	d.Stop(t)
}

// TestSurviveTTLDeadline: a TTL segment expires when its time is up, as
// counted before the serving process was killed, not a TTL after the
// restart; one that a stopped client holds does not expire while the
// client lives, through a restart and past its grace period, and expires
// a TTL after the client exits.
func TestSurviveTTLDeadline(t *testing.T) {
	const ttl = 4 * time.Second
	dir := testutil.SocketDir(t)
	sock := filepath.Join(dir, "gpushm.sock")
	d := Start(t, Options{Socket: sock, Args: append([]string{"--grace", "1s"}, testBackend()...)})
	ctx := context.Background()
	c := dialOnce(t, sock)
	for _, name := range []string{"ttl-idle", "ttl-held"} {
		if _, _, err := c.CreateOnly(ctx, name, 4096, &gpushm.CreateOptions{TTL: ttl}); err != nil {
			t.Fatal(err)
		}
	}
	created := time.Now()
	c.Close()
	holder := startHolder(t, sock, 0, "holder")
	if got := holder.ask(t, 0, "open ttl-held"); got != "ok open" {
		t.Fatal(got)
	}
	holder.cmd.Process.Signal(syscall.SIGSTOP)
	t.Cleanup(func() { holder.cmd.Process.Signal(syscall.SIGCONT) })
	time.Sleep(ttl / 2)
	d.Crash(t)
	has := func(name string) bool { return slices.Contains(listAtQuiet(sock), name) }
	if !has("ttl-idle") || !has("ttl-held") {
		t.Fatalf("right after the restart, %s after the create: %v", time.Since(created), listAtQuiet(sock))
	}
	for has("ttl-idle") {
		if time.Since(created) > ttl+2*time.Second {
			t.Fatalf("ttl-idle is still there %s after its create (TTL %s, the serving process killed at %s)", time.Since(created), ttl, ttl/2)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if gone := time.Since(created); gone < ttl {
		t.Fatalf("ttl-idle expired %s after its create, before its TTL (%s)", gone, ttl)
	}
	d.waitGraceOver(t)
	time.Sleep(ttl - time.Since(created)%ttl + ttl/2) // past any TTL counted from the restart
	if !has("ttl-held") {
		t.Fatalf("ttl-held expired while its stopped holder lives")
	}
	holder.cmd.Process.Kill()
	holder.cmd.Wait()
	exited := time.Now()
	for has("ttl-held") {
		if time.Since(exited) > ttl+2*time.Second {
			t.Fatalf("ttl-held is still there %s after its holder exited (TTL %s)", time.Since(exited), ttl)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if gone := time.Since(exited); gone < ttl-time.Second/2 {
		t.Fatalf("ttl-held expired %s after its holder exited, before its TTL (%s)", gone, ttl)
	}
	d.Stop(t)
}
