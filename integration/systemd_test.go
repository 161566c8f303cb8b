package integration

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/daemon"
	"github.com/gpushm/gpushm/internal/testutil"
)

// fakeManager plays systemd's part for a Type=notify service with a file
// descriptor store: it reads sd_notify messages (READY=1, FDSTORE=1 with
// FDNAME=, FDSTOREREMOVE=1) on a datagram socket and starts the service
// with the stored descriptors, as LISTEN_FDS and LISTEN_FDNAMES say.
type fakeManager struct {
	t      *testing.T
	path   string
	sock   int
	mu     sync.Mutex
	store  []stored
	ready  chan struct{}
	states []string
}

type stored struct {
	name string
	fd   int
}

func newFakeManager(t *testing.T, dir string) *fakeManager {
	t.Helper()
	m := &fakeManager{t: t, path: filepath.Join(dir, "notify"), ready: make(chan struct{}, 16)}
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Bind(fd, &unix.SockaddrUnix{Name: m.path}); err != nil {
		t.Fatal(err)
	}
	m.sock = fd
	read := make(chan struct{})
	go func() { defer close(read); m.read() }()
	t.Cleanup(func() {
		// The reader ends on the shutdown; the socket is closed only then,
		// since a reader between two recvmsg calls would read whatever
		// socket got its number next.
		unix.Shutdown(fd, unix.SHUT_RDWR)
		for waiting := true; waiting; {
			select {
			case <-read:
				waiting = false
			case <-m.ready: // a READY=1 nobody waited for
			}
		}
		unix.Close(fd)
		m.mu.Lock()
		defer m.mu.Unlock()
		for _, s := range m.store {
			unix.Close(s.fd)
		}
		m.store = nil
	})
	return m
}

func (m *fakeManager) read() {
	buf := make([]byte, 4096)
	oob := make([]byte, unix.CmsgSpace(4*16))
	for {
		n, oobn, _, _, err := unix.Recvmsg(m.sock, buf, oob, unix.MSG_CMSG_CLOEXEC)
		if err != nil || n == 0 && oobn == 0 {
			return
		}
		var fds []int
		if cmsgs, err := unix.ParseSocketControlMessage(oob[:oobn]); err == nil {
			for _, c := range cmsgs {
				if got, err := unix.ParseUnixRights(&c); err == nil {
					fds = append(fds, got...)
				}
			}
		}
		kv := map[string]string{}
		for _, line := range strings.Split(string(buf[:n]), "\n") {
			if k, v, ok := strings.Cut(line, "="); ok {
				kv[k] = v
			}
		}
		m.mu.Lock()
		m.states = append(m.states, string(buf[:n]))
		switch {
		case kv["FDSTORE"] == "1":
			for _, fd := range fds {
				if m.holds(kv["FDNAME"], fd) {
					unix.Close(fd) // systemd drops a descriptor it already holds
					continue
				}
				m.store = append(m.store, stored{kv["FDNAME"], fd})
			}
		case kv["FDSTOREREMOVE"] == "1":
			m.store = slices.DeleteFunc(m.store, func(s stored) bool {
				if s.name == kv["FDNAME"] {
					unix.Close(s.fd)
					return true
				}
				return false
			})
			fallthrough
		default:
			for _, fd := range fds {
				unix.Close(fd)
			}
		}
		m.mu.Unlock()
		if kv["READY"] == "1" {
			m.ready <- struct{}{}
		}
	}
}

// holds reports whether fd's file is already stored under name; mu held.
func (m *fakeManager) holds(name string, fd int) bool {
	var a unix.Stat_t
	if unix.Fstat(fd, &a) != nil {
		return false
	}
	for _, s := range m.store {
		var b unix.Stat_t
		if s.name == name && unix.Fstat(s.fd, &b) == nil && a.Dev == b.Dev && a.Ino == b.Ino {
			return true
		}
	}
	return false
}

func (m *fakeManager) names() []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []string
	for _, s := range m.store {
		out = append(out, s.name)
	}
	slices.Sort(out)
	return out
}

