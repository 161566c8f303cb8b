package integration

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/testutil"
)

var tierPatterns sync.Map // [2]int64{seed, n} -> []byte

// tierPattern is seed's bytes: 64-bit words that differ from every other
// segment's and every other offset's. Made once each: the race detector
// makes the loop slow.
func tierPattern(seed uint64, n int64) []byte {
	key := [2]int64{int64(seed), n}
	if b, ok := tierPatterns.Load(key); ok {
		return b.([]byte)
	}
	b := make([]byte, n)
	defer tierPatterns.Store(key, b)
	for i := int64(0); i+8 <= n; i += 8 {
		binary.LittleEndian.PutUint64(b[i:], seed<<32|uint64(i/8))
	}
	return b
}

// tiersMain is a second process for TestTiers: it reads commands from
// stdin and answers each with one line, "ok ..." or "fail ...".
//
//	read NAME:SEED...  open each (read-only), in the order given, check every byte, close
//	hold NAME          open NAME read-write and keep it open
//	write NAME SEED    write SEED's pattern through the held mapping
//	close NAME         close the held segment
func tiersMain() error {
	ctx := context.Background()
	c, err := gpushm.Dial(ctx, os.Getenv("GPUSHM_SOCKET"))
	if err != nil {
		return err
	}
	defer c.Close()
	held := map[string]*gpushm.Segment{}
	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 0 {
			continue
		}
		if err := tiersStep(ctx, c, held, f); err != nil {
			fmt.Printf("fail %s: %v\n", f[0], err)
			continue
		}
		fmt.Println("ok")
	}
	return nil
}

func tiersStep(ctx context.Context, c *gpushm.Client, held map[string]*gpushm.Segment, f []string) error {
	switch f[0] {
	case "read":
		for _, arg := range f[1:] {
			name, s, _ := strings.Cut(arg, ":")
			seed, _ := strconv.ParseUint(s, 10, 64)
			seg, err := c.Open(ctx, name, &gpushm.OpenOptions{ReadOnly: true})
			if err != nil {
				return err
			}
			err = checkTierBytes(seg, name, seed)
			seg.Close()
			if err != nil {
				return err
			}
		}
		return nil
	case "hold":
		seg, err := c.Open(ctx, f[1], nil)
		if err != nil {
			return err
		}
		held[f[1]] = seg
		return nil
	case "write":
		seed, _ := strconv.ParseUint(f[2], 10, 64)
		seg := held[f[1]]
		m, err := seg.Map()
		if err != nil {
			return err
		}
		_, err = m.WriteAt(tierPattern(seed, seg.Info().Size), 0)
		return err
	case "close":
		err := held[f[1]].Close()
		delete(held, f[1])
		return err
	}
	return fmt.Errorf("unknown command %q", f[0])
}

func checkTierBytes(seg *gpushm.Segment, name string, seed uint64) error {
	m, err := seg.Map()
	if err != nil {
		return err
	}
	n := seg.Info().Size
	got := make([]byte, n)
	if _, err := m.ReadAt(got, 0); err != nil {
		return err
	}
	want := tierPattern(seed, n)
	if bytes.Equal(got, want) {
		return nil
	}
	for i := int64(0); i < n; i += 8 {
		if string(got[i:i+8]) != string(want[i:i+8]) {
			return fmt.Errorf("%s: bytes %d-%d are %x, want %x (seed %d)", name, i, i+8, got[i:i+8], want[i:i+8], seed)
		}
	}
	return nil
}

// tierDaemon serves with a budget and checks, all along, that the device
// never holds more than it: every 2 ms it sums the segments that ls says
// are on the device, and reads info's figures.
type tierDaemon struct {
	*Daemon
	budget   int64
	stop     chan struct{}
	done     chan struct{}
	samples  atomic.Int64
	overErr  atomic.Value // string
	pinned   []string     // must always be on the device
	holding  sync.Map     // name -> true while a process holds it open
	heldMove atomic.Value // string: a held segment seen off the device
}

