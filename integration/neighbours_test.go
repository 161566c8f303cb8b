package integration

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/bench"
	"github.com/gpushm/gpushm/internal/testutil"
	"github.com/gpushm/gpushm/internal/wire"
)

// These tests run the daemon as users do (a supervisor and its serving
// process) and two unprivileged users as processes of their own: one
// exhausts each of its limits while the other keeps working. The daemon
// runs with a small descriptor limit, so that the default limits, which
// are sized from it, are small enough to exhaust quickly.

const (
	hostileUID   = 4243
	neighbourUID = 4244
	// testNOFILE is the daemon's descriptor limit in these tests. The
	// defaults follow from it: --max-segments 1024 (half), --max-connections
	// 896 (less a sixteenth, at least 128, kept for the daemon),
	// --user-segments 256 and --user-connections 224 (a quarter of each).
	testNOFILE          = 2048
	testMaxSegments     = 1024
	testMaxConnections  = 896
	testUserSegments    = 256
	testUserConnections = 224
)

// procStats are what a daemon process holds: OS threads, descriptors and
// resident memory (RSS).
type procStats struct {
	threads, fds int
	rssKB        int
}

func statsOf(t *testing.T, pid int) procStats {
	t.Helper()
	f, err := bench.ReadProcFigures(pid)
	if err != nil {
		t.Fatal(err)
	}
	return procStats{threads: f.Threads, fds: f.FDs, rssKB: int(f.RSS >> 10)}
}

// steady waits until pid's figures stop changing (two samples a second
// apart agree), and returns them.
func steady(t *testing.T, pid int) procStats {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	last := statsOf(t, pid)
	for {
		time.Sleep(time.Second)
		now := statsOf(t, pid)
		if now == last || time.Now().After(deadline) {
			return now
		}
		last = now
	}
}

// near reports whether v is at most 10% (or 2, for small counts) over
// idle.
func near(v, idle int) bool {
	// At least two over: on a loaded machine Go makes a thread for a P
	// handed off from a goroutine blocked in a system call (a memfd's
	// fallocate, say), and keeps it parked for good; what a neighbour
	// could leak grows with what it does (hundreds of segments or
	// connections here), not by one or two.
	return v-idle <= max(idle/10, 2)
}

// nearThreads is near for thread counts: Go may park a thread for each of
// its Ps (one a core) that a blocking system call handed off, so a machine
// of many cores allows as many more.
func nearThreads(v, idle int) bool {
	return near(v, idle) || v-idle <= runtime.NumCPU()
}

// settle waits until the serving process's threads, descriptors and
// resident memory, and the supervisor's descriptors, are back within 10%
// of their idle values. skipThreads leaves out threads and memory (see the
// connections case).
func settle(t *testing.T, what string, serving, sup int, idle, supIdle procStats, skipThreads bool) {
	t.Helper()
	deadline := time.Now().Add(90 * time.Second)
	for {
		now, supNow := statsOf(t, serving), statsOf(t, sup)
		ok := near(now.fds, idle.fds) && near(supNow.fds, supIdle.fds)
		if !skipThreads {
			ok = ok && nearThreads(now.threads, idle.threads) && near(now.rssKB, idle.rssKB)
		}
		if ok {
			t.Logf("%s: back to idle: serving %+v (idle %+v), supervisor fds %d (idle %d)", what, now, idle, supNow.fds, supIdle.fds)
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not back within 10%% of idle after 90s: serving %+v, idle %+v; supervisor fds %d, idle %d",
				what, now, idle, supNow.fds, supIdle.fds)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// shareRootBytes has root make name, size bytes that every user may read,
// beginning with "root's bytes", and returns it mapped.
func shareRootBytes(t *testing.T, root *gpushm.Client, name string, size int64) (*gpushm.Segment, *gpushm.Mapping) {
	t.Helper()
	mode := uint32(0o644)
	seg, err := root.Create(context.Background(), name, size, &gpushm.CreateOptions{Mode: &mode})
	if err != nil {
		t.Fatal(err)
	}
	m, err := seg.Map()
	if err != nil {
		t.Fatal(err)
	}
	copy(m.Bytes(), "root's bytes")
	return seg, m
}

// userClient is a client process running as another user, driven over
// its stdin and stdout (neighbourMain).
type userClient struct {
	uid  int
	in   io.WriteCloser
	out  *bufio.Reader
	errs *syncBuffer
}

func startUserClient(t *testing.T, socket string, uid int) *userClient {
	t.Helper()
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), "GPUSHM_TEST_NEIGHBOUR="+strconv.Itoa(uid), "GPUSHM_SOCKET="+socket)
	in, _ := cmd.StdinPipe()
	out, _ := cmd.StdoutPipe()
	uc := &userClient{uid: uid, in: in, out: bufio.NewReader(out), errs: &syncBuffer{}}
	cmd.Stderr = uc.errs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	return uc
}

