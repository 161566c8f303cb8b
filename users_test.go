package gpushm_test

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/testdaemon"
	"github.com/gpushm/gpushm/internal/testutil"
	"github.com/gpushm/gpushm/internal/wire"
)

// asUser runs ops ("open-rw:NAME", "open-ro:NAME", "unlink:NAME",
// "create:NAME", "chown:NAME", "uid") in a copy of this test binary running as uid:gid, and
// returns the result code of each ("OK" or an errno name).
func asUser(t *testing.T, socket string, uid, gid uint32, ops ...string) []string {
	t.Helper()
	return asUserFiles(t, socket, uid, gid, nil, ops...)
}

// asUserFiles is asUser with files passed on to the client, as descriptors
// 3, 4, ... (exec.Cmd's ExtraFiles).
func asUserFiles(t *testing.T, socket string, uid, gid uint32, files []*os.File, ops ...string) []string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("running clients as other users needs root")
	}
	cmd := exec.Command(testutil.BinaryForOthers(t), "-test.run=^$")
	cmd.Env = append(os.Environ(), "GPUSHM_TEST_CHILD=ops", "GPUSHM_SOCKET="+socket, "OPS="+strings.Join(ops, " "))
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: gid}}
	cmd.ExtraFiles = files
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, os.Stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("client as %d:%d: %v", uid, gid, err)
	}
	return strings.Fields(out.String())
}

// rawUser is a client process running as another user that speaks the
// protocol by hand, one request at a time, on one connection it keeps:
// an attacker that need not follow the client library.
type rawUser struct {
	uid uint32
	in  io.WriteCloser
	out *bufio.Reader
	id  uint64
}

// startRawUser starts a rawUser as uid:gid on socket; it has said hello
// when this returns, and ends with the test.
func startRawUser(t *testing.T, socket string, uid, gid uint32) *rawUser {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("running clients as other users needs root")
	}
	cmd := exec.Command(testutil.BinaryForOthers(t), "-test.run=^$")
	cmd.Env = append(os.Environ(), "GPUSHM_TEST_CHILD=raw", "GPUSHM_SOCKET="+socket)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: gid}}
	cmd.Stderr = os.Stderr
	in, _ := cmd.StdinPipe()
	out, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { in.Close(); cmd.Process.Kill(); cmd.Wait() })
	u := &rawUser{uid: uid, in: in, out: bufio.NewReader(out)}
	if rep := u.do(t, `{"op":"hello","version":1}`); rep.Error != nil {
		t.Fatalf("uid %d: hello = %v", uid, rep.Error)
	}
	return u
}

// do sends req (a JSON object without its id) under the next id and
// returns the reply.
func (u *rawUser) do(t *testing.T, req string) *wire.Reply {
	t.Helper()
	u.id++
	fmt.Fprintf(u.in, "{\"id\":%d,%s\n", u.id, strings.TrimPrefix(req, "{"))
	line, err := u.out.ReadString('\n')
	if err != nil {
		t.Fatalf("uid %d: %s: %v", u.uid, req, err)
	}
	rep, err := wire.DecodeReply([]byte(line))
	if err != nil {
		t.Fatalf("uid %d: %s: reply %q: %v", u.uid, req, line, err)
	}
	return rep
}

// rawChild is the other-user side of startRawUser: each line of its
// input is a request, sent as it is; the reply with its id is written
// out as one line (a channel's control block packet passed over, every
// descriptor closed, leases kept: they are the connection's).
func rawChild() error {
	c, err := wire.Dial(os.Getenv("GPUSHM_SOCKET"))
	if err != nil {
		return err
	}
	defer c.Close()
	sc := bufio.NewScanner(os.Stdin)
	sc.Buffer(nil, wire.MaxMessage)
	for sc.Scan() {
		id, _ := wire.RequestID(sc.Bytes())
		if err := c.Send(sc.Bytes(), -1); err != nil {
			return err
		}
		for {
			b, fd, err := c.Recv()
			if err != nil {
				return err
			}
			if fd >= 0 {
				syscall.Close(fd)
			}
			rep, err := wire.DecodeReply(b)
			if err != nil {
				return err
			}
			if (rep.ID == id || rep.ID == 0 && rep.Error != nil) && !rep.ControlFD {
				fmt.Printf("%s\n", b)
				break
			}
		}
	}
	return sc.Err()
}