func startTierDaemon(t *testing.T, budget int64, args ...string) *tierDaemon {
	t.Helper()
	dir := testutil.SocketDir(t)
	sock := filepath.Join(dir, "gpushm.sock")
	args = append([]string{"--gpu-budget", strconv.FormatInt(budget, 10), "--grace", "1s"}, args...)
	d := &tierDaemon{Daemon: Start(t, Options{Socket: sock, Args: args}), budget: budget,
		stop: make(chan struct{}), done: make(chan struct{})}
	return d
}

func (d *tierDaemon) watch(t *testing.T) {
	go func() {
		defer close(d.done)
		ctx := context.Background()
		c, err := gpushm.Dial(ctx, d.socket)
		if err != nil {
			d.overErr.Store(err.Error())
			return
		}
		defer c.Close()
		for {
			select {
			case <-d.stop:
				return
			case <-time.After(2 * time.Millisecond):
			}
			segs, err := c.List(ctx)
			if err != nil {
				continue // a restart: the client reconnects at its next call
			}
			var on int64
			for _, s := range segs {
				if s.Tier == "gpu" {
					on += s.AllocSize
				}
				if s.Tier != "gpu" && slices.Contains(d.pinned, s.Name) {
					d.heldMove.Store(fmt.Sprintf("pinned %s on tier %q", s.Name, s.Tier))
				}
				if _, ok := d.holding.Load(s.Name); ok && s.Tier != "gpu" {
					d.heldMove.Store(fmt.Sprintf("open %s on tier %q", s.Name, s.Tier))
				}
			}
			if on > d.budget {
				d.overErr.Store(fmt.Sprintf("ls: %d bytes on the device, budget %d", on, d.budget))
			}
			d.samples.Add(1)
		}
	}()
	t.Cleanup(d.check(t))
}

func (d *tierDaemon) check(t *testing.T) func() {
	return func() {
		select {
		case <-d.stop:
		default:
			close(d.stop)
		}
		<-d.done
		if v := d.overErr.Load(); v != nil {
			t.Errorf("over budget: %s", v)
		}
		if v := d.heldMove.Load(); v != nil {
			t.Errorf("moved while it must not: %s", v)
		}
		if d.samples.Load() < 10 {
			t.Errorf("only %d samples of the tiers were taken", d.samples.Load())
		}
	}
}

// tiersOf is ls --json's tier of every segment.
func tiersOf(t *testing.T, sock string) map[string]string {
	t.Helper()
	var segs []struct{ Name, Tier string }
	if err := json.Unmarshal([]byte(mustRun(t, nil, "--socket", sock, "ls", "--json")), &segs); err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for _, s := range segs {
		out[s.Name] = s.Tier
	}
	return out
}

