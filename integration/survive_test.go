package integration

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
	"github.com/gpushm/gpushm/internal/supervisor"
	"github.com/gpushm/gpushm/internal/testutil"
)

// These tests run the daemon as users do, a supervisor and its serving
// process, and kill, upgrade and restart the serving process under clients
// that are processes of their own (this test binary again, in chaos-client
// mode).

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
		// Segments' memfds, and the host memory evicted ones live in.
		if l, err := os.Readlink(filepath.Join(dir, e.Name())); err == nil &&
			(strings.HasPrefix(l, "/memfd:gpushm (deleted)") || strings.HasPrefix(l, "/memfd:gpushm-spill (deleted)")) {
			n++
		}
	}
	return n
}

// pooled is how many memfds the serving process may hold for no segment:
// its pool's allocations made ahead of time, once none is being made
// (-1 while one is, which no count equals), and the spill memory it keeps
// for the next eviction of its size.
func pooled(inf *gpushm.Info) int {
	spare := 0
	if inf.Tiers != nil {
		// Spill memory kept for the next eviction of its size.
		spare = inf.Tiers.Spare
	}
	switch {
	case inf.Pool == nil:
		return spare
	case inf.Pool.Filling > 0:
		return -1
	}
	return inf.Pool.Ready + spare
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
	// A budget the clients' segments exceed now and then, so that creates
	// and opens evict, besides the clients' own evictions.
	args := []string{"--grace", "3s", "--gpu-budget", "12MiB"}
	fuse := fuseUsable()
	if fuse {
		args = append(args, "--mount", mnt)
	}
	d := Start(t, Options{Socket: sock, Args: args})

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

	// Either process is killed, at random; the first two rounds kill the
	// supervisor and then the serving process that started a new one.
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 9))
	var restarts []time.Duration
	supervisors := 0
	for i := range kills {
		time.Sleep(time.Duration(5+rng.IntN(40)) * time.Millisecond)
		if i == 0 || (i > 1 && rng.IntN(3) == 0) {
			d.KillSupervisor(t)
			supervisors++
			askAll(t, clients, "verify")
			continue
		}
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
		if now.SupervisorPID != d.pid {
			t.Fatalf("supervisor pid %d, want %d", now.SupervisorPID, d.pid)
		}
		askAll(t, clients, "verify")
	}
	slices.Sort(restarts)
	if len(restarts) > 0 {
		t.Logf("%d kills, %d of them the supervisor's; SIGKILL of the serving process to serving again: p50 %s, max %s",
			kills, supervisors, restarts[len(restarts)/2].Round(time.Millisecond), restarts[len(restarts)-1].Round(time.Millisecond))
	}
	held := askAll(t, clients, "stop")
	t.Logf("clients at the end: %v", held)
	for _, cc := range clients {
		if err := cc.cmd.Wait(); err != nil {
			t.Fatalf("client exit: %v\n%s", err, cc.errs.String())
		}
	}
	// Nothing leaks: no segment, no memfd in either process, one
	// supervisor and one serving process (not always its child: the
	// supervisor may be one a serving process started). Memory is freed
	// just after it leaves the registry, so wait for both a moment.
	deadline := time.Now().Add(10 * time.Second)
	for {
		inf, err := d.info()
		if err != nil {
			t.Fatal(err)
		}
		supFDs, srvFDs := memfds(t, d.pid), memfds(t, inf.PID)
		procs := testutil.DaemonProcs(sock)
		want := []int{d.pid, inf.PID}
		slices.Sort(want)
		if inf.Usage.Segments == 0 && inf.Usage.Named == 0 && supFDs == 0 && srvFDs == pooled(inf) && slices.Equal(procs, want) {
			break
		}
		if os.Getenv("GPUSHM_CHAOS_DEBUG") != "" {
			t.Logf("usage %+v sup %d srv %d procs %v", inf.Usage, supFDs, srvFDs, procs)
		}
		if time.Now().After(deadline) {
			t.Fatalf("after every client removed its own: usage %+v, supervisor memfds %d, serving process memfds %d (pool %+v), daemon processes %v (want %v)",
				inf.Usage, supFDs, srvFDs, inf.Pool, procs, want)
		}
		time.Sleep(50 * time.Millisecond)
	}
	d.Stop(t)
	if procs := testutil.DaemonProcs(sock); len(procs) > 0 {
		t.Errorf("daemon processes left after the stop: %v", procs)
	}
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
				fmt.Printf("ok ops=%d evicts=%d reconnects=%d\n", cl.ops, cl.evicts, c.Reconnects())
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
	k      int
	c      *gpushm.Client
	ctx    context.Context
	rng    *rand.Rand
	segs   map[string]*acked
	next   int
	ops    int
	evicts int
	mount  string
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
	case r < 60:
		return cl.check(cl.pick(false))
	case r < 66:
		return cl.evict()
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