// waitFor waits until name is in the store.
func (m *fakeManager) waitFor(t *testing.T, name string) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !slices.Contains(m.names(), name); {
		if time.Now().After(deadline) {
			t.Fatalf("%s never reached the store: %v", name, m.names())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// waitGone waits until name left the store.
func (m *fakeManager) waitGone(t *testing.T, name string) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); slices.Contains(m.names(), name); {
		if time.Now().After(deadline) {
			t.Fatalf("%s never left the store: %v", name, m.names())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// edit lets a test change the store (to hand back bad state).
func (m *fakeManager) edit(fn func([]stored) []stored) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.store = fn(m.store)
}

// service is a service process the fake manager started.
type service struct {
	cmd  *exec.Cmd
	done chan struct{}
	log  *syncBuffer
}

// start runs the service as systemd would: the stored descriptors from fd
// 3, named, and NOTIFY_SOCKET. It waits for READY=1.
func (m *fakeManager) start(sock string, args ...string) *service {
	m.t.Helper()
	m.mu.Lock()
	var files []*os.File
	var names []string
	for _, s := range m.store {
		fd, err := unix.FcntlInt(uintptr(s.fd), unix.F_DUPFD_CLOEXEC, 0)
		if err != nil {
			m.t.Fatal(err)
		}
		files = append(files, os.NewFile(uintptr(fd), s.name))
		names = append(names, s.name)
	}
	m.mu.Unlock()
	// LISTEN_PID must be the service's own pid: a shell sets it and execs.
	all := append([]string{"-c", `LISTEN_PID=$$ exec "$0" "$@"`, gpushmBin, "daemon", "--socket", sock, "--backend", "host"}, args...)
	cmd := exec.Command("/bin/sh", all...)
	cmd.Env = append(os.Environ(), "NOTIFY_SOCKET="+m.path, "FDSTORE=256")
	if len(files) > 0 {
		cmd.Env = append(cmd.Env, fmt.Sprintf("LISTEN_FDS=%d", len(files)), "LISTEN_FDNAMES="+strings.Join(names, ":"))
	}
	cmd.ExtraFiles = files
	log := &syncBuffer{}
	cmd.Stderr = log
	if err := cmd.Start(); err != nil {
		m.t.Fatal(err)
	}
	for _, f := range files {
		f.Close()
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	m.t.Cleanup(func() {
		cmd.Process.Kill()
		<-done
		if m.t.Failed() {
			m.t.Logf("service log:\n%s", log.String())
		}
	})
	select {
	case <-m.ready:
	case <-done:
		m.t.Fatalf("service exited before READY=1: %v\n%s", cmd.ProcessState, log.String())
	case <-time.After(60 * time.Second):
		m.t.Fatalf("no READY=1 within 60s\n%s", log.String())
	}
	return &service{cmd, done, log}
}

// crash kills the service's main process (the supervisor), as a crash or
// the OOM killer would, and waits until its serving process went too:
// under systemd it does not start a supervisor of its own, since systemd
// restarts the service.
func crash(t *testing.T, svc *service, sock string) {
	t.Helper()
	inf := infoAt(t, sock)
	svc.cmd.Process.Kill()
	<-svc.done
	for deadline := time.Now().Add(10 * time.Second); ; {
		if !testutil.Alive(inf.PID) {
			if procs := testutil.DaemonProcs(sock); len(procs) > 0 {
				t.Fatalf("daemon processes after the supervisor's death under systemd: %v", procs)
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("serving process %d outlived its supervisor", inf.PID)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func infoAt(t *testing.T, sock string) *gpushm.Info {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := gpushm.Dial(ctx, sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	inf, err := c.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return inf
}

// TestSurviveSystemd: under systemd with a file descriptor store, even
// the supervisor's death (or 'systemctl restart') loses nothing: the store
// hands back the listener, the epoch page, the journal and every segment.
// A store handed back damaged (corrupt or truncated journal, a missing
// descriptor, descriptors of the wrong kind, names nobody knows) gives a
// daemon that serves what it can prove and keeps the rest as orphans,
// listed and removable.
func TestSurviveSystemd(t *testing.T) {
	dir := testutil.SocketDir(t)
	sock := filepath.Join(dir, "gpushm.sock")
	m := newFakeManager(t, dir)
	svc := m.start(sock, "--grace", "1s")
	for i, mode := range []string{"0600", "0640", "0644", "0660"} {
		name := fmt.Sprintf("s%d", i)
		mustRun(t, nil, "--socket", sock, "create", name, "64K", "--mode", mode, "--meta", fmt.Sprintf(`{"n":%d}`, i))
		writeAll(t, sock, name, byte(i+1))
	}
	mustRun(t, nil, "--socket", sock, "rm", "s3")
	m.waitGone(t, "seg-4")
	// A channel keeps its control block in the store too (ctl-ID): one
	// message sent, the producer gone.
	sendOne(t, m, sock, "ch")
	m.waitFor(t, "ctl-5")
	if got := m.names(); !slices.Contains(got, "listener") || !slices.Contains(got, "epoch") || !slices.Contains(got, "seg-1") || slices.Contains(got, "seg-4") {
		t.Fatalf("store after creates and a rm: %v", got)
	}

	// The supervisor dies; systemd starts the service again.
	crash(t, svc, sock)
	svc = m.start(sock, "--grace", "1s")
	recvOne(t, sock, "ch")
	mustRun(t, nil, "--socket", sock, "rm", "ch")
	m.waitGone(t, "ctl-5")
	checkSegs(t, sock, map[string]segWant{
		"s0": {0o600, 1, `{"n":0}`}, "s1": {0o640, 2, `{"n":1}`}, "s2": {0o644, 3, `{"n":2}`},
	})

	// Damage: a journal whose last frame (s4's create) is torn, a segment
	// whose descriptor is missing, one whose descriptor is a pipe, and a
	// name nobody knows.
	mustRun(t, nil, "--socket", sock, "create", "s4", "4K")
	// The supervisor copies a change to the store a moment after the
	// serving process acknowledged it (docs/architecture.md): wait for it.
	s4, err := statAt(sock, "s4")
	if err != nil {
		t.Fatal(err)
	}
	m.waitFor(t, fmt.Sprintf("seg-%d", s4.ID))
	crash(t, svc, sock)
	var pipe [2]int
	if err := unix.Pipe2(pipe[:], unix.O_CLOEXEC); err != nil {
		t.Fatal(err)
	}
	unix.Close(pipe[1])
	m.edit(func(st []stored) []stored {
		var out []stored
		for _, s := range st {
			switch {
			case strings.HasPrefix(s.name, "journal-"):
				out = append(out, stored{s.name, tornCopy(t, s.fd)})
				unix.Close(s.fd)
			case s.name == "seg-1": // s0: missing
				unix.Close(s.fd)
			case s.name == "seg-2": // s1: not a memfd
				unix.Close(s.fd)
				out = append(out, stored{s.name, pipe[0]})
			default:
				out = append(out, s)
			}
		}
		null, _ := unix.Open("/dev/null", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		return append(out, stored{"mystery", null})
	})
	svc = m.start(sock, "--grace", "1s")
	segs := listAt(t, sock)
	var orphans, served []string
	for _, s := range segs {
		if s.Orphan != "" {
			orphans = append(orphans, s.Name)
		} else {
			served = append(served, s.Name)
		}
	}
	// s2 is served as it was; s0 lost its memory, s1's descriptor is a
	// pipe, and s4's record was torn off: all three are orphans.
	if !slices.Equal(served, []string{"s2"}) || len(orphans) != 3 {
		t.Fatalf("served %v, orphans %v (%+v)", served, orphans, segs)
	}
	ls := mustRun(t, nil, "--socket", sock, "ls")
	if n := strings.Count(ls, " orphaned\n"); n != 3 {
		t.Fatalf("ls does not show the orphans:\n%s", ls)
	}
	for _, name := range orphans {
		r := cli(t, nil, "--socket", sock, "get", name, filepath.Join(dir, "x"))
		if r.code == 0 || !strings.Contains(r.stderr, "orphaned") {
			t.Fatalf("get of orphan %s: exit %d, %q", name, r.code, r.stderr)
		}
		mustRun(t, nil, "--socket", sock, "rm", name)
	}
	if got := m.names(); !slices.Contains(got, "mystery") {
		t.Fatalf("a descriptor the daemon does not know was removed from the store: %v", got)
	}
	// A stop under the store leaves the segments to systemd: restart
	// keeps them; systemd drops them on 'systemctl stop'.
	svc.cmd.Process.Signal(syscall.SIGTERM)
	<-svc.done
	if !svc.cmd.ProcessState.Success() {
		t.Fatalf("service exit after SIGTERM: %v", svc.cmd.ProcessState)
	}
	m.start(sock, "--grace", "1s")
	if got := listAt(t, sock); len(got) != 1 || got[0].Name != "s2" {
		t.Fatalf("after a stop and start under the store: %+v", got)
	}
}

type segWant struct {
	mode uint32
	fill byte
	meta string
}

func writeAll(t *testing.T, sock, name string, fill byte) {
	t.Helper()
	ctx := context.Background()
	c, err := gpushm.Dial(ctx, sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	seg, err := c.Open(ctx, name, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer seg.Close()
	mp, err := seg.Map()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := mp.WriteAt(bytes.Repeat([]byte{fill}, int(mp.Size())), 0); err != nil {
		t.Fatal(err)
	}
}

func listAt(t *testing.T, sock string) []gpushm.SegmentInfo {
	t.Helper()
	c, err := gpushm.Dial(context.Background(), sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	segs, err := c.List(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return segs
}

func checkSegs(t *testing.T, sock string, want map[string]segWant) {
	t.Helper()
	ctx := context.Background()
	c, err := gpushm.Dial(ctx, sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	segs, err := c.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(segs) != len(want) {
		t.Fatalf("segments %+v, want %v", segs, want)
	}
	for name, w := range want {
		inf, err := c.Stat(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		if inf.Mode != w.mode || string(inf.Meta) != w.meta || inf.Orphan != "" {
			t.Fatalf("%s: mode %o meta %s orphan %q, want mode %o meta %s", name, inf.Mode, inf.Meta, inf.Orphan, w.mode, w.meta)
		}
		seg, err := c.Open(ctx, name, &gpushm.OpenOptions{ReadOnly: true})
		if err != nil {
			t.Fatal(err)
		}
		mp, err := seg.Map()
		if err != nil {
			t.Fatal(err)
		}
		got := make([]byte, mp.Size())
		mp.ReadAt(got, 0)
		if !bytes.Equal(got, bytes.Repeat([]byte{w.fill}, len(got))) {
			t.Fatalf("%s: bytes changed", name)
		}
		seg.Close()
	}
}

// tornCopy copies a journal into a new memfd without the last 5 bytes, as
// a write cut short would leave it.
func tornCopy(t *testing.T, fd int) int {
	t.Helper()
	var st unix.Stat_t
	unix.Fstat(fd, &st)
	b := make([]byte, st.Size)
	if _, err := unix.Pread(fd, b, 0); err != nil {
		t.Fatal(err)
	}
	if len(b) < 16 || string(b[:8]) != "GPUSHMJ1" || binary.LittleEndian.Uint32(b[8:]) == 0 {
		t.Fatalf("the stored journal does not look like one: %q", b[:min(len(b), 16)])
	}
	nfd, err := unix.MemfdCreate("torn", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	unix.Pwrite(nfd, b[:len(b)-5], 0)
	return nfd
}

// TestSurviveRace: daemons started at once on one socket race for it; one
// serves, the others say who does.
func TestSurviveRace(t *testing.T) {
	dir := testutil.SocketDir(t)
	sock := filepath.Join(dir, "gpushm.sock")
	type result struct {
		err error
		out string
	}
	results := make(chan result, 4)
	for range 4 {
		cmd := exec.Command(gpushmBin, "daemon", "--socket", sock, "--backend", "host")
		var out syncBuffer
		cmd.Stderr = &out
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		done := make(chan struct{})
		go func() {
			err := cmd.Wait()
			results <- result{err, out.String()}
			close(done)
		}()
		t.Cleanup(func() { testutil.KillDaemon(sock, nil); cmd.Process.Kill(); <-done })
	}
	for range 3 {
		select {
		case r := <-results:
			if r.err == nil || !strings.Contains(r.out, "already running") || !strings.Contains(r.out, "pid ") {
				t.Fatalf("a daemon that lost the race: %v, %q", r.err, r.out)
			}
		case <-time.After(30 * time.Second):
			t.Fatal("fewer than 3 daemons gave up within 30s")
		}
	}
	// The losers give up once they find the winner's lock, which it takes
	// before it makes its socket: wait for the socket to answer.
	testutil.WaitFor(t, "the winner's socket", func() bool {
		c, err := gpushm.Dial(context.Background(), sock)
		if err == nil {
			c.Close()
		}
		return err == nil
	})
	if inf := infoAt(t, sock); inf.SupervisorPID == 0 || inf.PID == inf.SupervisorPID {
		t.Fatalf("the winner: %+v", inf)
	}
	select {
	case r := <-results:
		t.Fatalf("the winner exited: %v, %q", r.err, r.out)
	default:
	}
}

// The unit in deploy/systemd is the one install-systemd writes, and
// systemd itself finds nothing wrong with it.
func TestSystemdUnit(t *testing.T) {
	want, err := os.ReadFile("../deploy/systemd/gpushm.service")
	if err != nil {
		t.Fatal(err)
	}
	if got := daemon.SystemdUnit("/usr/local/bin/gpushm", nil); got != string(want) {
		t.Fatalf("deploy/systemd/gpushm.service differs from what install-systemd writes:\n%s", got)
	}
	dir := t.TempDir()
	mustRun(t, nil, "install-systemd", "--unit-dir", dir, "--", "--mount", "/mnt/gpushm")
	b, err := os.ReadFile(filepath.Join(dir, "gpushm.service"))
	if err != nil {
		t.Fatal(err)
	}
	exe, _ := filepath.EvalSymlinks(gpushmBin)
	if !strings.Contains(string(b), "ExecStart="+exe+" daemon --socket /run/gpushm/gpushm.sock --fd-store --mount /mnt/gpushm\n") {
		t.Fatalf("installed unit:\n%s", b)
	}
	analyze, err := exec.LookPath("systemd-analyze")
	if err != nil {
		t.Skip("systemd-analyze is not installed: the unit was not verified")
	}
	out, err := exec.Command(analyze, "verify", filepath.Join(dir, "gpushm.service")).CombinedOutput()
	var problems []string
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		// Older systemd (before 254) does not know the key; it then keeps
		// the store across crashes but not across 'systemctl restart'.
		if line != "" && !strings.Contains(line, "Unknown key 'FileDescriptorStorePreserve'") {
			problems = append(problems, line)
		}
	}
	if err != nil || len(problems) > 0 {
		t.Fatalf("systemd-analyze verify: %v\n%s", err, strings.Join(problems, "\n"))
	}
}

// sendOne makes channel name, sends one message ("hello") and closes the
// producer: the stream is that one message.
func sendOne(t *testing.T, m *fakeManager, sock, name string) {
	t.Helper()
	ctx := context.Background()
	c, err := gpushm.Dial(ctx, sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	tx, err := c.Channel(ctx, name, gpushm.Producer, &gpushm.ChannelOptions{Slots: 2, SlotBytes: 64, NoWait: false})
	if err != nil {
		t.Fatal(err)
	}
	// The consumer comes after the restart: send without waiting for it
	// by attaching one here first.
	rx, err := c.Channel(ctx, name, gpushm.Consumer, nil)
	if err != nil {
		t.Fatal(err)
	}
	msg, err := tx.Send(ctx, 0)
	if err != nil {
		t.Fatal(err)
	}
	copy(msg.Bytes(), "hello")
	msg.Done(0)
	if err := rx.Close(); err != nil {
		t.Fatal(err)
	}
	if err := tx.Close(); err != nil {
		t.Fatal(err)
	}
	c.Close()
	// The daemon hears of the close a moment after it returned. Tests
	// crash the daemon next: a lease the crash cut off would be kept for
	// this process, which lives on (leases are bound to processes, not to
	// connections), and would keep the channel open until it exits.
	deadline := time.Now().Add(10 * time.Second)
	for {
		info, err := statAt(sock, name)
		if err != nil {
			t.Fatal(err)
		}
		if info.Opens == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("channel %q still has %d opens after its client closed", name, info.Opens)
		}
		time.Sleep(5 * time.Millisecond)
	}
	// The serving process journaled the lease's end when the close came,
	// but a supervisor killed before it read that record loses it.
	m.settle(t, sock)
}

// settle returns once the supervisor has applied every change the serving
// process journaled before it: it applies them in order, so a probe
// segment's descriptor in the store means the earlier records are in too.
func (m *fakeManager) settle(t *testing.T, sock string) {
	t.Helper()
	mustRun(t, nil, "--socket", sock, "create", "settle-probe", "4K")
	inf, err := statAt(sock, "settle-probe")
	if err != nil {
		t.Fatal(err)
	}
	m.waitFor(t, fmt.Sprintf("seg-%d", inf.ID))
	mustRun(t, nil, "--socket", sock, "rm", "settle-probe")
	m.waitGone(t, fmt.Sprintf("seg-%d", inf.ID))
}

// recvOne checks that channel name still holds "hello", then the end of
// the stream.
func recvOne(t *testing.T, sock, name string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := gpushm.Dial(ctx, sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	rx, err := c.Channel(ctx, name, gpushm.Consumer, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer rx.Close()
	msg, err := rx.Recv(ctx, 0)
	if err != nil {
		t.Fatalf("the message sent before the restart: %v", err)
	}
	if got := string(msg.Bytes()[:5]); got != "hello" {
		t.Fatalf("the message holds %q", got)
	}
	msg.Done(0)
	if _, err := rx.Recv(ctx, 0); !errors.Is(err, io.EOF) {
		t.Fatalf("after the only message: %v, want io.EOF", err)
	}
}

// TestSurviveSystemdChannels: several channels of different sizes come
// back from systemd's fd store with their own memory and control blocks
// (seg-ID and ctl-ID) after the supervisor's death, and a rename over an
// existing name comes back as it was acknowledged; then a stream on each
// goes on through a kill -9 of the serving process, an upgrade and the
// death of the whole service.
func TestSurviveSystemdChannels(t *testing.T) {
	dir := testutil.SocketDir(t)
	sock := filepath.Join(dir, "gpushm.sock")
	m := newFakeManager(t, dir)
	svc := m.start(sock, "--grace", "30s")
	specs := []chanSpec{{"A", 4, 4096}, {"B", 2, 65536}, {"C", 4, 4096}, {"D", 3, 12345}}
	ctx := context.Background()
	c, err := gpushm.Dial(ctx, sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	leaveMessages(t, c, specs)
	// A rename over an existing name: y, unopened, is freed with it.
	for i, name := range []string{"x", "y"} {
		mustRun(t, nil, "--socket", sock, "create", name, "64K")
		writeAll(t, sock, name, byte(i+1))
	}
	x, err := c.Stat(ctx, "x")
	if err != nil {
		t.Fatal(err)
	}
	y, err := c.Stat(ctx, "y")
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Rename(ctx, "x", "y"); err != nil {
		t.Fatal(err)
	}
	m.waitGone(t, fmt.Sprintf("seg-%d", y.ID))
	for deadline := time.Now().Add(10 * time.Second); ; {
		n := 0
		for _, name := range m.names() {
			if strings.HasPrefix(name, "ctl-") {
				n++
			}
		}
		if n == len(specs) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the store holds %d control blocks, want %d: %v", n, len(specs), m.names())
		}
		time.Sleep(5 * time.Millisecond)
	}

	crash(t, svc, sock)
	svc = m.start(sock, "--grace", "30s")
	// y is x, with x's bytes; x's name is gone.
	if inf, err := c.Stat(ctx, "y"); err != nil || inf.ID != x.ID || inf.Orphan != "" {
		t.Fatalf("y after the rename and the restart: %+v, %v; want segment %d", inf, err, x.ID)
	}
	if _, err := c.Stat(ctx, "x"); !errors.Is(err, syscall.ENOENT) {
		t.Fatalf("x after the rename and the restart: %v, want ENOENT", err)
	}
	if got := listAtQuiet(sock); !slices.Equal(got, []string{"A", "B", "C", "D", "y"}) {
		t.Fatalf("after the restart: %v, want the channels and y", got)
	}
	seg, err := c.Open(ctx, "y", &gpushm.OpenOptions{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	mp, err := seg.Map()
	if err != nil {
		t.Fatal(err)
	}
	b := make([]byte, mp.Size())
	mp.ReadAt(b, 0)
	if !bytes.Equal(b, bytes.Repeat([]byte{1}, len(b))) {
		t.Fatal("y does not hold x's bytes after the rename and the restart")
	}
	seg.Close()
	mustRun(t, nil, "--socket", sock, "rm", "y")
	checkChannels(t, sock, specs, nil, nil)
	takeLeftMessages(t, c, specs)

	tx := startChans(t, sock, "tx", specs)
	rx := startChans(t, sock, "rx", specs)
	txAt, rxAt := tx.progress(t, specs, nil, false), rx.progress(t, specs, nil, false)
	for _, step := range []string{"kill", "upgrade", "crash"} {
		inf := infoAt(t, sock)
		switch step {
		case "kill":
			syscall.Kill(inf.PID, syscall.SIGKILL)
		case "upgrade":
			svc.cmd.Process.Signal(syscall.SIGHUP)
		case "crash":
			crash(t, svc, sock)
			svc = m.start(sock, "--grace", "30s")
		}
		for deadline := time.Now().Add(60 * time.Second); infoAt(t, sock).PID == inf.PID; {
			if time.Now().After(deadline) {
				t.Fatalf("%s: still served by %d after 60s", step, inf.PID)
			}
			time.Sleep(5 * time.Millisecond)
		}
		txAt, rxAt = tx.progress(t, specs, txAt, step != "upgrade"), rx.progress(t, specs, rxAt, step != "upgrade")
		checkChannels(t, sock, specs, tx, rx)
	}
	sent, got := tx.counts(t, "stop"), rx.counts(t, "wait")
	for _, spec := range specs {
		if s, g := sent[spec.name], got[spec.name]; s.first != uint64(spec.slots) || s.first != g.first || s.next != g.next {
			t.Fatalf("%s: sent messages %d to %d, received %d to %d", spec.name, s.first, s.next-1, g.first, g.next-1)
		}
	}
	for _, p := range []*chanProc{tx, rx} {
		if err := p.cmd.Wait(); err != nil {
			t.Fatalf("%s: %v\n%s", p.role, err, p.errs.String())
		}
	}
	svc.cmd.Process.Signal(syscall.SIGTERM)
	<-svc.done
	if !svc.cmd.ProcessState.Success() {
		t.Fatalf("service exit after SIGTERM: %v\n%s", svc.cmd.ProcessState, svc.log.String())
	}
	checkDaemonLog(t, svc.log.String())
}

// TestSurviveOrphanKeepsItsDescriptors: a channel that comes back
// unusable (here its memory descriptor is a pipe) is kept as an orphan
// with both its descriptors, through further restarts, until removed:
// the next restart says the same of it, not that its control block went.
func TestSurviveOrphanKeepsItsDescriptors(t *testing.T) {
	dir := testutil.SocketDir(t)
	sock := filepath.Join(dir, "gpushm.sock")
	m := newFakeManager(t, dir)
	svc := m.start(sock, "--grace", "1s")
	sendOne(t, m, sock, "ch")
	m.waitFor(t, "ctl-1")
	crash(t, svc, sock)
	var pipe [2]int
	if err := unix.Pipe2(pipe[:], unix.O_CLOEXEC); err != nil {
		t.Fatal(err)
	}
	unix.Close(pipe[1])
	m.edit(func(st []stored) []stored {
		for i, s := range st {
			if s.name == "seg-1" {
				unix.Close(s.fd)
				st[i].fd = pipe[0]
			}
		}
		return st
	})
	for round := range 2 {
		svc = m.start(sock, "--grace", "1s")
		inf := infoAt(t, sock)
		segs := listAt(t, sock)
		if len(segs) != 1 || segs[0].Name != "orphaned-1" || !strings.Contains(segs[0].Orphan, "its memory descriptor is not usable") {
			t.Fatalf("restart %d: %+v, want channel 1 as an orphan whose memory descriptor is not usable", round, segs)
		}
		// The supervisor applies changes in order: once a later segment's
		// descriptor is stored, the orphan's record has been applied.
		name := fmt.Sprintf("later-%d", round)
		mustRun(t, nil, "--socket", sock, "create", name, "4K")
		later, err := statAt(sock, name)
		if err != nil {
			t.Fatal(err)
		}
		m.waitFor(t, fmt.Sprintf("seg-%d", later.ID))
		if got := m.names(); !slices.Contains(got, "seg-1") || !slices.Contains(got, "ctl-1") {
			t.Fatalf("restart %d (serving process %d): the orphan's descriptors left the store: %v", round, inf.PID, got)
		}
		mustRun(t, nil, "--socket", sock, "rm", name)
		// The store hears of the rm a moment after it was acknowledged
		// (docs/architecture.md): a crash before would bring it back.
		m.waitGone(t, fmt.Sprintf("seg-%d", later.ID))
		crash(t, svc, sock)
	}
	svc = m.start(sock, "--grace", "1s")
	mustRun(t, nil, "--socket", sock, "rm", "orphaned-1")
	m.waitGone(t, "seg-1")
	m.waitGone(t, "ctl-1")
	svc.cmd.Process.Signal(syscall.SIGTERM)
	<-svc.done
}

func statAt(sock, name string) (*gpushm.SegmentInfo, error) {
	ctx := context.Background()
	c, err := gpushm.Dial(ctx, sock)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	return c.Stat(ctx, name)
}
