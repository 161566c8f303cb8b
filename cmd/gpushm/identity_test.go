package main

import (
	"context"
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
	dir := socketDir(t)
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
	daemon := exec.Command(os.Args[0], "daemon", "--socket", sock, "--backend", "host", "--grace", "1s")
	daemon.Stdout, daemon.Stderr = logf, logf
	if err := daemon.Start(); err != nil {
		return err
	}
	defer func() {
		daemon.Process.Signal(syscall.SIGTERM)
		daemon.Wait()
	}()
	ctx := context.Background()
	info := func(notPID int) (*gpushm.Info, error) {
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
	if _, err := info(0); err != nil {
		return err
	}

	// A, at a pid above any the daemon's threads took, connects and
	// hands its connection over.
	if err := setLastPID(9999); err != nil {
		return err
	}
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	theirs := os.NewFile(uintptr(pair[1]), "pair")
	a := exec.Command(os.Args[0])
	a.Env = append(os.Environ(), "GPUSHM_TEST_PASSCONN="+sock)
	a.ExtraFiles = []*os.File{theirs}
	a.Stderr = os.Stderr
	stdin, err := a.StdinPipe()
	if err != nil {
		return err
	}
	if err := a.Start(); err != nil {
		return err
	}
	theirs.Close()
	fd, err := recvFD(pair[0])
	if err != nil {
		return fmt.Errorf("the connection from A: %w", err)
	}
	pid := a.Process.Pid
	stdin.Close()
	if err := a.Wait(); err != nil {
		return fmt.Errorf("A: %w", err)
	}

	// B gets A's pid.
	var b *exec.Cmd
	for try := 0; ; try++ {
		if err := setLastPID(pid - 1); err != nil {
			return err
		}
		b = exec.Command("sleep", "1000")
		if err := b.Start(); err != nil {
			return err
		}
		if b.Process.Pid == pid {
			break
		}
		b.Process.Kill()
		b.Wait()
		if try == 100 {
			return fmt.Errorf("pid %d never came free for B", pid)
		}
		time.Sleep(10 * time.Millisecond)
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

	inf, err := info(0)
	if err != nil {
		return err
	}
	syscall.Kill(inf.PID, syscall.SIGKILL)
	if _, err := info(inf.PID); err != nil {
		return err
	}
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		inf, err := info(0)
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
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("after the restart and its grace period, with B (pid %d) alive: %v, want [own] (A made \"inherited\", and A is gone)", pid, names)
		}
	}
	if err := b.Process.Signal(syscall.Signal(0)); err != nil {
		return fmt.Errorf("B: %w", err)
	}
	fmt.Println("ok pid reuse")
	return nil
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