// ask sends a command and returns the answer's fields: a result, then the
// error code and message of a refusal ("OK" and "-" for none).
func (uc *userClient) ask(t *testing.T, cmd string) (n int, code, msg string) {
	t.Helper()
	fmt.Fprintln(uc.in, cmd)
	line, err := uc.out.ReadString('\n')
	if err != nil {
		t.Fatalf("uid %d: %s: %v\nstderr:\n%s", uc.uid, cmd, err, uc.errs.String())
	}
	f := strings.SplitN(strings.TrimSpace(line), " ", 3)
	if len(f) != 3 {
		t.Fatalf("uid %d: %s: bad answer %q", uc.uid, cmd, line)
	}
	n, _ = strconv.Atoi(f[0])
	return n, f[1], f[2]
}

// works has uc do what a neighbour does: create, write, open read-only,
// read back and unlink a segment of its own, and read one root shares.
func (uc *userClient) works(t *testing.T, during string) {
	t.Helper()
	if _, code, msg := uc.ask(t, "work"); code != "OK" {
		t.Fatalf("uid %d could not work while %s: %s %s", uc.uid, during, code, msg)
	}
}

func requireUsers(t *testing.T) {
	t.Helper()
	if os.Getuid() != 0 {
		t.Skip("needs root: clients run as other users")
	}
}

