package server_test

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/server"
	"github.com/gpushm/gpushm/internal/testdaemon"
	"github.com/gpushm/gpushm/internal/testutil"
	"github.com/gpushm/gpushm/internal/wire"
)

// startTime reads a process's start time as the kernel reports it (field
// 22 of /proc/PID/stat).
func startTime(t *testing.T, pid int) uint64 {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		t.Fatal(err)
	}
	f := bytes.Fields(b[bytes.LastIndexByte(b, ')')+1:])
	n, err := strconv.ParseUint(string(f[19]), 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// sleeper is a process that lives until killed.
func sleeper(t *testing.T) *exec.Cmd {
	t.Helper()
	cmd := exec.Command("sleep", "1000")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	return cmd
}

// names lists the registry's names.
func names(reg *segment.Registry) []string {
	var out []string
	for _, inf := range reg.List("", 0) {
		out = append(out, inf.Name)
	}
	return out
}

// waitNames waits until the registry names exactly want.
func waitNames(t *testing.T, reg *segment.Registry, want []string, why string) {
	t.Helper()
	for deadline := time.Now().Add(20 * time.Second); ; {
		got := names(reg)
		if slices.Equal(got, want) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: names %v, want %v", why, got, want)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestRestoredBoundFollowsCreator: after a restart, a creator-bound
// segment lives exactly as long as the process that made it, whatever the
// grace period: it ends at once if that process is gone or its pid now
// names another process, when the process exits, or when its connection
// ends once it came back; only a creator that cannot be named waits for
// the grace period.
func TestRestoredBoundFollowsCreator(t *testing.T) {
	alive := sleeper(t)
	back := sleeper(t)
	dead := exec.Command("true")
	if err := dead.Run(); err != nil {
		t.Fatal(err)
	}
	p := func(cmd *exec.Cmd) segment.Process {
		return segment.Process{PID: cmd.Process.Pid, Start: startTime(t, cmd.Process.Pid)}
	}
	creators := map[string]segment.Process{
		"alive": p(alive),
		"back":  p(back),
		// A pid that names another process now: the start time differs.
		"reused":  {PID: alive.Process.Pid, Start: startTime(t, alive.Process.Pid) + 1},
		"dead":    {PID: dead.Process.Pid, Start: 1},
		"unknown": {},
	}
	d := testdaemon.StartOn(t, fakeBackend{}, func(srv *server.Server) {
		var items []segment.Restored
		id := uint64(0)
		for name, c := range creators {
			mem, err := fakeBackend{}.Allocate(0, 4096)
			if err != nil {
				t.Fatal(err)
			}
			id++
			now := time.Now().UnixNano()
			items = append(items, segment.Restored{Memory: mem, Record: segment.Record{
				ID: id, Name: name, Linked: true, Size: 4096, Alloc: mem.Size(), Mode: 0o600,
				Created: now, Modified: now, Bound: true, Session: "session-" + name,
				CreatorPID: c.PID, CreatorStart: c.Start,
			}})
		}
		grace := time.Hour
		srv.Registry().Restore(items, id, grace)
		srv.StartGrace(time.Now().Add(grace))
	})
	reg := d.Server.Registry()
	if got := names(reg); !slices.Equal(got, []string{"alive", "back", "unknown"}) {
		t.Fatalf("right after the restart: %v, want [alive back unknown] (the dead and the reused creator's end at once)", got)
	}

	// The creator of "back" says hello again, here: the segment is bound
	// to this connection now, not to the process that made it.
	r := testutil.DialRaw(t, d.Socket)
	if rep := r.Call(`{"id":1,"op":"hello","version":1,"session":"session-back"}`, -1); rep.Error != nil {
		t.Fatalf("hello = %+v", rep.Error)
	}
	back.Process.Kill()
	back.Wait()
	alive.Process.Kill()
	alive.Wait()
	waitNames(t, reg, []string{"back", "unknown"}, "after both creators exited")
	if reg.GraceLeft() == 0 {
		t.Fatal("the grace period is over: it, not the creator's exit, may have ended the segment")
	}
	// The connection that took "back" ends it.
	r.Conn.Close()
	waitNames(t, reg, []string{"unknown"}, "after the connection that took it back closed")
}

// TestRestoredBoundPidReuse: a creator recorded with a start time that
// the pid's process does not have is another process, even though the
// pid is alive.
func TestRestoredBoundPidReuse(t *testing.T) {
	self := segment.Process{PID: os.Getpid(), Start: startTime(t, os.Getpid())}
	for _, tc := range []struct {
		name string
		p    segment.Process
		kept bool
	}{
		{"same process", self, true},
		{"pid reused", segment.Process{PID: self.PID, Start: self.Start - 1}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := testdaemon.StartOn(t, fakeBackend{}, func(srv *server.Server) {
				mem, err := fakeBackend{}.Allocate(0, 4096)
				if err != nil {
					t.Fatal(err)
				}
				srv.Registry().Restore([]segment.Restored{{Memory: mem, Record: segment.Record{
					ID: 1, Name: "s", Linked: true, Size: 4096, Alloc: mem.Size(), Mode: 0o600,
					Bound: true, Session: "x", CreatorPID: tc.p.PID, CreatorStart: tc.p.Start,
				}}}, 1, time.Hour)
				srv.StartGrace(time.Now().Add(time.Hour))
			})
			_, _, err := d.Server.Registry().Lookup("s")
			if kept := err == nil; kept != tc.kept {
				t.Fatalf("creator %+v (this process is %+v): kept = %v, want %v", tc.p, self, kept, tc.kept)
			}
			if err != nil && !errors.Is(err, segment.ErrNotFound) {
				t.Fatal(err)
			}
		})
	}
}

// TestIdentityAtAccept: a connection's process is the one that connected,
// named when the connection was accepted. A child connects, says hello,
// hands its connection to this process over SCM_RIGHTS and exits; a
// temporary segment made over the connection afterwards is journaled with
// the child as its creator (its pid and start time), not with whatever
// process holds the pid by then, nor as unknown.
func TestIdentityAtAccept(t *testing.T) {
	d := testdaemon.Start(t, "host")
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	mine, theirs := os.NewFile(uintptr(pair[0]), "pair"), os.NewFile(uintptr(pair[1]), "pair")
	defer mine.Close()
	child := exec.Command(os.Args[0], "-test.run=^TestHelperPassConn$")
	child.Env = append(os.Environ(), "GPUSHM_TEST_PASSCONN="+d.Socket)
	child.ExtraFiles = []*os.File{theirs}
	stdin, err := child.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	child.Stderr = os.Stderr
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	theirs.Close()
	t.Cleanup(func() { child.Process.Kill(); child.Wait() })
	buf, oob := make([]byte, 1), make([]byte, unix.CmsgSpace(4))
	_, oobn, _, _, err := unix.Recvmsg(pair[0], buf, oob, unix.MSG_CMSG_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	fds := parseRights(t, oob[:oobn])
	want := segment.Process{PID: child.Process.Pid, Start: startTime(t, child.Process.Pid)}
	stdin.Close() // the child exits
	if err := child.Wait(); err != nil {
		t.Fatalf("child: %v", err)
	}
	wc, err := wire.NewConn(fds[0])
	if err != nil {
		t.Fatal(err)
	}
	r := testutil.NewRaw(t, wc)
	defer wc.Close()
	if rep := r.Call(`{"id":2,"op":"create","name":"inherited","size":4096,"lifetime":"connection"}`, -1); rep.Error != nil {
		t.Fatalf("create over the inherited connection: %+v", rep.Error)
	}
	var got []segment.Process
	for _, b := range d.Server.Registry().Bound() {
		got = append(got, b.Creator)
	}
	if len(got) != 1 || got[0] != want {
		t.Fatalf("creator of a segment made over a connection the child made = %+v, want %+v (the child, named at accept)", got, want)
	}
}

// TestHelperPassConn is the child of TestIdentityAtAccept: it connects to
// the daemon, says hello, sends the connection over descriptor 3 and exits
// once its stdin closes.
func TestHelperPassConn(t *testing.T) {
	sock := os.Getenv("GPUSHM_TEST_PASSCONN")
	if sock == "" {
		t.Skip("a helper of TestIdentityAtAccept")
	}
	c, err := wire.Dial(sock)
	if err != nil {
		t.Fatal(err)
	}
	testutil.NewRaw(t, c).Hello()
	if err := unix.Sendmsg(3, []byte{0}, unix.UnixRights(c.FD()), nil, 0); err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, os.Stdin)
}

// parseRights returns the descriptors of an SCM_RIGHTS control message.
func parseRights(t *testing.T, oob []byte) []int {
	t.Helper()
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil || len(msgs) != 1 {
		t.Fatalf("control message: %v (%d)", err, len(msgs))
	}
	fds, err := unix.ParseUnixRights(&msgs[0])
	if err != nil || len(fds) != 1 {
		t.Fatalf("rights: %v %v", fds, err)
	}
	return fds
}