// TestTiers: more than a budget's worth of segments, read in a shuffled
// order by several processes at once, with one held open and one pinned
// throughout; then the order of eviction, the errors, and a restart.
func TestTiers(t *testing.T) {
	// The budget holds the pinned segment, the held one, one open by
	// each of the four readers, and one more; the host budget all of
	// them.
	const (
		seg    = 2 << 20
		budget = 7 * seg
		n      = 14
	)
	d := startTierDaemon(t, budget, "--host-budget", strconv.Itoa((n+2)*seg))
	sock := d.socket
	ctx := context.Background()
	c, err := gpushm.Dial(ctx, sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	seeds := map[string]uint64{}
	create := func(name string, pin bool) {
		t.Helper()
		seeds[name] = uint64(len(seeds) + 1)
		s, err := c.Create(ctx, name, seg, &gpushm.CreateOptions{Pin: pin})
		if err != nil {
			t.Fatalf("create %s: %v", name, err)
		}
		m, err := s.Map()
		if err == nil {
			_, err = m.WriteAt(tierPattern(seeds[name], seg), 0)
		}
		if err != nil {
			t.Fatal(err)
		}
		s.Close()
	}
	d.pinned = []string{"pinned"}
	d.watch(t)
	create("pinned", true)
	create("held", false)
	holder := startChaosClientEnv(t, sock, "GPUSHM_TEST_TIERS=1")
	holder.ask(t, 0, "hold held")
	d.holding.Store("held", true)
	var names []string
	for i := range n {
		name := fmt.Sprintf("s%02d", i)
		create(name, false)
		names = append(names, name)
	}
	if got := tiersOf(t, sock); got["s00"] != "host" || got["pinned"] != "gpu" || got["held"] != "gpu" {
		t.Fatalf("after creating %d segments of %d bytes under a budget of %d: %v", n+2, seg, budget, got)
	}

	// Four processes read everything in shuffled orders at once.
	var readers []*chaosClient
	for range 4 {
		readers = append(readers, startChaosClientEnv(t, sock, "GPUSHM_TEST_TIERS=1"))
	}
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 18))
	for range 3 {
		var wg sync.WaitGroup
		for k, r := range readers {
			order := slices.Clone(names)
			rng.Shuffle(len(order), func(i, j int) { order[i], order[j] = order[j], order[i] })
			cmd := "read"
			for _, name := range order {
				cmd += fmt.Sprintf(" %s:%d", name, seeds[name])
			}
			wg.Go(func() { r.ask(t, k, cmd) })
		}
		wg.Wait()
	}
	// The held segment stayed where its holder writes: a new pattern
	// written through its mapping is what the next open reads.
	holder.ask(t, 0, "write held 99")
	holder.ask(t, 0, "close held")
	d.holding.Delete("held")
	seeds["held"] = 99
	readers[0].ask(t, 0, fmt.Sprintf("read held:99 pinned:%d", seeds["pinned"]))

	inf, err := c.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	dt := inf.Tiers.Devices[0]
	if dt.Budget != budget || dt.Peak > budget || dt.Peak < budget-seg || inf.Tiers.Evictions == 0 || inf.Tiers.Restores == 0 {
		t.Fatalf("info's tiers: %+v, device %+v", inf.Tiers, dt)
	}
	t.Logf("%d evictions, %d restores; device peak %d of %d", inf.Tiers.Evictions, inf.Tiers.Restores, dt.Peak, budget)

	checkEvictionOrder(t, sock, names, seeds, readers[0])
	checkTierErrors(t, sock, holder, budget, seg)

	// A restart keeps every segment in its tier, and every byte.
	before := tiersOf(t, sock)
	inf, _ = d.info()
	if err := syscall.Kill(inf.PID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	d.waitServing(t, inf.PID)
	if after := tiersOf(t, sock); !mapsEqual(before, after) {
		t.Fatalf("tiers before the restart %v, after %v", before, after)
	}
	cmd := "read"
	for _, name := range append(names, "held", "pinned") {
		cmd += fmt.Sprintf(" %s:%d", name, seeds[name])
	}
	readers[1].ask(t, 1, cmd) // restores wait for the grace period to make room
	inf, _ = d.info()
	if inf.Tiers.Devices[0].Peak > budget {
		t.Fatalf("after the restart: %+v", inf.Tiers.Devices[0])
	}
}

// checkEvictionOrder is TestTiers's test of the order of eviction, through
// evict, load and reader's opens, of the segments names (seeds their
// patterns).
func checkEvictionOrder(t *testing.T, sock string, names []string, seeds map[string]uint64, reader *chaosClient) {
	t.Helper()
	// The order of eviction is the order of last opens: with pinned and
	// s01-s06 on the device, in that order of use, each open of another
	// evicts the least recently opened.
	for _, name := range append(names, "held") {
		mustRun(t, nil, "--socket", sock, "evict", name)
	}
	for _, name := range []string{"s01", "s02", "s03", "s04", "s05", "s06"} {
		mustRun(t, nil, "--socket", sock, "load", name)
		time.Sleep(2 * time.Millisecond)
	}
	reader.ask(t, 0, fmt.Sprintf("read s02:%d", seeds["s02"])) // s02 is now the most recent
	time.Sleep(2 * time.Millisecond)
	reader.ask(t, 0, fmt.Sprintf("read s07:%d", seeds["s07"])) // evicts s01
	time.Sleep(2 * time.Millisecond)
	reader.ask(t, 0, fmt.Sprintf("read s08:%d", seeds["s08"])) // evicts s03
	got := tiersOf(t, sock)
	want := map[string]string{"pinned": "gpu", "s01": "host", "s02": "gpu", "s03": "host", "s04": "gpu",
		"s05": "gpu", "s06": "gpu", "s07": "gpu", "s08": "gpu", "held": "host"}
	for name, w := range want {
		if got[name] != w {
			t.Fatalf("after loading s01-s06 and reading s02, s07, s08: %v, want %v", got, want)
		}
	}
}

