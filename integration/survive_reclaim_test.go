package integration

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/testutil"
)

// Leases and temporary segments across crashes of the serving process:
// reclaimed by their holders, idle or busy, and let go when their holder
// is gone.

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
	dir := testutil.SocketDir(t)
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
	dir := testutil.SocketDir(t)
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
	dir := testutil.SocketDir(t)
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
	dir := testutil.SocketDir(t)
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
	dir := testutil.SocketDir(t)
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
