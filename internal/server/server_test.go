package server_test

import (
	"encoding/json"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm/internal/server"
	"github.com/gpushm/gpushm/internal/testdaemon"
	"github.com/gpushm/gpushm/internal/testutil"
	"github.com/gpushm/gpushm/internal/wire"
)

func code(rep *wire.Reply) string {
	if rep.Error == nil {
		return ""
	}
	return rep.Error.Code
}

func TestBadInputChangesNothing(t *testing.T) {
	d := testdaemon.Start(t, "host")
	r := testutil.DialRaw(t, d.Socket)

	if got := code(r.Call(`{"id":1,"op":"list"}`, -1)); got != "EPROTO" {
		t.Fatalf("op before hello: %q, want EPROTO", got)
	}
	if got := code(r.Call(`{"id":1,"op":"hello","version":99}`, -1)); got != "EPROTO" {
		t.Fatalf("hello version 99: %q, want EPROTO", got)
	}
	r.Hello()

	long := strings.Repeat("x", 256)
	tests := []struct {
		name, msg, code string
	}{
		{"not json", `{"id":2,"op":`, "EPROTO"},
		{"unknown field", `{"id":3,"op":"stat","nmae":"x"}`, "EPROTO"},
		{"unknown op", `{"id":4,"op":"explode"}`, "ENOSYS"},
		{"empty name", `{"id":5,"op":"create","name":"","size":1}`, "EINVAL"},
		{"slash", `{"id":6,"op":"create","name":"a/b","size":1}`, "EINVAL"},
		{"nul", `{"id":7,"op":"create","name":"a\u0000b","size":1}`, "EINVAL"},
		{"dot", `{"id":8,"op":"create","name":".","size":1}`, "EINVAL"},
		{"dotdot", `{"id":9,"op":"create","name":"..","size":1}`, "EINVAL"},
		{"long name", `{"id":10,"op":"create","name":"` + long + `","size":1}`, "ENAMETOOLONG"},
		{"zero size", `{"id":11,"op":"create","name":"z","size":0}`, "EINVAL"},
		{"negative size", `{"id":12,"op":"create","name":"z","size":-1}`, "EINVAL"},
		{"absurd size", `{"id":13,"op":"create","name":"z","size":9223372036854775807}`, "ENOSPC"}, // more than the device holds
		{"size overflow", `{"id":14,"op":"create","name":"z","size":1e30}`, "EPROTO"},
		{"bad mode", `{"id":15,"op":"create","name":"z","size":1,"mode":4095}`, "EINVAL"},
		{"bad device", `{"id":16,"op":"create","name":"z","size":1,"device":7}`, "ENODEV"},
		{"open missing", `{"id":17,"op":"open","name":"nope"}`, "ENOENT"},
		{"close unheld", `{"id":18,"op":"close","segment":12345}`, "EINVAL"},
		{"unlink missing", `{"id":19,"op":"unlink","name":"nope"}`, "ENOENT"},
		{"oversized meta", `{"id":20,"op":"create","name":"z","size":1,"meta":"` + strings.Repeat("m", wire.MaxMeta) + `"}`, "EINVAL"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := code(r.Call(tc.msg, -1)); got != tc.code {
				t.Fatalf("%.80s: code %q, want %q", tc.msg, got, tc.code)
			}
		})
	}

	// An oversized packet, and a descriptor nobody asked for.
	if got := code(r.Call(`{"id":30,"op":"stat","name":"`+strings.Repeat("y", wire.MaxMessage)+`"}`, -1)); got != "EPROTO" {
		t.Fatalf("oversized packet: %q, want EPROTO", got)
	}
	f, _ := os.CreateTemp(t.TempDir(), "fd")
	defer f.Close()
	if got := code(r.Call(`{"id":31,"op":"info"}`, int(f.Fd()))); got != "EPROTO" {
		t.Fatalf("unsolicited fd: %q, want EPROTO", got)
	}

	// None of that changed anything, and the connection still works.
	rep := r.Call(`{"id":40,"op":"info"}`, -1)
	if rep.Error != nil || rep.Usage == nil || rep.Usage.Segments != 0 {
		t.Fatalf("info after bad input = %+v (usage %+v)", rep, rep.Usage)
	}
	if rep := r.Call(`{"id":41,"op":"create","name":"ok","size":1}`, -1); rep.Error != nil || rep.Created == nil || !*rep.Created {
		t.Fatalf("create after bad input = %+v", rep)
	}
	if got := code(r.Call(`{"id":42,"op":"create","name":"ok","size":1}`, -1)); got != "EEXIST" {
		t.Fatalf("duplicate create: %q, want EEXIST", got)
	}
	if rep := r.Call(`{"id":43,"op":"list"}`, -1); len(rep.Segments) != 1 {
		t.Fatalf("list = %+v, want only 'ok'", rep.Segments)
	}
}

func TestOpenSendsUsableDescriptor(t *testing.T) {
	d := testdaemon.Start(t, "host")
	r := testutil.DialRaw(t, d.Socket)
	r.Hello()
	r.Call(`{"id":2,"op":"create","name":"s","size":100,"meta":{"dtype":"uint8","shape":[100]}}`, -1)
	if err := r.Conn.Send([]byte(`{"id":3,"op":"open","name":"s"}`), -1); err != nil {
		t.Fatal(err)
	}
	b, fd, err := r.Conn.Recv()
	if err != nil || fd < 0 {
		t.Fatalf("open reply %q fd %d: %v", b, fd, err)
	}
	defer unix.Close(fd)
	var rep wire.Reply
	json.Unmarshal(b, &rep)
	if !rep.FD || rep.Segment.Size != 100 || rep.Segment.AllocSize != 4096 || string(rep.Segment.Meta) != `{"dtype":"uint8","shape":[100]}` {
		t.Fatalf("open reply = %s", b)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Size != 4096 {
		t.Fatalf("fstat of the received fd: size %d, %v", st.Size, err)
	}
	// Sealed: a client cannot shrink the memory under other mappers.
	if err := unix.Ftruncate(fd, 0); !errors.Is(err, syscall.EPERM) {
		t.Fatalf("ftruncate of the segment fd = %v, want EPERM", err)
	}
}

func TestListenRefusesLiveDaemonAndReplacesStaleSocket(t *testing.T) {
	d := testdaemon.Start(t, "host")
	if _, err := server.Listen(d.Socket, ""); !errors.Is(err, server.ErrRunning) {
		t.Fatalf("Listen on a live daemon's socket = %v, want ErrRunning", err)
	}
	dir, _ := os.MkdirTemp("", "gpushm-stale-")
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "s.sock")
	// A socket file with nobody behind it, as a crashed daemon leaves.
	fd, _ := unix.Socket(unix.AF_UNIX, unix.SOCK_SEQPACKET, 0)
	if err := unix.Bind(fd, &unix.SockaddrUnix{Name: path}); err != nil {
		t.Fatal(err)
	}
	unix.Close(fd)
	ln, err := server.Listen(path, "")
	if err != nil {
		t.Fatalf("Listen over a stale socket: %v", err)
	}
	defer ln.Close()
	c, err := net.Dial("unixpacket", path)
	if err != nil {
		t.Fatalf("dial the new socket: %v", err)
	}
	c.Close()
	if st, _ := os.Stat(path); st.Mode().Perm() != 0o666 {
		t.Fatalf("socket mode %v, want 0666", st.Mode().Perm())
	}
}