// checkTierErrors is TestTiers's test of what evict, load and create
// refuse, and of the host budget, with holder holding segments for it.
func checkTierErrors(t *testing.T, sock string, holder *chaosClient, budget, seg int) {
	t.Helper()
	// Errors.
	holder.ask(t, 0, "hold s02")
	mustFail(t, "it is open", "--socket", sock, "evict", "s02")
	holder.ask(t, 0, "close s02")
	mustFail(t, "pinned to its device", "--socket", sock, "evict", "pinned")
	mustFail(t, "no room under the budget", "--socket", sock, "create", "huge", strconv.Itoa(budget+seg))
	mustFail(t, "no such segment", "--socket", sock, "load", "nothing")
	// The device is full, and host memory holds 9 of its 16: seven
	// creates fit, each evicting one; the eighth would need a 17th.
	for i := range 8 {
		name := fmt.Sprintf("more%d", i)
		if i < 7 {
			mustRun(t, nil, "--socket", sock, "create", name, strconv.Itoa(seg))
			continue
		}
		mustFail(t, "host budget", "--socket", sock, "create", name, strconv.Itoa(seg))
		if got := tiersOf(t, sock); got[name] != "" || got["more6"] != "gpu" || got["s04"] != "host" {
			t.Fatalf("after creating more0 to more7: %v", got)
		}
	}
	for i := range 7 {
		mustRun(t, nil, "--socket", sock, "rm", fmt.Sprintf("more%d", i))
	}
}

func mapsEqual(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

// startChaosClientEnv starts this test binary as a line-driven second
// process with the given role variable.
func startChaosClientEnv(t *testing.T, sock, role string) *chaosClient {
	return startChaosClient(t, sock, -1, role)
}

// TestSurviveTiers kills the serving process while segments move between
// the device and host memory back to back: after every restart each
// segment is whole, in one place (the supervisor holds one descriptor of
// it), with its bytes.
func TestSurviveTiers(t *testing.T) {
	const (
		seg   = 32 << 20
		count = 4
	)
	kills := 20
	if testing.Short() {
		kills = 8
	}
	d := startTierDaemon(t, 2*seg, "--host-budget", strconv.Itoa(count*seg), "--grace", "200ms")
	ctx := context.Background()
	c, err := gpushm.Dial(ctx, d.socket)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	all := "read"
	var names []string
	for i := range count {
		name := fmt.Sprintf("m%d", i)
		s, err := c.Create(ctx, name, seg, nil)
		if err != nil {
			t.Fatal(err)
		}
		m, err := s.Map()
		if err == nil {
			_, err = m.WriteAt(tierPattern(uint64(i+1), seg), 0)
		}
		s.Close()
		if err != nil {
			t.Fatal(err)
		}
		names = append(names, name)
		all += fmt.Sprintf(" %s:%d", name, i+1)
	}
	reader := startChaosClientEnv(t, d.socket, "GPUSHM_TEST_TIERS=1")
	reader.ask(t, 0, all)

	// Moves back to back, from a client of its own that rides out the
	// kills (it reconnects and sends its request again).
	stop := make(chan struct{})
	churned := make(chan error, 1)
	var moves atomic.Int64
	var busy atomic.Bool // an evict or a load is on its way
	go func() { churned <- churnTiers(d.socket, names, stop, &moves, &busy) }()
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 3))
	// At least half the kills must come mid-move: a busy machine that
	// lets the churn fall idle more often gets more rounds, not a failure.
	midMove, rounds := 0, 0
	for i := 0; i < kills || midMove < kills/2; i++ {
		if i == 10*kills {
			t.Fatalf("only %d of %d kills came while a segment moved", midMove, i)
		}
		rounds++
		// Segments move again once the grace period is over: kill then,
		// mid-move most of the time.
		var inf *gpushm.Info
		for {
			if inf, err = d.info(); err != nil {
				t.Fatalf("round %d: %v", i, err)
			}
			if inf.Grace == 0 {
				break
			}
			time.Sleep(5 * time.Millisecond)
		}
		time.Sleep(time.Duration(5+rng.IntN(60)) * time.Millisecond)
		if busy.Load() {
			midMove++
		}
		if err := syscall.Kill(inf.PID, syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		d.waitServing(t, inf.PID)
		// A move's new memory reaches the supervisor a moment before the
		// record that lets its old memory go: one over, while the churn
		// runs, is a move on its way; a leak stays.
		if n := settledMemfds(t, d.pid, count); n != count {
			t.Fatalf("round %d: the supervisor holds %d memfds for %d segments", i, n, count)
		}
		if i%5 == 4 {
			reader.ask(t, 0, all)
		}
	}
	close(stop)
	if err := <-churned; err != nil {
		t.Fatalf("evict and load: %v", err)
	}
	reader.ask(t, 0, all)
	tiers := tiersOf(t, d.socket)
	if len(tiers) != count {
		t.Fatalf("segments after %d kills: %v", rounds, tiers)
	}
	t.Logf("%d kills, %d of them while an evict or a load was on its way, during %d evictions and loads; tiers at the end %v",
		rounds, midMove, moves.Load(), tiers)
}

