package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
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

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm"
)

// These tests run the daemon as users do, a supervisor and its serving
// process, and kill, upgrade and restart the serving process under clients
// that are processes of their own (this test binary again, in chaos-client
// mode).

// supervised is a 'gpushm daemon' process (the supervisor).
type supervised struct {
	cmd    *exec.Cmd
	socket string
	log    *syncBuffer
	done   chan struct{}
}

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

// startSupervised runs exe daemon on socket (host backend) and waits until
// it serves.
func startSupervised(t *testing.T, exe, socket string, args ...string) *supervised {
	t.Helper()
	d := &supervised{socket: socket, log: &syncBuffer{}, done: make(chan struct{})}
	d.cmd = exec.Command(exe, append([]string{"daemon", "--socket", socket, "--backend", "host"}, args...)...)
	d.cmd.Stderr = d.log
	d.cmd.Stdout = d.log
	if err := d.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { d.cmd.Wait(); close(d.done) }()
	t.Cleanup(func() {
		d.cmd.Process.Kill()
		<-d.done
		if t.Failed() {
			t.Logf("daemon log:\n%s", d.log.String())
		}
	})
	d.waitServing(t, 0)
	return d
}

// info asks the daemon, on a connection of its own that does not
// reconnect.
func (d *supervised) info() (*gpushm.Info, error) {
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
func (d *supervised) waitServing(t *testing.T, notPID int) *gpushm.Info {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		inf, err := d.info()
		if err == nil && inf.PID != notPID {
			return inf
		}
		select {
		case <-d.done:
			t.Fatalf("daemon exited: %v\n%s", d.cmd.ProcessState, d.log.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("no serving process other than %d within 60s (last: %v)", notPID, err)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// stop sends SIGTERM and expects a clean exit.
func (d *supervised) stop(t *testing.T) {
	t.Helper()
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
		if l, err := os.Readlink(filepath.Join(dir, e.Name())); err == nil && strings.HasPrefix(l, "/memfd:gpushm (deleted)") {
			n++
		}
	}
	return n
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

// chaosClient is a client process driven over its stdin and stdout.
type chaosClient struct {
	cmd  *exec.Cmd
	in   io.WriteCloser
	out  *bufio.Reader
	errs *syncBuffer
}

func startChaosClient(t *testing.T, socket string, k int, extra ...string) *chaosClient {
	t.Helper()
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), "GPUSHM_TEST_CHAOS="+strconv.Itoa(k), "GPUSHM_SOCKET="+socket)
	cmd.Env = append(cmd.Env, extra...)
	in, _ := cmd.StdinPipe()
	out, _ := cmd.StdoutPipe()
	cc := &chaosClient{cmd: cmd, in: in, out: bufio.NewReader(out), errs: &syncBuffer{}}
	cmd.Stderr = cc.errs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	return cc
}

// ask sends a command and returns the client's one-line answer.
func (cc *chaosClient) ask(t *testing.T, k int, cmd string) string {
	t.Helper()
	fmt.Fprintln(cc.in, cmd)
	line, err := cc.out.ReadString('\n')
	if err != nil {
		t.Fatalf("client %d: %s: %v\nstderr:\n%s", k, cmd, err, cc.errs.String())
	}
	line = strings.TrimSpace(line)
	if !strings.HasPrefix(line, "ok") {
		t.Fatalf("client %d: %s: %s\nstderr:\n%s", k, cmd, line, cc.errs.String())
	}
	return line
}

func askAll(t *testing.T, clients []*chaosClient, cmd string) []string {
	t.Helper()
	out := make([]string, len(clients))
	var wg sync.WaitGroup
	var mu sync.Mutex
	var failure string
	for k, cc := range clients {
		wg.Go(func() {
			fmt.Fprintln(cc.in, cmd)
			line, err := cc.out.ReadString('\n')
			line = strings.TrimSpace(line)
			mu.Lock()
			defer mu.Unlock()
			if err != nil || !strings.HasPrefix(line, "ok") {
				failure += fmt.Sprintf("client %d: %s: %q %v\nstderr:\n%s\n", k, cmd, line, err, cc.errs.String())
			}
			out[k] = line
		})
	}
	wg.Wait()
	if failure != "" {
		t.Fatal(failure)
	}
	return out
}

func TestSurviveChaos(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("needs root: clients run as other users, and the FUSE view mounts")
	}
	kills := 200
	if testing.Short() {
		kills = 20
	}
	if n, err := strconv.Atoi(os.Getenv("GPUSHM_CHAOS_KILLS")); err == nil {
		kills = n
	}
	dir := socketDir(t)
	os.Chmod(dir, 0o755) // a client runs as another user
	sock := filepath.Join(dir, "gpushm.sock")
	mnt := filepath.Join(dir, "mnt")
	args := []string{"--grace", "3s"}
	fuse := fuseUsable()
	if fuse {
		args = append(args, "--mount", mnt)
	}
	d := startSupervised(t, os.Args[0], sock, args...)
	sup := d.cmd.Process.Pid

	var clients []*chaosClient
	for k := range 8 {
		var extra []string
		if k == 1 && fuse {
			extra = append(extra, "CHAOS_MOUNT="+mnt)
		}
		if k == 2 {
			extra = append(extra, "CHAOS_UID=4242")
		}
		clients = append(clients, startChaosClient(t, sock, k, extra...))
	}
	askAll(t, clients, "verify")

	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 9))
	var restarts []time.Duration
	for i := range kills {
		time.Sleep(time.Duration(5+rng.IntN(40)) * time.Millisecond)
		inf, err := d.info()
		if err != nil {
			t.Fatalf("round %d: info: %v", i, err)
		}
		start := time.Now()
		if err := syscall.Kill(inf.PID, syscall.SIGKILL); err != nil {
			t.Fatalf("round %d: kill serving process %d: %v", i, inf.PID, err)
		}
		now := d.waitServing(t, inf.PID)
		restarts = append(restarts, time.Since(start))
		if now.SupervisorPID != sup {
			t.Fatalf("supervisor pid %d, want %d", now.SupervisorPID, sup)
		}
		askAll(t, clients, "verify")
	}
	slices.Sort(restarts)
	if len(restarts) > 0 {
		t.Logf("%d kills; SIGKILL to serving again: p50 %s, max %s", kills,
			restarts[len(restarts)/2].Round(time.Millisecond), restarts[len(restarts)-1].Round(time.Millisecond))
	}
	held := askAll(t, clients, "stop")
	t.Logf("clients at the end: %v", held)
	for _, cc := range clients {
		if err := cc.cmd.Wait(); err != nil {
			t.Fatalf("client exit: %v\n%s", err, cc.errs.String())
		}
	}
	// Nothing leaks: no segment, no memfd in either process, one serving
	// process. Memory is freed just after it leaves the registry, so wait
	// for both a moment.
	deadline := time.Now().Add(10 * time.Second)
	for {
		inf, err := d.info()
		if err != nil {
			t.Fatal(err)
		}
		supFDs, srvFDs := memfds(t, sup), memfds(t, inf.PID)
		kids := children(sup)
		if inf.Usage.Segments == 0 && inf.Usage.Named == 0 && supFDs == 0 && srvFDs == 0 && slices.Equal(kids, []int{inf.PID}) {
			break
		}
		if os.Getenv("GPUSHM_CHAOS_DEBUG") != "" {
			t.Logf("usage %+v sup %d srv %d kids %v", inf.Usage, supFDs, srvFDs, kids)
		}
		if time.Now().After(deadline) {
			t.Fatalf("after every client removed its own: usage %+v, supervisor memfds %d, serving process memfds %d, supervisor's children %v (want [%d])",
				inf.Usage, supFDs, srvFDs, kids, inf.PID)
		}
		time.Sleep(50 * time.Millisecond)
	}
	d.stop(t)
}