// evict moves one of this client's segments to host memory; the next
// check, or another client's open, brings it back. Published memory and
// segments in doubt after a restart refuse (EBUSY).
func (cl *chaos) evict() error {
	name := cl.pick(false)
	if name == "" {
		return nil
	}
	if _, err := cl.c.Evict(cl.ctx, name); err != nil && !errors.Is(err, syscall.EBUSY) {
		return fmt.Errorf("evict %s: %w", name, err)
	}
	cl.evicts++
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

// errNotFUSE: the file was made outside the FUSE view.
var errNotFUSE = errors.New("not on the FUSE view")

// writeFUSE is os.WriteFile for a file that must be on a FUSE mount.
func writeFUSE(path string, b []byte) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	var sfs unix.Statfs_t
	if err := unix.Fstatfs(int(f.Fd()), &sfs); err != nil || sfs.Type != unix.FUSE_SUPER_MAGIC {
		f.Close()
		os.Remove(path) // if the view is back, a file of that name is not there: ENOENT
		return fmt.Errorf("%s: %w (%v)", path, errNotFUSE, err)
	}
	_, err = f.Write(b)
	if err1 := f.Close(); err1 != nil && err == nil {
		err = err1
	}
	return err
}

// fuseWrite writes a file through the FUSE view. A write the crash cut
// short fails (the mount went with the serving process); such a file was
// never acknowledged, and is removed. So is one made while no view was
// mounted: between a serving process's death and its successor's mount
// the mount point is a bare directory (the stale mount is detached first),
// and a file created there is not the daemon's, however well the write
// went.
func (cl *chaos) fuseWrite() error {
	name := cl.newName()
	size := int64(1 + cl.rng.IntN(128<<10))
	seed := cl.rng.Uint64()
	path := filepath.Join(cl.mount, name)
	err := writeFUSE(path, chaosBytes(seed, size))
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
		b, err := os.ReadFile(gpushmBin)
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
	d := Start(t, Options{Exe: exe, Socket: sock, Args: []string{"--grace", "1s"}})
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
	d.Stop(t)
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
		if name, ok := strings.CutPrefix(sc.Text(), "open "); ok {
			// Hold another segment too, mapped, until the process ends.
			s, err := c.Open(ctx, name, nil)
			if err == nil {
				_, err = s.Map()
			}
			if err != nil {
				fmt.Printf("fail %v\n", err)
				continue
			}
			fmt.Println("ok open")
			continue
		}
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

// dialOnce connects to sock with a client that does not reconnect: one
// that checks what survived a restart must not ride a restart itself.
func dialOnce(t *testing.T, sock string) *gpushm.Client {
	t.Helper()
	c, err := gpushm.Dial(context.Background(), sock)
	if err != nil {
		t.Fatal(err)
	}
	c.SetReconnect(0)
	return c
}

// startHolder starts client k as a holder (holderMain) of the segment
// prefix and waits until it holds it.
func startHolder(t *testing.T, sock string, k int, prefix string) *chaosClient {
	t.Helper()
	cc := startChaosClient(t, sock, k, "GPUSHM_TEST_HOLDER="+prefix)
	if line, _ := cc.out.ReadString('\n'); strings.TrimSpace(line) != "ok ready" {
		t.Fatalf("holder %s: %q\n%s", prefix, line, cc.errs.String())
	}
	return cc
}

// TestSurviveReclaim: a client keeps using its mapping while the serving
// process is down, and after the restart reclaims its lease and its
// temporary segment; the temporary segment of a client that died while
// the daemon was down ends at once, not when the grace period does.
func TestSurviveReclaim(t *testing.T) {
	dir := socketDir(t)
	sock := filepath.Join(dir, "gpushm.sock")
	d := Start(t, Options{Socket: sock, Args: []string{"--grace", "2s"}})
	holder := startHolder(t, sock, 0, "held")
	// Another client with a temporary segment, which dies with the daemon.
	victim := startHolder(t, sock, 1, "victim")
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
	d.waitGraceOver(t)
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
	d.Stop(t)
}

// TestSurviveIdleHolder: a client maps a segment and writes it all the
// time, making no call, while the serving process is SIGKILLed; the grace
// period (1 s) ends long before its next call. Its client notices the
// restart by itself (WatchInterval) and reclaims its lease in time: the
// segment stays open, so it may not move (an evict is refused, as a budget's
// would be), and what the client writes after the grace period is what
// another process reads.
func TestSurviveIdleHolder(t *testing.T) {
	dir := socketDir(t)
	sock := filepath.Join(dir, "gpushm.sock")
	d := Start(t, Options{Socket: sock, Args: []string{"--grace", "1s"}})
	holder := startHolder(t, sock, 0, "held")
	inf := d.waitServing(t, 0)
	syscall.Kill(inf.PID, syscall.SIGKILL)
	d.waitServing(t, inf.PID)
	d.waitGraceOver(t)
	ctx := context.Background()
	c := dialOnce(t, sock)
	defer c.Close()
	if _, err := c.Evict(ctx, "held"); !errors.Is(err, syscall.EBUSY) {
		t.Fatalf("evict of a segment its idle holder maps, past the grace period: %v, want EBUSY", err)
	}
	var n uint64
	if _, err := fmt.Sscanf(holder.ask(t, 0, "count"), "ok %d", &n); err != nil {
		t.Fatal(err)
	}
	b, _ := segmentBytes(t, c, "held")
	if got := binary.LittleEndian.Uint64(b); got < n {
		t.Fatalf("another process reads write %d of the holder, which had made %d: its writes went elsewhere", got, n)
	}
	// The watcher reconnected; the holder's first call needs no other.
	if got := holder.ask(t, 0, "op"); got != "ok reconnects=1" {
		t.Fatalf("idle holder's first call after the restart: %s", got)
	}
	d.Stop(t)
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
// process lives (and its client reclaims it between calls, see
// TestSurviveIdleHolder); its next call works; when it exits, the segment
// goes.
func TestSurviveIdle(t *testing.T) {
	idle, kills := 60*time.Second, 5
	if testing.Short() {
		idle = 10 * time.Second
	}
	dir := socketDir(t)
	sock := filepath.Join(dir, "gpushm.sock")
	d := Start(t, Options{Socket: sock, Args: []string{"--grace", "1s"}})
	cc := startIdle(t, sock, "idle-share")
	// check reads the segment from another process (this one), on a
	// connection of its own.
	check := func(when string) {
		t.Helper()
		ctx := context.Background()
		c := dialOnce(t, sock)
		defer c.Close()
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
		d.Crash(t)
		// Past the grace period, which used to end the segment.
		d.waitGraceOver(t)
		check(fmt.Sprintf("after restart %d and its grace period", i+1))
	}
	// The client's first call since the segment was made finds its
	// segment; the client reconnected after each restart by itself, as it
	// holds the segment (WatchInterval), and not again for the call.
	if got, want := cc.ask(t, 0, "check"), fmt.Sprintf("ok reconnects=%d", kills); got != want {
		t.Fatalf("idle client's next call: %s, want %s", got, want)
	}
	if got := listAtQuiet(sock); !slices.Equal(got, []string{"idle-share"}) {
		t.Fatalf("before the client exits: %v", got)
	}
	fmt.Fprintln(cc.in, "exit")
	if err := cc.cmd.Wait(); err != nil {
		t.Fatalf("idle client: %v\n%s", err, cc.errs.String())
	}
	waitNamesAt(t, sock, nil, "after the idle client exited")
	d.Stop(t)
}

// TestSurviveKilledCreator: a creator killed (SIGKILL) around a restart of
// the serving process, which never reconnects, loses its temporary
// segment as soon as the new serving process can tell, long before the
// grace period (10 minutes here) ends: one killed while no serving process
// ran, one after the new one started. A live idle creator keeps its own.
func TestSurviveKilledCreator(t *testing.T) {
	dir := socketDir(t)
	sock := filepath.Join(dir, "gpushm.sock")
	d := Start(t, Options{Socket: sock, Args: []string{"--grace", "10m"}})
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
	d.Stop(t)
}

// TestSurviveCloseAfterCrash: a client that closes after a restart of the
// serving process, without a call in between, ends its temporary segment
// then, not when its process exits.
func TestSurviveCloseAfterCrash(t *testing.T) {
	dir := socketDir(t)
	sock := filepath.Join(dir, "gpushm.sock")
	d := Start(t, Options{Socket: sock, Args: []string{"--grace", "10m"}})
	cc := startIdle(t, sock, "closed")
	d.Crash(t)
	if got := listAtQuiet(sock); !slices.Equal(got, []string{"closed"}) {
		t.Fatalf("after the restart: %v", got)
	}
	if got := cc.ask(t, 0, "close"); got != "ok closed" {
		t.Fatalf("close: %s", got)
	}
	waitNamesAt(t, sock, nil, "after the client closed (its process lives on)")
	d.Stop(t)
}

// chanSpec is one channel of a test stream: NAME:SLOTS:SLOT_BYTES.
type chanSpec struct {
	name      string
	slots     int
	slotBytes int64
}

func (c chanSpec) String() string { return fmt.Sprintf("%s:%d:%d", c.name, c.slots, c.slotBytes) }

func parseChans(s string) ([]chanSpec, error) {
	var out []chanSpec
	for _, f := range strings.Split(s, ",") {
		var c chanSpec
		parts := strings.Split(f, ":")
		if len(parts) != 3 {
			return nil, fmt.Errorf("channel %q: want NAME:SLOTS:SLOT_BYTES", f)
		}
		c.name = parts[0]
		var err1, err2 error
		c.slots, err1 = strconv.Atoi(parts[1])
		c.slotBytes, err2 = strconv.ParseInt(parts[2], 10, 64)
		if err := errors.Join(err1, err2); err != nil {
			return nil, fmt.Errorf("channel %q: %w", f, err)
		}
		out = append(out, c)
	}
	return out, nil
}

func joinChans(cs []chanSpec) string {
	var parts []string
	for _, c := range cs {
		parts = append(parts, c.String())
	}
	return strings.Join(parts, ",")
}

// fillMessage writes message seq of the k-th channel: every 8-byte word
// holds k<<56 | seq, and the bytes after the last whole word hold k. A
// message of another channel, or another message of this one, differs in
// every word.
func fillMessage(b []byte, k int, seq uint64) {
	w := uint64(k)<<56 | seq
	n := len(b) / 8 * 8
	for i := 0; i < n; i += 8 {
		binary.LittleEndian.PutUint64(b[i:], w)
	}
	for i := n; i < len(b); i++ {
		b[i] = byte(k)
	}
}

func checkMessage(b []byte, k int, seq uint64) error {
	w := uint64(k)<<56 | seq
	n := len(b) / 8 * 8
	for i := 0; i < n; i += 8 {
		if got := binary.LittleEndian.Uint64(b[i:]); got != w {
			return fmt.Errorf("message %d: word %d holds %#x (channel %d, message %d), want %#x", seq, i/8, got, got>>56, got&(1<<56-1), w)
		}
	}
	for i := n; i < len(b); i++ {
		if b[i] != byte(k) {
			return fmt.Errorf("message %d: byte %d holds %d, want %d", seq, i, b[i], k)
		}
	}
	return nil
}

// chanEnd is one end of one channel in chansMain; its counts are read by
// the command loop while it runs.
type chanEnd struct {
	spec       chanSpec
	k          int
	mu         sync.Mutex
	first      uint64 // the first message's seq
	next       uint64 // the seq of the message after the last one done
	started    bool
	reconnects int // connections to the daemon made again
	err        error
}

func (e *chanEnd) done(seq uint64) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if !e.started {
		e.first, e.started = seq, true
	}
	e.next = seq + 1
}

func (e *chanEnd) end(err error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.err = err
}

// chansMain is a process holding one end (GPUSHM_TEST_CHANS=tx or rx) of
// each channel in CHANS, each on a connection of its own. A producer
// makes its channel (or opens it) and sends messages until told "stop";
// a consumer receives until EOF, checking that each message has the next
// seq and holds its own bytes (fillMessage). Every so often each makes a
// daemon call, so that a lost connection is made again and its role
// reclaimed on the way. Commands on stdin, one answer line each:
//
//	count  ok NAME=FIRST:NEXT:RECONNECTS ... (the first seq seen, the next
//	       expected, and how many times the connection was made again)
//	stop   (tx) close every channel; then as count
//	wait   (rx) wait for every stream's end; then as count
//
// An answer is "fail ..." once any end failed.
func chansMain(role string) error {
	specs, err := parseChans(os.Getenv("CHANS"))
	if err != nil {
		return err
	}
	sock := os.Getenv("GPUSHM_SOCKET")
	stop := make(chan struct{})
	opened := make(chan error, len(specs))
	var wg sync.WaitGroup
	ends := make([]*chanEnd, len(specs))
	for k, spec := range specs {
		e := &chanEnd{spec: spec, k: k}
		ends[k] = e
		wg.Go(func() { e.end(runChanEnd(sock, role, e, opened, stop)) })
	}
	// Ready once every end holds its role: a consumer started after this
	// producer cannot find the stream ended by the producer before it.
	for range specs {
		if err := <-opened; err != nil {
			return err
		}
	}
	report := func() string {
		var parts []string
		for _, e := range ends {
			e.mu.Lock()
			if e.err != nil {
				err := e.err
				e.mu.Unlock()
				return fmt.Sprintf("fail %s: %v", e.spec.name, err)
			}
			parts = append(parts, fmt.Sprintf("%s=%d:%d:%d", e.spec.name, e.first, e.next, e.reconnects))
			e.mu.Unlock()
		}
		return "ok " + strings.Join(parts, " ")
	}
	fmt.Println("ok ready")
	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		switch sc.Text() {
		case "count":
		case "stop", "wait":
			if sc.Text() == "stop" {
				close(stop)
			}
			wg.Wait()
			fmt.Println(report())
			return nil
		}
		fmt.Println(report())
	}
	return nil
}