// opsChild is the other-user side of asUser.
func opsChild(ctx context.Context, c *gpushm.Client) error {
	for _, op := range strings.Fields(os.Getenv("OPS")) {
		verb, name, _ := strings.Cut(op, ":")
		var err error
		switch verb {
		case "open-rw", "open-ro":
			var s *gpushm.Segment
			if s, err = c.Open(ctx, name, &gpushm.OpenOptions{ReadOnly: verb == "open-ro"}); err == nil {
				_, err = s.Map()
				s.Close()
			}
		case "fill-ro": // open read-only, then have the daemon write into it
			var s *gpushm.Segment
			if s, err = c.Open(ctx, name, &gpushm.OpenOptions{ReadOnly: true}); err == nil {
				var f *os.File
				if f, err = os.Open("/proc/self/exe"); err == nil {
					_, err = s.Fill(ctx, f, 0, 0, 4096)
					f.Close()
				}
				s.Close()
			}
		case "fill-path", "dump-path", "fill-fd", "dump-fd": // fdaccess_test.go
			var oe *openError
			if err = copyOp(ctx, c, verb, name); errors.As(err, &oe) {
				fmt.Println(oe)
				continue
			}
		case "unlink":
			err = c.Unlink(ctx, name)
		case "rename": // rename:FROM>TO
			from, to, _ := strings.Cut(name, ">")
			err = c.Rename(ctx, from, to)
		case "chmod": // to 0666: only the owner or root may
			err = c.Chmod(ctx, name, 0o666)
		case "evict":
			_, err = c.Evict(ctx, name)
		case "evict-disk":
			_, err = c.EvictTo(ctx, name, "disk")
		case "sync":
			_, err = c.Sync(ctx, name)
		case "offer":
			_, err = c.Offer(ctx, name, true)
		case "load":
			_, err = c.Load(ctx, name)
		case "pin":
			_, err = c.Pin(ctx, name, true)
		case "chown": // give the segment to root: only root may
			err = c.Chown(ctx, name, 0, 0)
		case "uid": // who this process is, where it runs
			fmt.Printf("uid=%d\n", os.Getuid())
			continue
		case "create":
			size := int64(4096)
			if n, sz, ok := strings.Cut(name, ":"); ok {
				name = n
				fmt.Sscan(sz, &size)
			}
			_, _, err = c.CreateOnly(ctx, name, size, nil)
		default:
			return fmt.Errorf("unknown op %q", op)
		}
		code := "OK"
		var we *wire.Error
		if errors.As(err, &we) {
			code = we.Code
		} else if err != nil {
			return err
		}
		fmt.Println(code)
	}
	return nil
}

func TestOtherUsers(t *testing.T) {
	d := testdaemon.Start(t, "host")
	ctx := context.Background()
	c := dial(t, d.Socket)
	mode := func(m uint32) *gpushm.CreateOptions { return &gpushm.CreateOptions{Mode: &m} }
	// Owned by root:root.
	for name, m := range map[string]uint32{"private": 0o600, "shared-ro": 0o644, "shared-rw": 0o666, "group-r": 0o640, "none": 0o000} {
		if _, _, err := c.CreateOnly(ctx, name, 4096, mode(m)); err != nil {
			t.Fatal(err)
		}
	}
	const nobody, other = 65534, 4242
	tests := []struct {
		uid, gid uint32
		op, want string
	}{
		{nobody, nobody, "open-rw:private", "EACCES"},
		{nobody, nobody, "open-ro:private", "EACCES"},
		{nobody, nobody, "open-ro:shared-ro", "OK"},
		{nobody, nobody, "open-rw:shared-ro", "EACCES"},
		{nobody, nobody, "fill-ro:shared-ro", "EACCES"},
		{nobody, nobody, "fill-ro:shared-rw", "OK"},
		{nobody, nobody, "open-rw:shared-rw", "OK"},
		{nobody, nobody, "open-ro:group-r", "EACCES"},
		{other, 0, "open-ro:group-r", "OK"}, // in root's group
		{other, 0, "open-rw:group-r", "EACCES"},
		{nobody, nobody, "open-ro:none", "EACCES"},
		{nobody, nobody, "unlink:shared-rw", "EPERM"},
		{nobody, nobody, "create:nobodys", "OK"},
		{other, other, "open-ro:nobodys", "EACCES"}, // 0600 by default
		{other, other, "unlink:nobodys", "EPERM"},
		{nobody, nobody, "open-rw:nobodys", "OK"},
		{nobody, nobody, "unlink:nobodys", "OK"},
	}
	for _, tc := range tests {
		got := asUser(t, d.Socket, tc.uid, tc.gid, tc.op)
		if len(got) != 1 || got[0] != tc.want {
			t.Errorf("uid %d gid %d %s = %v, want %s", tc.uid, tc.gid, tc.op, got, tc.want)
		}
	}
	// Root may do anything, whatever the mode.
	s, err := c.Open(ctx, "none", nil)
	if err != nil {
		t.Fatalf("root open of a mode-0 segment: %v", err)
	}
	s.Close()
	// What nobody created was owned by nobody.
	if _, err := c.Stat(ctx, "nobodys"); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("nobody's segment should be gone after nobody unlinked it: %v", err)
	}
}