// fuseUsable reports whether this machine can mount the FUSE view.
func fuseUsable() bool {
	_, err := os.Stat("/dev/fuse")
	return err == nil && os.Getuid() == 0
}

// The chaos client: a loop of random operations on segments of its own
// (named c<k>-...), each checked; "verify" checks that every segment it was
// told exists does, with its bytes, mode and owner, and that no other of
// its names does; "stop" removes them all and exits.
func chaosClientMain(k int) error {
	if uid := os.Getenv("CHAOS_UID"); uid != "" {
		// Drop to another user, so that owners other than root survive.
		n, _ := strconv.Atoi(uid)
		if err := unix.Setgroups(nil); err != nil {
			return err
		}
		if err := unix.Setresgid(n, n, n); err != nil {
			return err
		}
		if err := unix.Setresuid(n, n, n); err != nil {
			return err
		}
	}
	ctx := context.Background()
	c, err := gpushm.Dial(ctx, os.Getenv("GPUSHM_SOCKET"))
	if err != nil {
		return err
	}
	defer c.Close()
	cl := &chaos{k: k, c: c, ctx: ctx, segs: map[string]*acked{}, mount: os.Getenv("CHAOS_MOUNT"),
		rng: rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), uint64(k)))}
	cmds := make(chan string)
	go func() {
		sc := bufio.NewScanner(os.Stdin)
		for sc.Scan() {
			cmds <- sc.Text()
		}
		close(cmds)
	}()
	var failed error
	for {
		select {
		case cmd, ok := <-cmds:
			if !ok {
				return nil
			}
			if failed == nil {
				failed = cl.verify()
			}
			if failed != nil {
				fmt.Printf("fail %v\n", failed)
				continue
			}
			if cmd == "stop" {
				if err := cl.removeAll(); err != nil {
					fmt.Printf("fail stop: %v\n", err)
					continue
				}
				fmt.Printf("ok ops=%d reconnects=%d\n", cl.ops, c.Reconnects())
				return nil
			}
			fmt.Printf("ok %d\n", len(cl.segs))
		default:
			if failed == nil {
				if err := cl.step(); err != nil {
					failed = fmt.Errorf("op %d: %w", cl.ops, err)
				}
			} else {
				time.Sleep(10 * time.Millisecond)
			}
		}
	}
}