func runChanEnd(sock, role string, e *chanEnd, opened chan<- error, stop <-chan struct{}) error {
	ctx := context.Background()
	c, ch, err := openChanEnd(ctx, sock, role, e.spec)
	opened <- err
	if err != nil {
		return err
	}
	defer c.Close()
	for n := 1; ; n++ {
		if n%10 == 0 {
			if _, err := c.Stat(ctx, e.spec.name); err != nil {
				return err
			}
			e.mu.Lock()
			e.reconnects = c.Reconnects()
			e.mu.Unlock()
		}
		if role == "tx" {
			select {
			case <-stop:
				return ch.Close()
			default:
			}
			m, err := ch.Send(ctx, 0)
			if err != nil {
				return fmt.Errorf("send: %w", err)
			}
			fillMessage(m.Bytes(), e.k, m.Seq())
			if err := m.Done(0); err != nil {
				return err
			}
			e.done(m.Seq())
			time.Sleep(time.Millisecond)
			continue
		}
		m, err := ch.Recv(ctx, 0)
		if errors.Is(err, io.EOF) {
			return ch.Close()
		}
		if err != nil {
			return fmt.Errorf("recv: %w", err)
		}
		e.mu.Lock()
		want, started := e.next, e.started
		e.mu.Unlock()
		if started && m.Seq() != want {
			return fmt.Errorf("message %d came after %d", m.Seq(), want-1)
		}
		if err := checkMessage(m.Bytes(), e.k, m.Seq()); err != nil {
			return err
		}
		if err := m.Done(0); err != nil {
			return err
		}
		e.done(m.Seq())
	}
}