// TestHostileNeighbour: one user exhausts each of its default limits
// (connections, segments, bytes) while another keeps creating, opening and
// reading; every refusal names the limit and its numbers; afterwards the
// daemon's threads, descriptors and memory go back to their idle values.
func TestHostileNeighbour(t *testing.T) {
	requireUsers(t)
	dir := testutil.SocketDir(t)
	os.Chmod(dir, 0o755)
	sock := filepath.Join(dir, "gpushm.sock")
	d := Start(t, Options{Socket: sock, NoFile: testNOFILE})
	sup := d.cmd.Process.Pid
	ctx := context.Background()
	root, err := gpushm.Dial(ctx, sock)
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	shared, _ := shareRootBytes(t, root, "shared", 1<<20)
	shared.Close()

	hostile := startUserClient(t, sock, hostileUID)
	neighbour := startUserClient(t, sock, neighbourUID)
	neighbour.works(t, "idle")
	hostile.works(t, "idle")
	// The idle values are those of a daemon that has worked: the Go
	// runtime keeps some memory once it has needed it.
	for i := range 2 * testUserSegments {
		if _, _, err := root.CreateOnly(ctx, fmt.Sprint("warm", i), 4096, nil); err != nil {
			t.Fatal(err)
		}
	}
	for i := range 2 * testUserSegments {
		if err := root.Unlink(ctx, fmt.Sprint("warm", i)); err != nil {
			t.Fatal(err)
		}
	}
	inf, err := d.info()
	if err != nil {
		t.Fatal(err)
	}
	serving := inf.PID
	idle, supIdle := steady(t, serving), statsOf(t, sup)
	t.Logf("idle: serving %+v, supervisor %+v", idle, supIdle)

	t.Run("segments", func(t *testing.T) {
		n, code, msg := hostile.ask(t, "create s 100000 4096")
		want := fmt.Sprintf("segments per user: uid %d: asked for a segment, %d held, limit %d", hostileUID, testUserSegments, testUserSegments)
		if n != testUserSegments || code != "ENOSPC" || !strings.Contains(msg, want) {
			t.Fatalf("segments until refused: %d, %s %q; want %d, ENOSPC %q", n, code, msg, testUserSegments, want)
		}
		neighbour.works(t, "another user held all its segments")
		if _, code, msg := hostile.ask(t, "rm s 100000"); code != "OK" {
			t.Fatalf("rm: %s %s", code, msg)
		}
		settle(t, "segments", serving, sup, idle, supIdle, false)
	})

	t.Run("bytes", func(t *testing.T) {
		var si unix.Sysinfo_t
		if err := unix.Sysinfo(&si); err != nil {
			t.Fatal(err)
		}
		limit := int64(0.25 * float64(int64(si.Totalram)*int64(si.Unit)))
		const held = 64 << 20
		if n, code, msg := hostile.ask(t, fmt.Sprintf("create big 1 %d", held)); n != 1 {
			t.Fatalf("64 MiB: %s %s", code, msg)
		}
		// One page more than what is left of the quota: refused, and
		// nothing allocated. (Filling a quarter of this machine's memory
		// would prove no more.)
		ask := (limit-held)/4096*4096 + 4096
		n, code, msg := hostile.ask(t, fmt.Sprintf("create huge 1 %d", ask))
		want := fmt.Sprintf("bytes per user on device 0: uid %d: asked %d bytes, %d in use, limit %d", hostileUID, ask, held, limit)
		if n != 0 || code != "ENOSPC" || !strings.Contains(msg, want) {
			t.Fatalf("over the byte quota: %d, %s %q; want ENOSPC %q", n, code, msg, want)
		}
		neighbour.works(t, "another user held its bytes")
		hostile.ask(t, "rm big 1")
		settle(t, "bytes", serving, sup, idle, supIdle, false)
	})

	t.Run("daemon segments", func(t *testing.T) { daemonSegmentsFull(t, sock, serving, sup, idle, supIdle, neighbour) })

	// Last: a daemon with a thread per connection keeps those threads.
	t.Run("connections", func(t *testing.T) {
		n, code, msg := hostile.ask(t, "conns 100000")
		want := fmt.Sprintf("connections per user: uid %d has %d open, limit %d", hostileUID, testUserConnections, testUserConnections)
		// The client process holds one connection already.
		if n != testUserConnections-1 || code != "EAGAIN" || !strings.Contains(msg, want) {
			t.Fatalf("connections until refused: %d, %s %q; want %d, EAGAIN %q", n, code, msg, testUserConnections-1, want)
		}
		// A second refusal, and the neighbour, while they are all open.
		if _, code, _ := hostile.ask(t, "conns 1"); code != "EAGAIN" {
			t.Fatalf("another connection over the limit: %s, want EAGAIN", code)
		}
		busy := statsOf(t, serving)
		neighbour.works(t, "another user held all its connections")
		hostile.ask(t, "close")
		// A daemon with a thread per connection keeps its threads for
		// later connections: threads and memory come back to idle only
		// where idle connections are parked without one.
		perConn := busy.threads-idle.threads >= testUserConnections/2
		if perConn {
			t.Logf("the daemon holds a thread per idle connection (%d threads with %d connections): threads and memory not checked", busy.threads, testUserConnections)
		}
		settle(t, "connections", serving, sup, idle, supIdle, perConn)
		if n, code, msg := hostile.ask(t, "conns 1"); n != 1 || code != "OK" {
			t.Fatalf("a connection after the others closed: %d %s %s", n, code, msg)
		}
		hostile.ask(t, "close")
	})
}