type acked struct {
	seed uint64
	size int64
	mode uint32
	temp bool
}

type chaos struct {
	k     int
	c     *gpushm.Client
	ctx   context.Context
	rng   *rand.Rand
	segs  map[string]*acked
	next  int
	ops   int
	mount string
}

func chaosBytes(seed uint64, n int64) []byte {
	var key [32]byte
	binary.LittleEndian.PutUint64(key[:], seed)
	b := make([]byte, n)
	rand.NewChaCha8(key).Read(b)
	return b
}

var chaosModes = []uint32{0o600, 0o640, 0o644, 0o660}

func (cl *chaos) pick(temps bool) string {
	var names []string
	for name, a := range cl.segs {
		if a.temp == temps {
			names = append(names, name)
		}
	}
	if len(names) == 0 {
		return ""
	}
	slices.Sort(names)
	return names[cl.rng.IntN(len(names))]
}

func (cl *chaos) newName() string {
	cl.next++
	return fmt.Sprintf("c%d-%d", cl.k, cl.next)
}

func (cl *chaos) step() error {
	cl.ops++
	n := len(cl.segs)
	switch r := cl.rng.IntN(100); {
	case r < 22 && n < 14:
		return cl.create(false)
	case r < 26 && n < 14:
		if cl.pick(true) == "" {
			return cl.create(true)
		}
	case r < 38 && n < 14:
		return cl.publish()
	case r < 52:
		return cl.rewrite()
	case r < 66:
		return cl.check(cl.pick(false))
	case r < 80 && n > 4:
		return cl.unlink()
	case r < 86:
		return cl.chmod()
	case r < 92 && cl.mount != "" && n < 14:
		return cl.fuseWrite()
	}
	return cl.check(cl.pick(true))
}

func (cl *chaos) create(temp bool) error {
	name := cl.newName()
	size := int64(1 + cl.rng.IntN(200<<10))
	mode := chaosModes[cl.rng.IntN(len(chaosModes))]
	seed := cl.rng.Uint64()
	seg, err := cl.c.Create(cl.ctx, name, size, &gpushm.CreateOptions{Mode: &mode, Temporary: temp})
	if err != nil {
		return fmt.Errorf("create %s: %w", name, err)
	}
	defer seg.Close()
	m, err := seg.Map()
	if err != nil {
		return fmt.Errorf("map %s: %w", name, err)
	}
	if _, err := m.WriteAt(chaosBytes(seed, size), 0); err != nil {
		return fmt.Errorf("write %s: %w", name, err)
	}
	cl.segs[name] = &acked{seed: seed, size: size, mode: mode, temp: temp}
	return nil
}