func openChanEnd(ctx context.Context, sock, role string, spec chanSpec) (*gpushm.Client, *gpushm.Channel, error) {
	c, err := gpushm.Dial(ctx, sock)
	if err != nil {
		return nil, nil, err
	}
	var ch *gpushm.Channel
	if role == "tx" {
		ch, err = c.Channel(ctx, spec.name, gpushm.Producer, &gpushm.ChannelOptions{Slots: spec.slots, SlotBytes: spec.slotBytes})
	} else {
		ch, err = c.Channel(ctx, spec.name, gpushm.Consumer, nil)
	}
	if err == nil {
		if got := ch.Info().Channel; got.Slots != spec.slots || got.SlotBytes != spec.slotBytes {
			err = fmt.Errorf("opened %d slots of %d bytes, want %s", got.Slots, got.SlotBytes, spec)
		}
	}
	if err != nil {
		c.Close()
		return nil, nil, fmt.Errorf("%s: %w", spec.name, err)
	}
	return c, ch, nil
}

// chanProc is a chansMain process.
type chanProc struct {
	*chaosClient
	role string
}

func startChans(t *testing.T, sock, role string, specs []chanSpec) *chanProc {
	t.Helper()
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), "GPUSHM_TEST_CHANS="+role, "GPUSHM_SOCKET="+sock, "CHANS="+joinChans(specs))
	in, _ := cmd.StdinPipe()
	out, _ := cmd.StdoutPipe()
	p := &chanProc{chaosClient: &chaosClient{cmd: cmd, in: in, out: bufio.NewReader(out), errs: &syncBuffer{}}, role: role}
	cmd.Stderr = p.errs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	if line, err := p.out.ReadString('\n'); strings.TrimSpace(line) != "ok ready" {
		t.Fatalf("%s: %q %v\n%s", role, line, err, p.errs.String())
	}
	return p
}

