package integration

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
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
)

// Crashes: these tests run the daemon as users do, a supervisor and its
// serving process, and kill, upgrade and restart the serving process under
// clients that are processes of their own (this test binary again, in
// chaos-client mode).

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
	dir := testutil.SocketDir(t)
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