// churnTiers evicts and loads names on sock back to back, from a client of
// its own that rides out the kills (it reconnects and sends its request
// again), until stop; it counts the moves, and says in busy when one is
// on its way.
func churnTiers(sock string, names []string, stop <-chan struct{}, moves *atomic.Int64, busy *atomic.Bool) error {
	ctx := context.Background()
	cc, err := gpushm.Dial(ctx, sock)
	if err != nil {
		return err
	}
	defer cc.Close()
	rng := rand.New(rand.NewPCG(1, 2))
	for {
		select {
		case <-stop:
			return nil
		default:
		}
		name := names[rng.IntN(len(names))]
		busy.Store(true)
		if rng.IntN(2) == 0 {
			_, err = cc.Evict(ctx, name)
		} else {
			_, err = cc.Load(ctx, name)
		}
		busy.Store(false)
		// Refused while the grace period keeps segments in doubt, or
		// cut by a kill that the retry found done: neither is lost.
		if err != nil && !errors.Is(err, syscall.EBUSY) && !errors.Is(err, syscall.ENOSPC) {
			return err
		}
		moves.Add(1)
	}
}

// settledMemfds counts pid's segment memfds until the count is want, for
// up to 5 seconds, and returns the last count.
func settledMemfds(t *testing.T, pid, want int) int {
	t.Helper()
	n := -1
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		if n = memfds(t, pid); n == want {
			break
		}
	}
	return n
}

// TestHostReserve: a daemon with --host-reserve makes host memory ahead,
// once it serves, and an eviction takes its memory from it; info and the
// metrics say so.
func TestHostReserve(t *testing.T) {
	// The reserve is made only while available memory stays above twice
	// a sixteenth of host memory (at least 2 GiB) after each piece.
	var si syscall.Sysinfo_t
	syscall.Sysinfo(&si)
	need := 2*max(int64(si.Totalram)*int64(si.Unit)/16, 1<<30) + 64<<20
	if avail := memAvailable(t); avail < need {
		t.Skipf("needs %d bytes of memory available to make a reserve, has %d", need, avail)
	}
	dir := testutil.SocketDir(t)
	sock := filepath.Join(dir, "gpushm.sock")
	addr := freePort(t)
	Start(t, Options{Socket: sock, Args: []string{"--host-reserve", "64M", "--create-pool", "0", "--metrics-listen", addr}})
	t.Setenv("GPUSHM_SOCKET", sock)
	tiers := func() gpushm.Tiers {
		var inf gpushm.Info
		decode(t, mustRun(t, nil, "info", "-o", "json"), &inf)
		if inf.Tiers == nil {
			t.Fatal("info has no tiers")
		}
		return *inf.Tiers
	}
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		tr := tiers()
		if tr.ReserveTarget != 64<<20 {
			t.Fatalf("info: reserve_target_bytes %d, want 64 MiB", tr.ReserveTarget)
		}
		if tr.ReserveBytes == tr.ReserveTarget {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the reserve is not full: %+v", tr)
		}
	}
	src := filepath.Join(dir, "src")
	want := tierPattern(7, 4<<20)
	os.WriteFile(src, want, 0o644)
	mustRun(t, nil, "put", "a", src)
	mustRun(t, nil, "evict", "a")
	if tr := tiers(); tr.ReserveTakes != 1 || tr.Evictions != 1 {
		t.Fatalf("after an eviction of 4 MiB: %+v, want one eviction, which took from the reserve", tr)
	}
	if got := tiersOf(t, sock)["a"]; got != "host" {
		t.Fatalf("a is on tier %q, want host", got)
	}
	if out := mustRun(t, nil, "info"); !strings.Contains(out, "\nreserve:  ") || !strings.Contains(out, "of 64 MiB of host memory made ahead of evictions (--host-reserve); evictions served from it: 1") {
		t.Errorf("info does not say what the reserve did:\n%s", out)
	}
	m := scrape(t, addr)
	for _, w := range []string{"gpushm_host_reserve_target_bytes 6.7108864e+07", "gpushm_host_reserve_takes_total 1"} {
		if !strings.Contains(m, w) {
			t.Errorf("metrics lack %q", w)
		}
	}
	if got := mustRun(t, nil, "cat", "a"); got != string(want) {
		t.Fatal("a's bytes came back other than they were put")
	}
}