func (cl *chaos) publish() error {
	name := cl.newName()
	size := int64(4096 * (1 + cl.rng.IntN(16)))
	mode := chaosModes[cl.rng.IntN(len(chaosModes))]
	seed := cl.rng.Uint64()
	fd, err := unix.MemfdCreate("chaos", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	if err := unix.Ftruncate(fd, size); err != nil {
		return err
	}
	if _, err := unix.Pwrite(fd, chaosBytes(seed, size), 0); err != nil {
		return err
	}
	if _, err := cl.c.Publish(cl.ctx, name, fd, size, &gpushm.CreateOptions{Mode: &mode}); err != nil {
		return fmt.Errorf("publish %s: %w", name, err)
	}
	cl.segs[name] = &acked{seed: seed, size: size, mode: mode}
	return nil
}

func (cl *chaos) rewrite() error {
	name := cl.pick(false)
	if name == "" {
		return nil
	}
	a := cl.segs[name]
	seg, err := cl.c.Open(cl.ctx, name, nil)
	if err != nil {
		return fmt.Errorf("open %s: %w", name, err)
	}
	defer seg.Close()
	m, err := seg.Map()
	if err != nil {
		return err
	}
	seed := cl.rng.Uint64()
	if _, err := m.WriteAt(chaosBytes(seed, a.size), 0); err != nil {
		return fmt.Errorf("write %s: %w", name, err)
	}
	a.seed = seed
	return nil
}

func (cl *chaos) check(name string) error {
	if name == "" {
		return nil
	}
	a := cl.segs[name]
	inf, err := cl.c.Stat(cl.ctx, name)
	if err != nil {
		return fmt.Errorf("stat %s: %w", name, err)
	}
	if inf.Size != a.size || inf.Mode != a.mode || inf.UID != uint32(os.Getuid()) || inf.Orphan != "" {
		return fmt.Errorf("%s: size %d mode %o uid %d orphan %q, want size %d mode %o uid %d",
			name, inf.Size, inf.Mode, inf.UID, inf.Orphan, a.size, a.mode, os.Getuid())
	}
	if a.temp != (inf.Lifetime == "connection") {
		return fmt.Errorf("%s: lifetime %q, want temporary=%v", name, inf.Lifetime, a.temp)
	}
	seg, err := cl.c.Open(cl.ctx, name, &gpushm.OpenOptions{ReadOnly: true})
	if err != nil {
		return fmt.Errorf("open %s: %w", name, err)
	}
	defer seg.Close()
	m, err := seg.Map()
	if err != nil {
		return fmt.Errorf("map %s: %w", name, err)
	}
	got := make([]byte, a.size)
	if _, err := m.ReadAt(got, 0); err != nil {
		return fmt.Errorf("read %s: %w", name, err)
	}
	if !bytes.Equal(got, chaosBytes(a.seed, a.size)) {
		return fmt.Errorf("%s: bytes differ from what was written", name)
	}
	return nil
}

func (cl *chaos) unlink() error {
	name := cl.pick(false)
	if name == "" {
		return nil
	}
	if err := cl.c.Unlink(cl.ctx, name); err != nil {
		return fmt.Errorf("unlink %s: %w", name, err)
	}
	delete(cl.segs, name)
	return nil
}

func (cl *chaos) chmod() error {
	name := cl.pick(false)
	if name == "" {
		return nil
	}
	mode := chaosModes[cl.rng.IntN(len(chaosModes))]
	if err := cl.c.Chmod(cl.ctx, name, mode); err != nil {
		return fmt.Errorf("chmod %s: %w", name, err)
	}
	cl.segs[name].mode = mode
	return nil
}

// fuseWrite writes a file through the FUSE view. A write the crash cut
// short fails (the mount went with the serving process); such a file was
// never acknowledged, and is removed.
func (cl *chaos) fuseWrite() error {
	name := cl.newName()
	size := int64(1 + cl.rng.IntN(128<<10))
	seed := cl.rng.Uint64()
	path := filepath.Join(cl.mount, name)
	err := os.WriteFile(path, chaosBytes(seed, size), 0o600)
	if err == nil {
		cl.segs[name] = &acked{seed: seed, size: size, mode: 0o600}
		return nil
	}
	if err := cl.c.Unlink(cl.ctx, name); err != nil && !errors.Is(err, syscall.ENOENT) {
		return fmt.Errorf("remove %s after a failed FUSE write: %w", name, err)
	}
	return nil
}

// verify checks every acknowledged segment, and that this client's names
// are exactly those.
func (cl *chaos) verify() error {
	all, err := cl.c.List(cl.ctx)
	if err != nil {
		return fmt.Errorf("list: %w", err)
	}
	prefix := fmt.Sprintf("c%d-", cl.k)
	var have []string
	for _, s := range all {
		if strings.HasPrefix(s.Name, prefix) {
			have = append(have, s.Name)
		}
	}
	var want []string
	for name := range cl.segs {
		want = append(want, name)
	}
	slices.Sort(have)
	slices.Sort(want)
	if !slices.Equal(have, want) {
		return fmt.Errorf("the daemon has %v, want %v", have, want)
	}
	for _, name := range want {
		if err := cl.check(name); err != nil {
			return err
		}
	}
	return nil
}

func (cl *chaos) removeAll() error {
	for name, a := range cl.segs {
		if a.temp {
			continue // ends with the connection
		}
		if err := cl.c.Unlink(cl.ctx, name); err != nil {
			return fmt.Errorf("unlink %s: %w", name, err)
		}
	}
	return nil
}

// TestUpgradeUnderLoad replaces the binary on disk and sends SIGHUP while
// clients work: each upgrade starts the new binary as the serving process,
// which takes over every connection, so no client sees an error or even a
// reconnection.
func TestSurviveUpgrade(t *testing.T) {
	upgrades := 10
	if testing.Short() {
		upgrades = 3
	}
	dir := socketDir(t)
	os.Chmod(dir, 0o755)
	exe := filepath.Join(dir, "gpushm")
	install := func() os.FileInfo {
		t.Helper()
		b, err := os.ReadFile(os.Args[0])
		if err != nil {
			t.Fatal(err)
		}
		// A new file renamed over the old, as package managers do: the
		// running processes keep the old inode.
		if err := os.WriteFile(exe+".new", b, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(exe+".new", exe); err != nil {
			t.Fatal(err)
		}
		st, err := os.Stat(exe)
		if err != nil {
			t.Fatal(err)
		}
		return st
	}
	install()
	sock := filepath.Join(dir, "gpushm.sock")
	d := startSupervised(t, exe, sock, "--grace", "1s")
	var clients []*chaosClient
	for k := range 8 {
		var extra []string
		if k == 2 && os.Getuid() == 0 {
			extra = append(extra, "CHAOS_UID=4242")
		}
		clients = append(clients, startChaosClient(t, sock, k, extra...))
	}
	askAll(t, clients, "verify")
	for i := range upgrades {
		time.Sleep(100 * time.Millisecond)
		before, err := d.info()
		if err != nil {
			t.Fatal(err)
		}
		st := install()
		d.cmd.Process.Signal(syscall.SIGHUP)
		after := d.waitServing(t, before.PID)
		exeNow, err := os.Stat(fmt.Sprintf("/proc/%d/exe", after.PID))
		if err != nil {
			t.Fatal(err)
		}
		if !os.SameFile(exeNow, st) {
			t.Fatalf("upgrade %d: the serving process %d does not run the binary now on disk", i, after.PID)
		}
		if after.Restarts != 0 {
			t.Fatalf("upgrade %d: %d restarts: an upgrade is not a crash", i, after.Restarts)
		}
		// The old one exits once it handed over.
		for deadline := time.Now().Add(10 * time.Second); ; {
			kids := children(d.cmd.Process.Pid)
			if slices.Equal(kids, []int{after.PID}) {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("upgrade %d: supervisor's children %v, want [%d]", i, kids, after.PID)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	askAll(t, clients, "verify")
	for k, line := range askAll(t, clients, "stop") {
		if !strings.HasSuffix(line, "reconnects=0") {
			t.Errorf("client %d: %s: a connection was dropped by an upgrade", k, line)
		}
	}
	for _, cc := range clients {
		if err := cc.cmd.Wait(); err != nil {
			t.Fatalf("client exit: %v\n%s", err, cc.errs.String())
		}
	}
	d.stop(t)
	if _, err := os.Stat(sock); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("socket left after a clean stop: %v", err)
	}
}

// holderMain keeps a mapping and a temporary segment across a restart of
// the serving process: it writes and reads its mapping all the time, and
// answers "op" (an operation, which reconnects), "check" and "exit".
func holderMain() error {
	ctx := context.Background()
	c, err := gpushm.Dial(ctx, os.Getenv("GPUSHM_SOCKET"))
	if err != nil {
		return err
	}
	defer c.Close()
	prefix := os.Getenv("GPUSHM_TEST_HOLDER")
	if _, _, err := c.CreateOnly(ctx, prefix+"-temp", 4096, &gpushm.CreateOptions{Temporary: true}); err != nil {
		return err
	}
	seg, err := c.Create(ctx, prefix, 4096, nil)
	if err != nil {
		return err
	}
	m, err := seg.Map()
	if err != nil {
		return err
	}
	// The mapping is the client's own: it works while the daemon is down.
	var mu sync.Mutex
	var n uint64
	done := make(chan struct{})
	go func() {
		b := make([]byte, 8)
		for {
			select {
			case <-done:
				return
			default:
			}
			mu.Lock()
			n++
			binary.LittleEndian.PutUint64(b, n)
			m.WriteAt(b, 0)
			got := make([]byte, 8)
			m.ReadAt(got, 0)
			if binary.LittleEndian.Uint64(got) != n {
				panic("mapping lost a write")
			}
			mu.Unlock()
			time.Sleep(time.Millisecond)
		}
	}()
	fmt.Println("ok ready")
	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		switch sc.Text() {
		case "op":
			if _, err := c.Stat(ctx, prefix); err != nil {
				fmt.Printf("fail %v\n", err)
				continue
			}
			fmt.Printf("ok reconnects=%d\n", c.Reconnects())
		case "count":
			mu.Lock()
			fmt.Printf("ok %d\n", n)
			mu.Unlock()
		case "exit":
			close(done)
			mu.Lock()
			defer mu.Unlock()
			if err := seg.Close(); err != nil {
				fmt.Printf("fail close: %v\n", err)
				return nil
			}
			fmt.Println("ok bye")
			return nil
		}
	}
	return nil
}

// TestSurviveReclaim: a client keeps using its mapping while the serving
// process is down, and after the restart reclaims its lease and its
// temporary segment; the temporary segment of a client that died while
// the daemon was down ends at once, not when the grace period does.
func TestSurviveReclaim(t *testing.T) {
	dir := socketDir(t)
	sock := filepath.Join(dir, "gpushm.sock")
	d := startSupervised(t, os.Args[0], sock, "--grace", "2s")
	holder := startChaosClient(t, sock, 0, "GPUSHM_TEST_HOLDER=held")
	if line, _ := holder.out.ReadString('\n'); strings.TrimSpace(line) != "ok ready" {
		t.Fatalf("holder: %q\n%s", line, holder.errs.String())
	}
	// Another client with a temporary segment, which dies with the daemon.
	victim := startChaosClient(t, sock, 1, "GPUSHM_TEST_HOLDER=victim")
	if line, _ := victim.out.ReadString('\n'); strings.TrimSpace(line) != "ok ready" {
		t.Fatalf("victim: %q\n%s", line, victim.errs.String())
	}
	inf := d.waitServing(t, 0)
	if inf.Usage.Named != 4 {
		t.Fatalf("%d segments named before the kill, want 4", inf.Usage.Named)
	}
	before := holder.ask(t, 0, "count")
	syscall.Kill(inf.PID, syscall.SIGKILL)
	victim.cmd.Process.Kill()
	victim.cmd.Wait()
	time.Sleep(50 * time.Millisecond)
	during := holder.ask(t, 0, "count")
	d.waitServing(t, inf.PID)
	if before == during {
		t.Fatalf("the holder's mapping stood still while the daemon restarted (%s)", during)
	}
	if got := holder.ask(t, 0, "op"); got != "ok reconnects=1" {
		t.Fatalf("holder after the restart: %s", got)
	}
	names := func() []string {
		c, err := gpushm.Dial(context.Background(), sock)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		segs, err := c.List(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, s := range segs {
			out = append(out, s.Name)
		}
		return out
	}
	// The dead client's temporary segment ends as soon as the new serving
	// process sees its creator gone, without waiting for the grace period;
	// the live client's stays, then and after the grace period.
	waitNames := func(want []string, why string) {
		t.Helper()
		for deadline := time.Now().Add(20 * time.Second); ; {
			got := names()
			if slices.Equal(got, want) {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: %v, want %v", why, got, want)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	waitNames([]string{"held", "held-temp", "victim"}, "after the restart")
	if inf, err := d.info(); err != nil || inf.Grace <= 0 {
		t.Fatalf("info = %+v, %v: the grace period must still run (2s): the creator's death, not the grace period, ends its segment", inf, err)
	}
	for deadline := time.Now().Add(30 * time.Second); ; {
		inf, err := d.info()
		if err != nil {
			t.Fatal(err)
		}
		if inf.Grace <= 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("grace period still running after 30s: %s left", inf.Grace)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if got := names(); !slices.Equal(got, []string{"held", "held-temp", "victim"}) {
		t.Fatalf("after the grace period: %v, want [held held-temp victim]", got)
	}
	if got := holder.ask(t, 0, "exit"); got != "ok bye" {
		t.Fatalf("holder exit: %s", got)
	}
	holder.cmd.Wait()
	// The holder's connection ended: its temporary segment with it.
	for deadline := time.Now().Add(5 * time.Second); ; {
		got := names()
		if slices.Equal(got, []string{"held", "victim"}) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after the holder exited: %v, want [held victim]", got)
		}
		time.Sleep(20 * time.Millisecond)
	}
	d.stop(t)
}

// idleMain makes a temporary segment of the given name, holding 1000
// float32 (0, 1, 2, ...), and then makes no call until told: "check" reads
// its mapping and opens the name again (a call, which reconnects), "close"
// closes the client and lives on, "exit" exits without closing anything,
// as a process that ends does.
func idleMain(name string) error {
	ctx := context.Background()
	c, err := gpushm.Dial(ctx, os.Getenv("GPUSHM_SOCKET"))
	if err != nil {
		return err
	}
	seg, err := c.Create(ctx, name, int64(len(idleBytes)), &gpushm.CreateOptions{Temporary: true})
	if err != nil {
		return err
	}
	m, err := seg.Map()
	if err != nil {
		return err
	}
	if _, err := m.WriteAt(idleBytes, 0); err != nil {
		return err
	}
	fmt.Println("ok ready")
	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		switch sc.Text() {
		case "check":
			if err := checkIdle(ctx, c, name, m); err != nil {
				fmt.Printf("fail %v\n", err)
				continue
			}
			fmt.Printf("ok reconnects=%d\n", c.Reconnects())
		case "close":
			if err := c.Close(); err != nil {
				fmt.Printf("fail close: %v\n", err)
				continue
			}
			fmt.Println("ok closed")
		case "exit":
			os.Exit(0)
		}
	}
	return nil
}

// idleBytes are the float32 numbers 0 to 999, little-endian.
var idleBytes = func() []byte {
	b := make([]byte, 4000)
	for i := range 1000 {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(float32(i)))
	}
	return b
}()

// checkIdle checks that name is still the segment mapped at m, with its
// bytes, through the mapping and through a new open.
func checkIdle(ctx context.Context, c *gpushm.Client, name string, m *gpushm.Mapping) error {
	got := make([]byte, len(idleBytes))
	if _, err := m.ReadAt(got, 0); err != nil || !bytes.Equal(got, idleBytes) {
		return fmt.Errorf("own mapping: bytes differ (%v)", err)
	}
	inf, err := c.Stat(ctx, name)
	if err != nil {
		return err
	}
	if inf.Lifetime != "connection" {
		return fmt.Errorf("%s: lifetime %q, want connection", name, inf.Lifetime)
	}
	seg, err := c.Open(ctx, name, &gpushm.OpenOptions{ReadOnly: true})
	if err != nil {
		return err
	}
	defer seg.Close()
	m2, err := seg.Map()
	if err != nil {
		return err
	}
	if _, err := m2.ReadAt(got, 0); err != nil || !bytes.Equal(got, idleBytes) {
		return fmt.Errorf("%s opened again: bytes differ (%v)", name, err)
	}
	return nil
}

// startIdle starts an idle client (idleMain) and waits until its segment
// exists.
func startIdle(t *testing.T, sock, name string) *chaosClient {
	t.Helper()
	cc := startChaosClient(t, sock, 0, "GPUSHM_TEST_IDLE="+name)
	if line, _ := cc.out.ReadString('\n'); strings.TrimSpace(line) != "ok ready" {
		t.Fatalf("idle client %s: %q\n%s", name, line, cc.errs.String())
	}
	return cc
}

// waitNamesAt waits until the daemon at sock names exactly want.
func waitNamesAt(t *testing.T, sock string, want []string, why string) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); ; {
		got := listAtQuiet(sock)
		if slices.Equal(got, want) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: the daemon names %v, want %v", why, got, want)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestSurviveIdle: a client makes a temporary segment and then sits idle,
// making no call, for 60 seconds through 5 SIGKILLs of the serving
// process, each followed by a grace period (1 s) that runs out long before
// the client calls again. Its segment stays, with its bytes, because its
// process lives; its next call works; when it exits, the segment goes.
func TestSurviveIdle(t *testing.T) {
	idle, kills := 60*time.Second, 5
	if testing.Short() {
		idle = 10 * time.Second
	}
	dir := socketDir(t)
	sock := filepath.Join(dir, "gpushm.sock")
	d := startSupervised(t, os.Args[0], sock, "--grace", "1s")
	cc := startIdle(t, sock, "idle-share")
	// check reads the segment from another process (this one), on a
	// connection of its own.
	check := func(when string) {
		t.Helper()
		ctx := context.Background()
		c, err := gpushm.Dial(ctx, sock)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.SetReconnect(0)
		seg, err := c.Open(ctx, "idle-share", &gpushm.OpenOptions{ReadOnly: true})
		if err != nil {
			t.Fatalf("%s: open idle-share: %v", when, err)
		}
		defer seg.Close()
		m, err := seg.Map()
		if err != nil {
			t.Fatal(err)
		}
		got := make([]byte, len(idleBytes))
		if _, err := m.ReadAt(got, 0); err != nil || !bytes.Equal(got, idleBytes) {
			t.Fatalf("%s: idle-share's bytes differ (%v)", when, err)
		}
	}
	for i := range kills {
		time.Sleep(idle / time.Duration(kills))
		inf, err := d.info()
		if err != nil {
			t.Fatal(err)
		}
		syscall.Kill(inf.PID, syscall.SIGKILL)
		d.waitServing(t, inf.PID)
		// Past the grace period, which used to end the segment.
		for deadline := time.Now().Add(30 * time.Second); ; {
			inf, err := d.info()
			if err != nil {
				t.Fatal(err)
			}
			if inf.Grace <= 0 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("grace period still running after 30s: %s left", inf.Grace)
			}
			time.Sleep(50 * time.Millisecond)
		}
		check(fmt.Sprintf("after restart %d and its grace period", i+1))
	}
	// The client's first call since the segment was made: it reconnects
	// once, and finds its segment.
	if got := cc.ask(t, 0, "check"); got != "ok reconnects=1" {
		t.Fatalf("idle client's next call: %s", got)
	}
	if got := listAtQuiet(sock); !slices.Equal(got, []string{"idle-share"}) {
		t.Fatalf("before the client exits: %v", got)
	}
	fmt.Fprintln(cc.in, "exit")
	if err := cc.cmd.Wait(); err != nil {
		t.Fatalf("idle client: %v\n%s", err, cc.errs.String())
	}
	waitNamesAt(t, sock, nil, "after the idle client exited")
	d.stop(t)
}

// TestSurviveKilledCreator: a creator killed (SIGKILL) around a restart of
// the serving process, which never reconnects, loses its temporary
// segment as soon as the new serving process can tell, long before the
// grace period (10 minutes here) ends: one killed while no serving process
// ran, one after the new one started. A live idle creator keeps its own.
func TestSurviveKilledCreator(t *testing.T) {
	dir := socketDir(t)
	sock := filepath.Join(dir, "gpushm.sock")
	d := startSupervised(t, os.Args[0], sock, "--grace", "10m")
	during := startIdle(t, sock, "killed-during")
	after := startIdle(t, sock, "killed-after")
	startIdle(t, sock, "alive")
	inf, err := d.info()
	if err != nil {
		t.Fatal(err)
	}
	// Stop the supervisor for a moment, so that the first creator surely
	// dies while no serving process runs.
	d.cmd.Process.Signal(syscall.SIGSTOP)
	syscall.Kill(inf.PID, syscall.SIGKILL)
	during.cmd.Process.Kill()
	during.cmd.Wait()
	d.cmd.Process.Signal(syscall.SIGCONT)
	d.waitServing(t, inf.PID)
	waitNamesAt(t, sock, []string{"alive", "killed-after"}, "after the restart")
	after.cmd.Process.Kill()
	after.cmd.Wait()
	waitNamesAt(t, sock, []string{"alive"}, "after the second creator was killed")
	if inf, err := d.info(); err != nil || inf.Grace < time.Minute {
		t.Fatalf("info = %+v, %v: the grace period must still run", inf, err)
	}
	d.stop(t)
}

// TestSurviveCloseAfterCrash: a client that closes after a restart of the
// serving process, without a call in between, ends its temporary segment
// then, not when its process exits.
func TestSurviveCloseAfterCrash(t *testing.T) {
	dir := socketDir(t)
	sock := filepath.Join(dir, "gpushm.sock")
	d := startSupervised(t, os.Args[0], sock, "--grace", "10m")
	cc := startIdle(t, sock, "closed")
	inf, err := d.info()
	if err != nil {
		t.Fatal(err)
	}
	syscall.Kill(inf.PID, syscall.SIGKILL)
	d.waitServing(t, inf.PID)
	if got := listAtQuiet(sock); !slices.Equal(got, []string{"closed"}) {
		t.Fatalf("after the restart: %v", got)
	}
	if got := cc.ask(t, 0, "close"); got != "ok closed" {
		t.Fatalf("close: %s", got)
	}
	waitNamesAt(t, sock, nil, "after the client closed (its process lives on)")
	d.stop(t)
}

// chanEndMain is a channel end for TestSurviveChannel: "tx" sends COUNT
// numbered messages at about one a millisecond, "rx" receives until EOF
// and checks that they come in order, each exactly once.
func chanEndMain(role string) error {
	ctx := context.Background()
	c, err := gpushm.Dial(ctx, os.Getenv("GPUSHM_SOCKET"))
	if err != nil {
		return err
	}
	defer c.Close()
	count, _ := strconv.Atoi(os.Getenv("COUNT"))
	if role == "tx" {
		ch, err := c.Channel(ctx, "stream", gpushm.Producer, &gpushm.ChannelOptions{Slots: 4, SlotBytes: 64})
		if err != nil {
			return err
		}
		for i := range uint64(count) {
			m, err := ch.Send(ctx, 0)
			if err != nil {
				return fmt.Errorf("send %d: %w", i, err)
			}
			binary.LittleEndian.PutUint64(m.Bytes(), i)
			if err := m.Done(0); err != nil {
				return err
			}
			time.Sleep(time.Millisecond)
		}
		fmt.Printf("ok sent=%d reconnects=%d\n", count, c.Reconnects())
		return ch.Close()
	}
	ch, err := c.Channel(ctx, "stream", gpushm.Consumer, nil)
	if err != nil {
		return err
	}
	n := uint64(0)
	for {
		m, err := ch.Recv(ctx, 0)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return fmt.Errorf("recv %d: %w", n, err)
		}
		if got := binary.LittleEndian.Uint64(m.Bytes()); got != n || m.Seq() != n {
			return fmt.Errorf("message %d holds %d (seq %d)", n, got, m.Seq())
		}
		m.Done(0)
		n++
		if n%500 == 0 {
			// A daemon call now and then: the connection is reconnected
			// and the role reclaimed on the way.
			if _, err := c.Stat(ctx, "stream"); err != nil {
				return err
			}
		}
	}
	fmt.Printf("ok received=%d reconnects=%d\n", n, c.Reconnects())
	return ch.Close()
}

// TestSurviveChannel: a channel whose ends are alive goes on through
// SIGKILLs of the serving process; no message is lost or repeated, and a
// producer that ends still ends the stream.
func TestSurviveChannel(t *testing.T) {
	dir := socketDir(t)
	sock := filepath.Join(dir, "gpushm.sock")
	d := startSupervised(t, os.Args[0], sock, "--grace", "2s")
	const count = 3000
	start := func(role string) (*exec.Cmd, *syncBuffer) {
		cmd := exec.Command(os.Args[0])
		cmd.Env = append(os.Environ(), "GPUSHM_TEST_CHAN="+role, "GPUSHM_SOCKET="+sock, "COUNT="+strconv.Itoa(count))
		out := &syncBuffer{}
		cmd.Stdout, cmd.Stderr = out, out
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
		return cmd, out
	}
	tx, txOut := start("tx")
	for deadline := time.Now().Add(20 * time.Second); ; {
		if segs := listAtQuiet(sock); slices.Contains(segs, "stream") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no channel: %s", txOut.String())
		}
		time.Sleep(5 * time.Millisecond)
	}
	rx, rxOut := start("rx")
	for range 5 {
		time.Sleep(300 * time.Millisecond)
		inf, err := d.info()
		if err != nil {
			t.Fatal(err)
		}
		syscall.Kill(inf.PID, syscall.SIGKILL)
		d.waitServing(t, inf.PID)
	}
	if err := tx.Wait(); err != nil {
		t.Fatalf("producer: %v\n%s", err, txOut.String())
	}
	if err := rx.Wait(); err != nil {
		t.Fatalf("consumer: %v\n%s", err, rxOut.String())
	}
	if !strings.Contains(rxOut.String(), fmt.Sprintf("ok received=%d", count)) {
		t.Fatalf("consumer: %s", rxOut.String())
	}
	t.Logf("producer: %s consumer: %s", strings.TrimSpace(txOut.String()), strings.TrimSpace(rxOut.String()))
}

func listAtQuiet(sock string) []string {
	c, err := gpushm.Dial(context.Background(), sock)
	if err != nil {
		return nil
	}
	defer c.Close()
	segs, _ := c.List(context.Background())
	var out []string
	for _, s := range segs {
		out = append(out, s.Name)
	}
	return out
}
