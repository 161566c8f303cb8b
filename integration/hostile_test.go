package integration

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/bench"
	"github.com/gpushm/gpushm/internal/testutil"
	"github.com/gpushm/gpushm/internal/wire"
)

// These tests play a hostile neighbour against a real daemon (a supervisor
// and its serving process): one user's connections by the thousand, while
// another client works, and the serving process's threads, descriptors and
// memory are read from /proc.

// crowdUID is the unprivileged user the idle connections come from, when
// the test runs as root.
const crowdUID = 4245

// idleBaseline waits until the serving process settled (the workers that
// served a burst exit after a second without work) and returns what it
// holds then.
func settled(t *testing.T, pid int) bench.ProcFigures {
	t.Helper()
	time.Sleep(2 * time.Second)
	st, err := bench.ReadProcFigures(pid)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// within10 reports whether got is at most 10% above base, or slack above
// it where that is more.
func within10(got, base int64, slack int64) bool {
	return got <= base+max(base/10, slack)
}

// rssSlack is what the serving process may keep above its idle RSS once a
// crowd has gone, where 10% is less: Go's maps keep the buckets of their largest
// size (the connection tables held 20,000 entries), and the runtime gives
// freed heap back to the system gradually. A leak of even 420 bytes a
// connection, a third of what an idle connection costs, shows above it.
const rssSlack = 8 << 20

// threadSlack is how many threads the serving process may keep above idle
// once a crowd has gone: Go keeps every thread it made, and under load it
// makes one for each goroutine blocked in a system call, such as a send of
// a lease's journal record while the supervisor's socket is full. A thread
// leaked per connection shows far above it.
const threadSlack = 2

// waitBack waits until pid's threads, descriptors and memory are back
// within 10% of base (threadSlack threads, one descriptor, and rssSlack,
// for small figures).
func waitBack(t *testing.T, pid int, base bench.ProcFigures) bench.ProcFigures {
	t.Helper()
	deadline := time.Now().Add(90 * time.Second)
	for {
		st, err := bench.ReadProcFigures(pid)
		if err != nil {
			t.Fatal(err)
		}
		if within10(int64(st.Threads), int64(base.Threads), threadSlack) && within10(int64(st.FDs), int64(base.FDs), 1) &&
			within10(st.RSS, base.RSS, rssSlack) {
			return st
		}
		if time.Now().After(deadline) {
			t.Fatalf("serving process not back to idle within 90s: now %+v, idle %+v", st, base)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// workload is another user's client at work: create, open, map and read,
// unlink, each timed, until stop.
type workload struct {
	mu  sync.Mutex
	rts []time.Duration
	err error
	n   int
}

func (w *workload) run(ctx context.Context, socket string, stop <-chan struct{}) {
	c, err := gpushm.Dial(ctx, socket)
	if err != nil {
		w.err = err
		return
	}
	defer c.Close()
	for i := 0; ; i++ {
		select {
		case <-stop:
			return
		default:
		}
		name := fmt.Sprintf("probe-%d", i)
		var rts [3]time.Duration
		t0 := time.Now()
		_, _, err := c.CreateOnly(ctx, name, 4096, nil)
		rts[0] = time.Since(t0)
		if err == nil {
			t0 = time.Now()
			var seg *gpushm.Segment
			if seg, err = c.Open(ctx, name, nil); err == nil {
				rts[1] = time.Since(t0)
				var m *gpushm.Mapping
				if m, err = seg.Map(); err == nil {
					_, err = m.ReadAt(make([]byte, 1), 0)
				}
				seg.Close()
			}
		}
		if err == nil {
			t0 = time.Now()
			err = c.Unlink(ctx, name)
			rts[2] = time.Since(t0)
		}
		w.mu.Lock()
		w.rts = append(w.rts, rts[:]...)
		w.n++
		if err != nil && w.err == nil {
			w.err = err
		}
		w.mu.Unlock()
		if err != nil {
			return
		}
	}
}

// take returns the round trips so far and starts a new list.
func (w *workload) take() (bench.Dist, int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	ns := make([]int64, len(w.rts))
	for i, d := range w.rts {
		ns[i] = d.Nanoseconds()
	}
	w.rts = nil
	return bench.Summarize(ns), len(ns), w.err
}

// startWorkload runs a workload until the test ends.
func startWorkload(t *testing.T, socket string) *workload {
	w := &workload{}
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		w.run(context.Background(), socket, stop)
	}()
	t.Cleanup(func() {
		close(stop)
		<-done
	})
	return w
}

// checkRoundTrips logs the workload's round trips since the last call and
// fails on an error or on a p99 far beyond what an idle machine shows.
// The figure is 5 ms; a loaded CI machine misses that without any
// fault of the daemon's, so the bound asserted is loose.
func checkRoundTrips(t *testing.T, w *workload, phase string) {
	t.Helper()
	d, n, err := w.take()
	if err != nil {
		t.Fatalf("%s: the other user's client failed: %v", phase, err)
	}
	if n == 0 {
		t.Fatalf("%s: the other user's client made no round trip", phase)
	}
	t.Logf("%s: other user's create/open/unlink round trips: %d, p50 %v, p99 %v (target p99 < 5ms)", phase, n, d.P50, d.P99)
	if d.P99 > 250*time.Millisecond {
		t.Errorf("%s: round trip p99 %v, want well under 250ms", phase, d.P99)
	}
}

// noConnLimits are the daemon flags that lift its connection limits.
var noConnLimits = []string{"--user-connections", "0", "--max-connections", "0"}

// maxThreads bounds the serving process's threads under any number of idle
// connections: its own handful, plus the workers (at most 64).
const maxThreads = 96

func TestHostileIdleConnections(t *testing.T) {
	n := 20000
	if testing.Short() {
		n = 2000
	}
	// The serving process needs a few dozen descriptors of its own.
	const spare = 128
	if got, _ := bench.RaiseNofile(uint64(n) + spare); got < uint64(n)+spare {
		// A hard limit below what the test wants, which this process may
		// not raise: as many as the limit allows.
		n = int(got) - spare
		if n < 1000 {
			t.Skipf("descriptor limit %d: too low to hold 1000 idle connections (raise 'ulimit -n' or run as root)", got)
		}
		t.Logf("descriptor limit %d: %d idle connections", got, n)
	}
	uid := -1
	if os.Geteuid() == 0 {
		uid = crowdUID
	}
	dir := testutil.SocketDir(t)
	os.Chmod(dir, 0o755) // the crowd's user connects
	sock := filepath.Join(dir, "gpushm.sock")
	// The per-user and daemon connection limits would turn most of the
	// crowd away (TestHostileNeighbour tests them): off here.
	d := Start(t, Options{Socket: sock, Args: noConnLimits})
	inf, err := d.info()
	if err != nil {
		t.Fatal(err)
	}
	pid := inf.PID

	w := startWorkload(t, sock)
	time.Sleep(500 * time.Millisecond) // warm up
	idle := settled(t, pid)
	checkRoundTrips(t, w, "no idle connections")
	t.Logf("serving process without idle connections: %+v", idle)

	var cr *bench.IdleCrowd
	peak, err := bench.PeakThreads(pid, func() error {
		var err error
		cr, err = bench.StartIdleCrowdFrom(context.Background(), gpushmBin, sock, n, uid)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cr.Close() })
	checkRoundTrips(t, w, fmt.Sprintf("while %d connections were opened", n))
	full := settled(t, pid)
	checkRoundTrips(t, w, fmt.Sprintf("with %d idle connections", n))
	perConn := float64(full.RSS-idle.RSS) / float64(n)
	t.Logf("serving process with %d idle connections: %+v; %d threads at most while they were opened; %.0f bytes of RSS a connection",
		n, full, peak, perConn)
	if full.FDs < n {
		t.Fatalf("serving process holds %d descriptors, want at least %d: the connections are not there", full.FDs, n)
	}
	if peak > maxThreads || full.Threads > maxThreads {
		t.Errorf("serving process threads: %d at most while connecting, %d idle; want at most %d", peak, full.Threads, maxThreads)
	}
	if perConn > 16<<10 {
		t.Errorf("%.0f bytes of RSS an idle connection, want at most 16 KiB", perConn)
	}
	if _, err := d.info(); err != nil {
		t.Fatalf("daemon does not answer with %d idle connections: %v", n, err)
	}

	if err := cr.Close(); err != nil {
		t.Fatalf("idle connections: %v", err)
	}
	back := waitBack(t, pid, idle)
	t.Logf("serving process after they closed: %+v", back)
	checkRoundTrips(t, w, "after they closed")
	if after, err := d.info(); err != nil || after.PID != pid {
		t.Fatalf("serving process %d gone (now %v, %v)", pid, after, err)
	}
}

func TestHostileConnectChurn(t *testing.T) {
	const (
		rate = 1000 // cycles a second
		span = 10 * time.Second
	)
	dir := testutil.SocketDir(t)
	sock := filepath.Join(dir, "gpushm.sock")
	d := Start(t, Options{Socket: sock})
	inf, err := d.info()
	if err != nil {
		t.Fatal(err)
	}
	pid := inf.PID
	w := startWorkload(t, sock)
	time.Sleep(500 * time.Millisecond)
	idle := settled(t, pid)
	checkRoundTrips(t, w, "before")

	hello, err := wire.Encode(&wire.Request{ID: 1, Op: wire.OpHello, Version: wire.Version})
	if err != nil {
		t.Fatal(err)
	}
	// cycle connects, says hello every other time (taking the epoch page's
	// descriptor), and hangs up.
	cycle := func(i int) error {
		c, err := wire.Dial(sock)
		if err != nil {
			return err
		}
		defer c.Close()
		if i%2 == 1 {
			return nil
		}
		if err := c.Send(hello, -1); err != nil {
			return err
		}
		_, fd, err := c.Recv()
		if fd >= 0 {
			unix.Close(fd)
		}
		return err
	}
	cycles := 0
	peak, err := bench.PeakThreads(pid, func() error {
		start := time.Now()
		for {
			el := time.Since(start)
			if el >= span {
				return nil
			}
			due := int(el.Seconds() * rate)
			if cycles >= due {
				time.Sleep(time.Millisecond)
				continue
			}
			if err := cycle(cycles); err != nil {
				return fmt.Errorf("cycle %d: %w", cycles, err)
			}
			cycles++
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%d connect/disconnect cycles in %v (%.0f a second); serving process threads at most %d", cycles, span, float64(cycles)/span.Seconds(), peak)
	if cycles < int(span.Seconds()*rate)/2 {
		t.Errorf("%d cycles: the daemon did not keep up with half of %d a second", cycles, rate)
	}
	if peak > maxThreads {
		t.Errorf("serving process threads: %d at most, want at most %d", peak, maxThreads)
	}
	checkRoundTrips(t, w, "during the churn")
	back := waitBack(t, pid, idle)
	t.Logf("serving process: idle %+v, after the churn %+v", idle, back)
	if after, err := d.info(); err != nil || after.PID != pid {
		t.Fatalf("serving process %d gone (now %v, %v)", pid, after, err)
	}
}

// rawAsk sends msg on c and returns the reply, closing any descriptor that
// came with it.
func rawAsk(c *wire.Conn, msg string) (*wire.Reply, error) {
	if err := c.Send([]byte(msg), -1); err != nil {
		return nil, err
	}
	b, fd, err := c.Recv()
	if fd >= 0 {
		unix.Close(fd)
	}
	if err != nil {
		return nil, err
	}
	rep, err := wire.DecodeReply(b)
	if err == nil && rep.Error != nil {
		err = rep.Error
	}
	return rep, err
}

// An upgrade hands over idle connections, which wait in the serving
// process's epoll set rather than in a thread: each is served by the new
// process on the same socket, with the segments bound to it.
func TestSurviveUpgradeIdleConnections(t *testing.T) {
	const n, bound = 500, 20
	dir := testutil.SocketDir(t)
	sock := filepath.Join(dir, "gpushm.sock")
	d := Start(t, Options{Socket: sock})
	before, err := d.info()
	if err != nil {
		t.Fatal(err)
	}
	conns := make([]*wire.Conn, n)
	for k := range conns {
		c, err := wire.Dial(sock)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		conns[k] = c
		if _, err := rawAsk(c, `{"id":1,"op":"hello","version":1}`); err != nil {
			t.Fatalf("connection %d: hello: %v", k, err)
		}
		if k < bound {
			msg := fmt.Sprintf(`{"id":2,"op":"create","name":"idle-%d","size":4096,"lifetime":"connection"}`, k)
			if _, err := rawAsk(c, msg); err != nil {
				t.Fatalf("connection %d: create: %v", k, err)
			}
		}
	}
	time.Sleep(100 * time.Millisecond) // every connection idle by now
	d.cmd.Process.Signal(syscall.SIGHUP)
	after := d.waitServing(t, before.PID)
	for k, c := range conns {
		rep, err := rawAsk(c, `{"id":3,"op":"info"}`)
		if err != nil {
			t.Fatalf("connection %d after the upgrade: %v", k, err)
		}
		if rep.PID != after.PID {
			t.Fatalf("connection %d served by %d, want the new serving process %d", k, rep.PID, after.PID)
		}
	}
	// Their segments went over with them, and end with them.
	bounds := func() int {
		n := 0
		for _, name := range listAtQuiet(sock) {
			if strings.HasPrefix(name, "idle-") {
				n++
			}
		}
		return n
	}
	if got := bounds(); got != bound {
		t.Fatalf("%d creator-bound segments after the upgrade, want %d", got, bound)
	}
	for k := range bound {
		conns[k].Close()
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		left := bounds()
		if left == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d creator-bound segments left 30s after their connections closed", left)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