// TestHostReserveOnDemand: a segment larger than the reserve's largest
// piece has the daemon make a piece its size, which its eviction takes;
// once it is evicted, the reserve is back to its own size. info says so.
func TestHostReserveOnDemand(t *testing.T) {
	var si syscall.Sysinfo_t
	syscall.Sysinfo(&si)
	need := 2*max(int64(si.Totalram)*int64(si.Unit)/16, 1<<30) + 256<<20
	if avail := memAvailable(t); avail < need {
		t.Skipf("needs %d bytes of memory available to make a reserve, has %d", need, avail)
	}
	sock := filepath.Join(testutil.SocketDir(t), "gpushm.sock")
	// A device budget: evictions, and so the demand, come only under one.
	Start(t, Options{Socket: sock, Args: []string{"--host-reserve", "64M", "--create-pool", "0", "--gpu-budget", "1GiB"}})
	t.Setenv("GPUSHM_SOCKET", sock)
	waitTiers := func(what string, ok func(gpushm.Tiers) bool) gpushm.Tiers {
		t.Helper()
		var tr gpushm.Tiers
		for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(10 * time.Millisecond) {
			var inf gpushm.Info
			decode(t, mustRun(t, nil, "info", "-o", "json"), &inf)
			if tr = *inf.Tiers; ok(tr) {
				return tr
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: %+v", what, tr)
			}
		}
	}
	full := func(target int64) func(gpushm.Tiers) bool {
		return func(tr gpushm.Tiers) bool { return tr.ReserveTarget == target && tr.ReserveBytes == target }
	}
	waitTiers("the reserve of 64 MiB", full(64<<20))
	// 100 MiB: more than the largest piece (50 MiB).
	mustRun(t, nil, "create", "big", "100MiB")
	waitTiers("a piece of 100 MiB on demand", full(164<<20))
	mustRun(t, nil, "evict", "big")
	if tr := waitTiers("the reserve back to 64 MiB", full(64<<20)); tr.ReserveTakes != 1 || tr.Evictions != 1 {
		t.Fatalf("after the eviction of 100 MiB: %+v, want one eviction, which took from the reserve", tr)
	}
	if got := tiersOf(t, sock)["big"]; got != "host" {
		t.Fatalf("big is on tier %q, want host", got)
	}
}

// memAvailable is /proc/meminfo's MemAvailable, in bytes.
func memAvailable(t *testing.T) int64 {
	t.Helper()
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		t.Fatal(err)
	}
	for l := range strings.Lines(string(b)) {
		if v, ok := strings.CutPrefix(l, "MemAvailable:"); ok {
			kb, _ := strconv.ParseInt(strings.Fields(v)[0], 10, 64)
			return kb << 10
		}
	}
	t.Fatal("/proc/meminfo has no MemAvailable")
	return 0
}

func decode(t *testing.T, s string, v any) {
	t.Helper()
	if err := json.Unmarshal([]byte(s), v); err != nil {
		t.Fatalf("%v:\n%s", err, s)
	}
}