// endCount is where one end of one channel is.
type endCount struct {
	first, next uint64 // the first message's seq, the next one's
	reconnects  int
}

// counts asks for (or with "stop" and "wait", ends with) every channel's
// count.
func (p *chanProc) counts(t *testing.T, cmd string) map[string]endCount {
	t.Helper()
	line := p.ask(t, 0, cmd)
	out := map[string]endCount{}
	for _, f := range strings.Fields(strings.TrimPrefix(line, "ok")) {
		name, v, _ := strings.Cut(f, "=")
		var c endCount
		if _, err := fmt.Sscanf(v, "%d:%d:%d", &c.first, &c.next, &c.reconnects); err != nil {
			t.Fatalf("%s: %q: %v", p.role, line, err)
		}
		out[name] = c
	}
	return out
}

// progress waits until every channel's end has gone past where it was
// (before; every channel of specs when nil) and, with reconnected, has
// made its connection to the daemon again: it went on through a restart,
// and took its role back.
func (p *chanProc) progress(t *testing.T, specs []chanSpec, before map[string]endCount, reconnected bool) map[string]endCount {
	t.Helper()
	for deadline := time.Now().Add(60 * time.Second); ; {
		now := p.counts(t, "count")
		moved := true
		for _, spec := range specs {
			was, c := before[spec.name], now[spec.name]
			if c.next <= was.next || reconnected && c.reconnects <= was.reconnects {
				moved = false
			}
		}
		if moved {
			return now
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not every channel went on within 60s: %v, before %v", p.role, now, before)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// checkChannels checks that the daemon lists exactly specs, each a
// channel of its own layout and none an orphan; and, with tx and rx, that
// each role is still held by its process: a third process asking for it
// is told who holds it.
func checkChannels(t *testing.T, sock string, specs []chanSpec, tx, rx *chanProc) {
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
	if len(segs) != len(specs) {
		t.Fatalf("listed %+v, want the channels %v", segs, specs)
	}
	for _, spec := range specs {
		inf, err := c.Stat(ctx, spec.name)
		if err != nil {
			t.Fatalf("stat %s: %v", spec.name, err)
		}
		if inf.Orphan != "" || inf.Channel == nil || inf.Channel.Slots != spec.slots || inf.Channel.SlotBytes != spec.slotBytes ||
			inf.Size != int64(spec.slots)*inf.Channel.SlotStride {
			t.Fatalf("stat %s: %+v (channel %+v), want %s", spec.name, inf, inf.Channel, spec)
		}
		for _, end := range []struct {
			role gpushm.Role
			p    *chanProc
		}{{gpushm.Producer, tx}, {gpushm.Consumer, rx}} {
			if end.p == nil {
				continue
			}
			_, err := c.Channel(ctx, spec.name, end.role, nil)
			if want := fmt.Sprintf("(pid %d)", end.p.cmd.Process.Pid); err == nil || !errors.Is(err, syscall.EBUSY) || !strings.Contains(err.Error(), want) {
				t.Fatalf("%s: taking role %s from another process: %v, want EBUSY naming %s", spec.name, end.role, err, want)
			}
		}
	}
}

// checkDaemonLog fails if the daemon logged an error other than the
// deaths of serving processes the test caused.
func checkDaemonLog(t *testing.T, log string) {
	t.Helper()
	for _, line := range strings.Split(log, "\n") {
		if strings.Contains(line, "level=ERROR") && !strings.Contains(line, `msg="serving process died; restarting it"`) {
			t.Errorf("daemon logged an error: %s", line)
		}
	}
}

// leaveMessages makes each channel of specs and sends it as many
// messages as it has slots, of which it receives one: slots-1 messages
// are left in each, and both ends are closed.
func leaveMessages(t *testing.T, c *gpushm.Client, specs []chanSpec) {
	t.Helper()
	ctx := context.Background()
	for k, spec := range specs {
		tx, err := c.Channel(ctx, spec.name, gpushm.Producer, &gpushm.ChannelOptions{Slots: spec.slots, SlotBytes: spec.slotBytes})
		if err != nil {
			t.Fatal(err)
		}
		rx, err := c.Channel(ctx, spec.name, gpushm.Consumer, nil)
		if err != nil {
			t.Fatal(err)
		}
		for range spec.slots {
			m, err := tx.Send(ctx, 0)
			if err != nil {
				t.Fatal(err)
			}
			fillMessage(m.Bytes(), k, m.Seq())
			m.Done(0)
		}
		m, err := rx.Recv(ctx, 0)
		if err != nil {
			t.Fatal(err)
		}
		m.Done(0)
		if err := errors.Join(rx.Close(), tx.Close()); err != nil {
			t.Fatal(err)
		}
	}
}

// takeLeftMessages receives what leaveMessages left in each channel,
// checking each message's seq and bytes, and then the end of the stream.
func takeLeftMessages(t *testing.T, c *gpushm.Client, specs []chanSpec) {
	t.Helper()
	ctx := context.Background()
	for k, spec := range specs {
		rx, err := c.Channel(ctx, spec.name, gpushm.Consumer, nil)
		if err != nil {
			t.Fatal(err)
		}
		for seq := uint64(1); seq < uint64(spec.slots); seq++ {
			m, err := rx.Recv(ctx, 0)
			if err != nil {
				t.Fatalf("%s: message %d, sent before the restarts: %v", spec.name, seq, err)
			}
			if m.Seq() != seq {
				t.Fatalf("%s: message %d came as %d", spec.name, seq, m.Seq())
			}
			if err := checkMessage(m.Bytes(), k, seq); err != nil {
				t.Fatalf("%s: %v", spec.name, err)
			}
			m.Done(0)
		}
		if _, err := rx.Recv(ctx, 0); !errors.Is(err, io.EOF) {
			t.Fatalf("%s: after the messages of a closed producer: %v, want io.EOF", spec.name, err)
		}
		if err := rx.Close(); err != nil {
			t.Fatal(err)
		}
	}
}

// TestSurviveChannels: several channels of different sizes keep their
// names, memory, control blocks, roles and sequence numbers through
// kill -9 of the serving process and upgrades: first idle, with messages
// waiting in their slots (each channel then maps memory of its own, not
// the newest channel's), then with a producer process and a consumer
// process streaming on all of them at once. Every message is checked,
// every stream ends with EOF after its producer closes, and stopping the
// daemon logs no error.
func TestSurviveChannels(t *testing.T) {
	dir := socketDir(t)
	sock := filepath.Join(dir, "gpushm.sock")
	d := Start(t, Options{Socket: sock, Args: []string{"--grace", "30s"}})
	specs := []chanSpec{{"A", 4, 4096}, {"B", 2, 65536}, {"C", 4, 4096}, {"D", 3, 12345}, {"E", 8, 100}}
	ctx := context.Background()

	// Idle: each channel holds slots-1 messages nobody received; both
	// ends closed.
	c, err := gpushm.Dial(ctx, sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	leaveMessages(t, c, specs)
	for _, upgrade := range []bool{false, true, false} {
		d.Restart(t, upgrade)
		checkChannels(t, sock, specs, nil, nil)
	}
	takeLeftMessages(t, c, specs)

	// Streaming: new ends go on where the first ones stopped.
	tx := startChans(t, sock, "tx", specs)
	rx := startChans(t, sock, "rx", specs)
	txAt, rxAt := tx.progress(t, specs, nil, false), rx.progress(t, specs, nil, false)
	for _, spec := range specs {
		if first := rxAt[spec.name].first; first != uint64(spec.slots) {
			t.Fatalf("%s: the second consumer's first message is %d, want %d", spec.name, first, spec.slots)
		}
	}
	for i, upgrade := range []bool{false, true, false, false, true, false} {
		d.Restart(t, upgrade)
		txAt, rxAt = tx.progress(t, specs, txAt, !upgrade), rx.progress(t, specs, rxAt, !upgrade)
		if i%2 == 0 {
			checkChannels(t, sock, specs, tx, rx)
		}
	}
	sent := tx.counts(t, "stop")
	got := rx.counts(t, "wait")
	for _, spec := range specs {
		if s, g := sent[spec.name], got[spec.name]; s.first != g.first || s.next != g.next {
			t.Fatalf("%s: sent messages %d to %d, received %d to %d", spec.name, s.first, s.next-1, g.first, g.next-1)
		}
	}
	for _, p := range []*chanProc{tx, rx} {
		if err := p.cmd.Wait(); err != nil {
			t.Fatalf("%s: %v\n%s", p.role, err, p.errs.String())
		}
	}
	checkChannels(t, sock, specs, nil, nil)
	t.Logf("sent and received %v", got)
	d.Stop(t)
	checkDaemonLog(t, d.log.String())
}

// TestSurviveChannel: one stream, a producer process and a consumer
// process, through 10 kill -9 of the serving process and 3 upgrades: the
// consumer gets every message once, in order, each holding its own
// sequence number in every word, and then EOF after the producer closes.
func TestSurviveChannel(t *testing.T) {
	dir := socketDir(t)
	sock := filepath.Join(dir, "gpushm.sock")
	d := Start(t, Options{Socket: sock, Args: []string{"--grace", "30s"}})
	specs := []chanSpec{{"stream", 4, 4096}}
	tx := startChans(t, sock, "tx", specs)
	rx := startChans(t, sock, "rx", specs)
	txAt, rxAt := tx.progress(t, specs, nil, false), rx.progress(t, specs, nil, false)
	kills, upgrades := 0, 0
	for i := range 13 {
		upgrade := i%4 == 3 // 3 upgrades among 10 kills
		d.Restart(t, upgrade)
		if upgrade {
			upgrades++
		} else {
			kills++
		}
		txAt, rxAt = tx.progress(t, specs, txAt, !upgrade), rx.progress(t, specs, rxAt, !upgrade)
	}
	checkChannels(t, sock, specs, tx, rx)
	sent, got := tx.counts(t, "stop")["stream"], rx.counts(t, "wait")["stream"]
	if got.first != 0 || sent.first != 0 || got.next != sent.next {
		t.Fatalf("sent messages %d to %d, received %d to %d", sent.first, sent.next-1, got.first, got.next-1)
	}
	if got.reconnects < kills || sent.reconnects < kills {
		t.Fatalf("connections made again: producer %d, consumer %d; want %d, one a kill", sent.reconnects, got.reconnects, kills)
	}
	for _, p := range []*chanProc{tx, rx} {
		if err := p.cmd.Wait(); err != nil {
			t.Fatalf("%s: %v\n%s", p.role, err, p.errs.String())
		}
	}
	t.Logf("%d kills, %d upgrades: %d messages sent and received", kills, upgrades, got.next)
	d.Stop(t)
	checkDaemonLog(t, d.log.String())
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

// nonMemFDs counts a process's descriptors other than memfds: sockets,
// pidfds, the lock, the listener, what a replacement of the supervisor
// could leak.
func nonMemFDs(t *testing.T, pid int) (int, []string) {
	t.Helper()
	dir := fmt.Sprintf("/proc/%d/fd", pid)
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var links []string
	for _, e := range ents {
		if l, err := os.Readlink(filepath.Join(dir, e.Name())); err == nil && !strings.HasPrefix(l, "/memfd:") {
			links = append(links, l)
		}
	}
	slices.Sort(links)
	return len(links), links
}

// TestSurviveSupervisorNames: ps tells the daemon's processes apart
// (internal/supervisor/name.go), and a supervisor the serving process
// started in place of a dead one is named as the first, not "exe" after
// the /proc/self/exe it is exec'd through.
func TestSurviveSupervisorNames(t *testing.T) {
	sock := filepath.Join(socketDir(t), "gpushm.sock")
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
	dir := socketDir(t)
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
	for deadline := time.Now().Add(10 * time.Second); ; {
		inf, err := d.info()
		if err != nil {
			t.Fatal(err)
		}
		supFDs, srvFDs := memfds(t, d.pid), memfds(t, inf.PID)
		procs := testutil.DaemonProcs(sock)
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

// TestSurviveSupervisorChannel: channels of different sizes stream while
// the supervisor and the serving process are killed in turn, and a
// replaced supervisor upgrades once. The new supervisor must hold each
// channel's control block beside its memory, since the serving process it
// starts after the next kill serves the channels from what it holds. A
// supervisor's death makes no end connect again.
func TestSurviveSupervisorChannel(t *testing.T) {
	dir := socketDir(t)
	sock := filepath.Join(dir, "gpushm.sock")
	d := Start(t, Options{Socket: sock, Args: []string{"--grace", "30s"}})
	specs := []chanSpec{{"A", 4, 4096}, {"B", 2, 65536}, {"C", 3, 12345}}
	tx := startChans(t, sock, "tx", specs)
	rx := startChans(t, sock, "rx", specs)
	txAt, rxAt := tx.progress(t, specs, nil, false), rx.progress(t, specs, nil, false)
	for i := range 4 {
		d.KillSupervisor(t)
		for _, end := range []struct {
			p  *chanProc
			at *map[string]endCount
		}{{tx, &txAt}, {rx, &rxAt}} {
			now := end.p.progress(t, specs, *end.at, false)
			for _, spec := range specs {
				if was, c := (*end.at)[spec.name], now[spec.name]; c.reconnects != was.reconnects {
					t.Fatalf("%s %s: connected again (%d, was %d) when only the supervisor died", end.p.role, spec.name, c.reconnects, was.reconnects)
				}
			}
			*end.at = now
		}
		checkChannels(t, sock, specs, tx, rx)
		upgrade := i == 2
		d.Restart(t, upgrade)
		txAt, rxAt = tx.progress(t, specs, txAt, !upgrade), rx.progress(t, specs, rxAt, !upgrade)
		checkChannels(t, sock, specs, tx, rx)
	}
	sent, got := tx.counts(t, "stop"), rx.counts(t, "wait")
	for _, spec := range specs {
		if s, g := sent[spec.name], got[spec.name]; s.first != g.first || s.next != g.next {
			t.Fatalf("%s: sent messages %d to %d, received %d to %d", spec.name, s.first, s.next-1, g.first, g.next-1)
		}
	}
	for _, p := range []*chanProc{tx, rx} {
		if err := p.cmd.Wait(); err != nil {
			t.Fatalf("%s: %v\n%s", p.role, err, p.errs.String())
		}
	}
	checkChannels(t, sock, specs, nil, nil)
	t.Logf("sent and received %v", got)
	d.Stop(t)
	checkDaemonLog(t, d.log.String())
}