// daemonSegmentsFull is TestHostileNeighbour's test of the daemon's own
// limit on segments, which root fills: refused with the numbers, the
// supervisor's descriptors well below its limit, and the neighbour served.
func daemonSegmentsFull(t *testing.T, sock string, serving, sup int, idle, supIdle procStats, neighbour *userClient) {
	ctx := context.Background()
	// Root is exempt from the per-user limits, not from the daemon's:
	// they keep the supervisor, which holds a descriptor of every
	// segment, from running out.
	c, err := gpushm.Dial(ctx, sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	made := 0
	var refusal error
	for i := 0; i < 2*testMaxSegments; i++ {
		if _, _, err := c.CreateOnly(ctx, fmt.Sprint("r", i), 4096, nil); err != nil {
			refusal = err
			break
		}
		made++
	}
	// "shared" holds one already.
	want := fmt.Sprintf("segments of the daemon (all users; a channel counts as 2): asked for 1, %d held, limit %d", testMaxSegments, testMaxSegments)
	if made != testMaxSegments-1 || !errors.Is(refusal, syscall.ENOSPC) || !strings.Contains(refusal.Error(), want) {
		t.Fatalf("root made %d segments, then %v; want %d, then ENOSPC %q", made, refusal, testMaxSegments-1, want)
	}
	full := statsOf(t, sup)
	if full.fds >= testNOFILE-100 {
		t.Fatalf("the supervisor holds %d descriptors of %d", full.fds, testNOFILE)
	}
	if _, code, msg := neighbour.ask(t, "read"); code != "OK" {
		t.Fatalf("a neighbour's read of a shared segment with the daemon full: %s %s", code, msg)
	}
	for i := range made {
		if err := c.Unlink(ctx, fmt.Sprint("r", i)); err != nil {
			t.Fatal(err)
		}
	}
	c.Close()
	settle(t, "daemon segments", serving, sup, idle, supIdle, false)
	neighbour.works(t, "after the daemon was full")
}

// TestOutOfDescriptorsAnswered: with no connection limits, a daemon that
// runs out of descriptors still answers every new connection, with EMFILE
// and why, and serves again once connections close.
func TestOutOfDescriptorsAnswered(t *testing.T) {
	dir := testutil.SocketDir(t)
	sock := filepath.Join(dir, "gpushm.sock")
	d := Start(t, Options{Socket: sock, NoFile: 256, Args: []string{"--max-connections", "0", "--user-connections", "0", "--max-segments", "64"}})
	ctx := context.Background()
	var conns []*gpushm.Client
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	var refusal error
	for range 1000 {
		c, err := gpushm.Dial(ctx, sock)
		if err != nil {
			refusal = err
			break
		}
		conns = append(conns, c)
	}
	if !errors.Is(refusal, syscall.EMFILE) || !strings.Contains(refusal.Error(), "the daemon is out of file descriptors") ||
		!strings.Contains(refusal.Error(), "descriptor limit 256") {
		t.Fatalf("after %d connections: %v; want EMFILE saying the daemon is out of descriptors", len(conns), refusal)
	}
	t.Logf("refused after %d connections: %v", len(conns), refusal)
	// Again: the spare descriptor came back.
	if _, err := gpushm.Dial(ctx, sock); !errors.Is(err, syscall.EMFILE) {
		t.Fatalf("a second connection at the limit: %v, want EMFILE", err)
	}
	// Connections already open keep working.
	if _, _, err := conns[0].CreateOnly(ctx, "x", 4096, nil); err != nil && !errors.Is(err, syscall.EMFILE) {
		t.Fatalf("create on an open connection at the limit: %v", err)
	}
	for _, c := range conns[len(conns)/2:] {
		c.Close()
	}
	conns = conns[:len(conns)/2]
	deadline := time.Now().Add(60 * time.Second)
	for {
		c, err := gpushm.Dial(ctx, sock)
		if err == nil {
			c.Close()
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no connection within 60s of others closing: %v", err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if _, err := d.info(); err != nil {
		t.Fatal(err)
	}
}

// TestReadOnlyDescriptors: on the host backend, what a read-only open
// sends (and what a channel's consumer gets for its slots, and hello for
// the epoch page) is a descriptor another process cannot map writable,
// write, or open again for writing.
func TestReadOnlyDescriptors(t *testing.T) {
	requireUsers(t)
	dir := testutil.SocketDir(t)
	os.Chmod(dir, 0o755)
	sock := filepath.Join(dir, "gpushm.sock")
	Start(t, Options{Socket: sock, NoFile: testNOFILE})
	ctx := context.Background()
	root, err := gpushm.Dial(ctx, sock)
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	seg, m := shareRootBytes(t, root, "weights", 1<<16)
	mode := uint32(0o644)
	ch, err := root.Channel(ctx, "stream", gpushm.Producer, &gpushm.ChannelOptions{SlotBytes: 4096, Slots: 2, Mode: &mode})
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()

	reader := startUserClient(t, sock, neighbourUID)
	for _, check := range []string{"ro weights", "rx stream", "look stream", "epoch -"} {
		if _, code, msg := reader.ask(t, "check "+check); code != "OK" {
			t.Errorf("%s: %s %s", check, code, msg)
		}
	}
	if !bytes.HasPrefix(m.Bytes(), []byte("root's bytes")) {
		t.Fatalf("the segment changed: %q", m.Bytes()[:16])
	}
	seg.Close()
}

// neighbourMain is a client process as another user (userClient): it
// answers each command on its standard input with one line, "N CODE
// MESSAGE".
func neighbourMain(uid int) error {
	if err := unix.Setgroups(nil); err != nil {
		return err
	}
	if err := unix.Setresgid(uid, uid, uid); err != nil {
		return err
	}
	if err := unix.Setresuid(uid, uid, uid); err != nil {
		return err
	}
	ctx := context.Background()
	sock := os.Getenv("GPUSHM_SOCKET")
	c, err := gpushm.Dial(ctx, sock)
	if err != nil {
		return err
	}
	defer c.Close()
	var held []*gpushm.Client
	answer := func(n int, err error) {
		if err == nil {
			fmt.Printf("%d OK -\n", n)
			return
		}
		code := "ERR"
		var we *wire.Error
		if errors.As(err, &we) {
			code = we.Code
		}
		fmt.Printf("%d %s %s\n", n, code, strings.ReplaceAll(err.Error(), "\n", " "))
	}
	sc := bufio.NewScanner(os.Stdin)
	for k := 0; sc.Scan(); k++ {
		f := strings.Fields(sc.Text())
		arg := func(i int) int64 { n, _ := strconv.ParseInt(f[i], 10, 64); return n }
		switch f[0] {
		case "conns": // open up to N more connections
			n := 0
			var err error
			for ; n < int(arg(1)); n++ {
				cc, e := gpushm.Dial(ctx, sock)
				if e != nil {
					err = e
					break
				}
				cc.SetReconnect(0)
				held = append(held, cc)
			}
			answer(n, err)
		case "close":
			for _, cc := range held {
				cc.Close()
			}
			answer(len(held), nil)
			held = nil
		case "create": // create PREFIX N SIZE: until N or a refusal
			n := 0
			var err error
			for ; n < int(arg(2)); n++ {
				if _, _, err = c.CreateOnly(ctx, fmt.Sprint(f[1], n), arg(3), nil); err != nil {
					break
				}
			}
			answer(n, err)
		case "rm": // rm PREFIX N
			var err error
			for i := range int(arg(2)) {
				if e := c.Unlink(ctx, fmt.Sprint(f[1], i)); e != nil && !errors.Is(e, os.ErrNotExist) {
					err = e
				}
			}
			answer(0, err)
		case "work":
			answer(0, work(ctx, c, fmt.Sprintf("work-%d-%d", uid, k)))
		case "read":
			answer(0, readShared(ctx, c))
		case "check": // check KIND NAME: a read-only descriptor
			answer(0, checkReadOnly(sock, f[1], f[2]))
		default:
			answer(0, fmt.Errorf("unknown command %q", f[0]))
		}
	}
	return sc.Err()
}

// work is a neighbour's ordinary work: a segment of its own created,
// written, opened read-only and read back, then removed; and a read of
// what root shares.
func work(ctx context.Context, c *gpushm.Client, name string) error {
	seg, err := c.Create(ctx, name, 64<<10, nil)
	if err != nil {
		return fmt.Errorf("create: %w", err)
	}
	want := []byte(name)
	m, err := seg.Map()
	if err == nil {
		_, err = m.WriteAt(want, 100)
	}
	seg.Close()
	if err != nil {
		return fmt.Errorf("write: %w", err)
	}
	ro, err := c.Open(ctx, name, &gpushm.OpenOptions{ReadOnly: true})
	if err != nil {
		return fmt.Errorf("open read-only: %w", err)
	}
	got := make([]byte, len(want))
	if m, err = ro.Map(); err == nil {
		_, err = m.ReadAt(got, 100)
	}
	ro.Close()
	if err == nil && !bytes.Equal(got, want) {
		err = fmt.Errorf("read %q, wrote %q", got, want)
	}
	if err != nil {
		return err
	}
	if err := c.Unlink(ctx, name); err != nil {
		return fmt.Errorf("unlink: %w", err)
	}
	return readShared(ctx, c)
}

func readShared(ctx context.Context, c *gpushm.Client) error {
	s, err := c.Open(ctx, "shared", &gpushm.OpenOptions{ReadOnly: true})
	if err != nil {
		return fmt.Errorf("open root's shared segment: %w", err)
	}
	defer s.Close()
	m, err := s.Map()
	if err != nil {
		return err
	}
	got := make([]byte, 12)
	if _, err := m.ReadAt(got, 0); err != nil {
		return err
	}
	if string(got) != "root's bytes" {
		return fmt.Errorf("root's shared segment reads %q", got)
	}
	return nil
}

// checkReadOnly asks the daemon for a descriptor over the raw protocol and
// checks that this process can read through it and cannot write: kind ro
// (a read-only open of name), rx (a consumer's slots), look (a channel
// opened without a role: its control block too) or epoch (hello's page).
func checkReadOnly(sock, kind, name string) error {
	wc, err := wire.Dial(sock)
	if err != nil {
		return err
	}
	defer wc.Close()
	var id uint64
	call := func(req *wire.Request) (*wire.Reply, int, error) {
		id++
		req.ID = id
		b, err := wire.Encode(req)
		if err != nil {
			return nil, -1, err
		}
		if err := wc.Send(b, -1); err != nil {
			return nil, -1, err
		}
		b, fd, err := wc.Recv()
		if err != nil {
			return nil, -1, err
		}
		rep, err := wire.DecodeReply(b)
		if err == nil && rep.Error != nil {
			err = rep.Error
		}
		return rep, fd, err
	}
	_, epochFD, err := call(&wire.Request{Op: wire.OpHello, Version: wire.Version})
	if err != nil {
		return err
	}
	defer unix.Close(epochFD)
	var fds []int
	var ctlFD = -1
	switch kind {
	case "epoch":
		fds = append(fds, epochFD)
	case "ro", "rx", "look":
		req := &wire.Request{Op: wire.OpOpen, Name: name, ReadOnly: true}
		if kind == "rx" {
			req.Role = "rx"
		}
		rep, fd, err := call(req)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		fds = append(fds, fd)
		if rep.Control {
			b, cfd, err := wc.Recv()
			if err != nil {
				return err
			}
			if _, err := wire.DecodeReply(b); err != nil {
				return err
			}
			defer unix.Close(cfd)
			ctlFD = cfd
		}
		if kind == "look" {
			fds = append(fds, ctlFD)
		}
	default:
		return fmt.Errorf("unknown kind %q", kind)
	}
	for _, fd := range fds {
		if err := cannotWrite(fd); err != nil {
			return fmt.Errorf("%s %s: %w", kind, name, err)
		}
	}
	if kind == "rx" {
		// The consumer writes its counters in the control block.
		b, err := unix.Mmap(ctlFD, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
		if err != nil {
			return fmt.Errorf("a consumer cannot map its control block writable: %w", err)
		}
		unix.Munmap(b)
	}
	return nil
}

// cannotWrite checks that fd maps for reading but not for writing, and
// refuses writes and opening again for writing.
func cannotWrite(fd int) error {
	b, err := unix.Mmap(fd, 0, 4096, unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return fmt.Errorf("mmap PROT_READ: %w", err)
	}
	unix.Munmap(b)
	if b, err := unix.Mmap(fd, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED); err == nil {
		unix.Munmap(b)
		return errors.New("mmap PROT_WRITE, MAP_SHARED succeeded")
	} else if !errors.Is(err, unix.EACCES) {
		return fmt.Errorf("mmap PROT_WRITE: %w, want EACCES", err)
	}
	if _, err := unix.Pwrite(fd, []byte("x"), 0); !errors.Is(err, unix.EBADF) {
		return fmt.Errorf("pwrite: %v, want EBADF", err)
	}
	if rw, err := unix.Open(fmt.Sprintf("/proc/self/fd/%d", fd), unix.O_RDWR, 0); err == nil {
		unix.Close(rw)
		return errors.New("opening /proc/self/fd/N again for writing succeeded")
	} else if !errors.Is(err, unix.EACCES) {
		return fmt.Errorf("open /proc/self/fd/N O_RDWR: %w, want EACCES", err)
	}
	return nil
}