// TestOtherUsersEveryOperation: each operation that changes a segment or
// its name, played by another user against root's segments of every
// mode (docs/security.md, "The threat model, operation by operation").
func TestOtherUsersEveryOperation(t *testing.T) {
	d := testdaemon.Start(t, "host")
	ctx := context.Background()
	c := dial(t, d.Socket)
	for name, m := range map[string]uint32{"private": 0o600, "shared-ro": 0o644, "shared-rw": 0o666} {
		if _, _, err := c.CreateOnly(ctx, name, 4096, &gpushm.CreateOptions{Mode: &m}); err != nil {
			t.Fatal(err)
		}
	}
	const nobody = 65534
	tests := []struct{ op, want string }{
		{"rename:private>mine", "EPERM"},      // taking root's name away
		{"rename:shared-rw>mine", "EPERM"},    // even one it may write
		{"create:nobodys", "OK"},              //
		{"rename:nobodys>private", "EPERM"},   // nor replacing it with its own
		{"rename:nobodys>shared-rw", "EPERM"}, //
		{"chmod:private", "EPERM"},            //
		{"chmod:shared-rw", "EPERM"},          // writing is not owning
		{"evict:shared-ro", "EPERM"},          // moving what others read
		{"pin:shared-ro", "EPERM"},            //
		{"evict-disk:shared-rw", "EPERM"},     // nor to disk, before anything else is checked
		{"sync:shared-rw", "EPERM"},
		{"offer:shared-rw", "EPERM"},  // nor offer it to other nodes           // writing is not owning: no disk writes of root's segments
		{"unlink:shared-rw", "EPERM"}, //
		{"load:private", "EACCES"},    // load needs read access
	}
	var ops, want []string
	for _, tc := range tests {
		ops, want = append(ops, tc.op), append(want, tc.want)
	}
	got := asUser(t, d.Socket, nobody, nobody, ops...)
	for i, tc := range tests {
		if i >= len(got) || got[i] != want[i] {
			t.Errorf("nobody %s = %v, want %s", tc.op, got, tc.want)
			break
		}
	}
	for name, m := range map[string]uint32{"private": 0o600, "shared-ro": 0o644, "shared-rw": 0o666} {
		inf, err := c.Stat(ctx, name)
		if err != nil || inf.UID != 0 || inf.Mode != m {
			t.Errorf("root's %s after nobody's tries: %+v, %v; want root's, mode %#o", name, inf, err, m)
		}
	}
}

func TestQuotasForOtherUsers(t *testing.T) {
	d := testdaemon.Start(t, "host")
	d.Server.Registry().SetLimits(segment.Limits{UserBytes: 64 << 10, UserSegments: 3, DeviceBytes: map[int]int64{0: 1 << 20}})
	ctx := context.Background()
	c := dial(t, d.Socket)
	got := asUser(t, d.Socket, 65534, 65534,
		"create:q1:32768", "create:q2:32768", "create:q3:1", "create:q4:4096", "create:q5:1")
	// q1 and q2 fill the 64 KiB quota exactly; anything more, even one byte
	// (a 4 KiB page), is refused.
	want := []string{"OK", "OK", "ENOSPC", "ENOSPC", "ENOSPC"}
	if strings.Join(got, " ") != strings.Join(want, " ") {
		t.Fatalf("nobody's creates = %v, want %v", got, want)
	}
	if u := usage(t, c); u.Segments != 2 || u.Bytes != 64<<10 {
		t.Fatalf("after refusals: %+v, want exactly the two accepted segments", u)
	}
	// Another user has a quota of their own; the count limit bites at 3.
	got = asUser(t, d.Socket, 4242, 4242, "create:a:1", "create:b:1", "create:c:1", "create:d:1")
	if strings.Join(got, " ") != "OK OK OK ENOSPC" {
		t.Fatalf("uid 4242's creates = %v, want the 4th refused", got)
	}
	// Root is held to the device limit only: 1 MiB, of which 76 KiB is used.
	if _, _, err := c.CreateOnly(ctx, "root-big", 900<<10, nil); err != nil {
		t.Fatalf("root within the device limit: %v", err)
	}
	_, _, err := c.CreateOnly(ctx, "root-more", 100<<10, nil)
	if !errors.Is(err, syscall.ENOSPC) || !strings.Contains(err.Error(), "limit 1048576") {
		t.Fatalf("root over the device limit = %v, want ENOSPC with the limit", err)
	}
}

func TestModeChangesTakeEffect(t *testing.T) {
	d := testdaemon.Start(t, "host")
	ctx := context.Background()
	c := dial(t, d.Socket)
	if _, _, err := c.CreateOnly(ctx, "m", 4096, nil); err != nil {
		t.Fatal(err)
	}
	check := func(uid uint32, op, want string) {
		t.Helper()
		if got := asUser(t, d.Socket, uid, uid, op); len(got) != 1 || got[0] != want {
			t.Fatalf("uid %d %s = %v, want %s", uid, op, got, want)
		}
	}
	check(65534, "open-ro:m", "EACCES")
	if err := c.Chmod(ctx, "m", 0o644); err != nil {
		t.Fatal(err)
	}
	check(65534, "open-ro:m", "OK")
	check(65534, "open-rw:m", "EACCES")
	if err := c.Chown(ctx, "m", 65534, 65534); err != nil {
		t.Fatal(err)
	}
	check(65534, "open-rw:m", "OK")
	check(4242, "unlink:m", "EPERM")
	check(65534, "unlink:m", "OK")
}
