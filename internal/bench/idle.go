package bench

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/bytesize"
	"github.com/gpushm/gpushm/internal/wire"
)

func benchIdleCmd() *cobra.Command {
	var (
		backend string
		counts  string
		iters   int
		settle  time.Duration
	)
	cmd := &cobra.Command{
		Use:   "idle",
		Short: "Threads, memory and an active client's round trip under many idle connections",
		Long: `On a private daemon, open idle connections from a second process (half of
them say hello, half say nothing), step by step up to each count, and
print for the serving process at each step:

  threads     OS threads (/proc/PID/status), after the connections settled
              (--settle: the workers that served a burst retire after a
              second); peak: the most seen while they were being opened
  fds, RSS    its descriptors and resident memory; RSS/conn: the growth
              over the step without idle connections, per connection
  round trip  p50 and p99 of --iters stat requests by one active client
  after idle  p50 and p99 of stat requests sent 10 ms apart: the
              client's connection is idle each time it asks
  echo        the same, to a bare echo server in a process of its own (a
              thread in a blocking recvmsg, as 'bench open' runs it),
              taking turns with the stat requests: what a round trip
              after 10 ms of quiet costs on this machine with no daemon

The daemon runs with its connection limits off (--user-connections 0
--max-connections 0). It needs a descriptor limit above the largest count,
which it inherits from this process: the soft limit is raised to the hard
one, and as root the hard one too.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			var list []int
			for _, f := range strings.Split(counts, ",") {
				n, err := strconv.Atoi(strings.TrimSpace(f))
				if err != nil || n < 0 {
					return fmt.Errorf("--counts: %q is not a count", f)
				}
				if len(list) > 0 && n < list[len(list)-1] {
					return fmt.Errorf("--counts %s: want increasing counts", counts)
				}
				list = append(list, n)
			}
			if iters < 1 {
				return fmt.Errorf("--iters %d: want at least 1", iters)
			}
			if settle < 0 {
				return fmt.Errorf("--settle %s: want 0 or more", settle)
			}
			return runBenchIdle(cmd.Context(), backend, list, iters, settle)
		},
	}
	cmd.Flags().StringVar(&backend, "backend", "auto", "backend: auto, cuda or host")
	cmd.Flags().StringVar(&counts, "counts", "0,1000,10000,20000", "comma-separated numbers of idle connections, increasing")
	cmd.Flags().IntVar(&iters, "iters", 2000, "round trips timed at each count")
	cmd.Flags().DurationVar(&settle, "settle", 2*time.Second, "how long the daemon may settle before each count's round trips, and again before its figures")
	return cmd
}

func runBenchIdle(ctx context.Context, backend string, counts []int, iters int, settle time.Duration) error {
	counts, err := fitCounts(counts)
	if err != nil {
		return err
	}
	return withPrivateDaemon(ctx, backend, func(d *privateDaemon, c *gpushm.Client) error {
		inf, err := c.Info(ctx)
		if err != nil {
			return err
		}
		pid := inf.PID
		room, why, err := daemonRoom(pid)
		if err != nil {
			return err
		}
		if room < 1 {
			return fmt.Errorf("no room for idle connections: %s", why)
		}
		counts = fitTo(counts, room, why)
		const probe = "bench-idle"
		if _, _, err := c.CreateOnly(ctx, probe, 4096, nil); err != nil {
			return err
		}
		defer c.Unlink(ctx, probe)
		echo, err := startEcho(ctx, d.dir, "blocking")
		if err != nil {
			return err
		}
		defer echo.stop()
		ec, err := dialEcho(echo.socket, gpushm.ClientSpin())
		if err != nil {
			return err
		}
		defer ec.c.Close()
		stat := func() (time.Duration, error) {
			t := time.Now()
			_, err := c.Stat(ctx, probe)
			return time.Since(t), err
		}
		type row struct {
			count        int
			peak         int
			st           ProcFigures
			rt, rtIdle   Dist
			echoIdle     Dist
			rssPerConnKB float64
		}
		var rows []row
		var crowds []*IdleCrowd
		defer func() {
			for _, cr := range crowds {
				cr.Close()
			}
		}()
		have := 0
		for _, n := range counts {
			r := row{count: n}
			var err error
			r.peak, err = PeakThreads(pid, func() error {
				if n == have {
					return nil
				}
				cr, err := StartIdleCrowd(ctx, d.socket, n-have, -1)
				if err != nil {
					return err
				}
				crowds = append(crowds, cr)
				return nil
			})
			if err != nil {
				return err
			}
			have = n
			// Let the workers that served the new connections go.
			time.Sleep(settle)
			if r.rt, r.rtIdle, r.echoIdle, err = roundTrips(stat, ec, iters); err != nil {
				return err
			}
			time.Sleep(settle)
			if r.st, err = ReadProcFigures(pid); err != nil {
				return err
			}
			if n > 0 && len(rows) > 0 && rows[0].count == 0 {
				r.rssPerConnKB = float64(r.st.RSS-rows[0].st.RSS) / float64(n) / 1024
			}
			rows = append(rows, r)
		}
		fmt.Printf("gpushm bench idle: backend %s, serving process %d, %d round trips (stat) each, %d idle-client samples, %s\n\n",
			c.Backend(), pid, iters, min(iters, 100), time.Now().UTC().Format("2006-01-02"))
		w := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(w, "idle conns\tthreads\tpeak\tfds\tRSS\tRSS/conn\tround trip p50\tp99\tafter idle p50\tp99\techo after idle p50\tp99\t")
		for _, r := range rows {
			perConn := "-"
			if r.count > 0 && len(rows) > 0 && rows[0].count == 0 {
				perConn = fmt.Sprintf("%.1f KiB", r.rssPerConnKB)
			}
			fmt.Fprintf(w, "%d\t%d\t%d\t%d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t\n", r.count, r.st.Threads, r.peak, r.st.FDs,
				bytesize.Format(r.st.RSS), perConn, fmtDur(r.rt.P50), fmtDur(r.rt.P99), fmtDur(r.rtIdle.P50), fmtDur(r.rtIdle.P99),
				fmtDur(r.echoIdle.P50), fmtDur(r.echoIdle.P99))
		}
		return w.Flush()
		// The connection limits would turn most of the connections away.
	}, "--user-connections", "0", "--max-connections", "0")
}

// roundTrips times iters stat requests back to back, then up to 100 of
// them 10 ms apart, each followed 10 ms later by a round trip to the echo
// server: busy, after idle, and the echo server after the same quiet.
func roundTrips(stat func() (time.Duration, error), ec *echoClient, iters int) (busy, idle, echo Dist, err error) {
	var ns, idleNS, echoNS []int64
	for i := range iters + 50 {
		dt, err := stat()
		if err != nil {
			return busy, idle, echo, err
		}
		if i >= 50 { // warm-up
			ns = append(ns, dt.Nanoseconds())
		}
	}
	for range min(iters, 100) {
		time.Sleep(10 * time.Millisecond)
		dt, err := stat()
		if err != nil {
			return busy, idle, echo, err
		}
		idleNS = append(idleNS, dt.Nanoseconds())
		time.Sleep(10 * time.Millisecond)
		if dt, err = ec.roundTrip(); err != nil {
			return busy, idle, echo, fmt.Errorf("echo server: %w", err)
		}
		echoNS = append(echoNS, dt.Nanoseconds())
	}
	return Summarize(ns), Summarize(idleNS), Summarize(echoNS), nil
}

// ProcFigures are what a process holds, from /proc.
type ProcFigures struct {
	Threads int
	FDs     int
	RSS     int64 // bytes
}

func ReadProcFigures(pid int) (ProcFigures, error) {
	var st ProcFigures
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return st, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		k, v, _ := strings.Cut(line, ":")
		f := strings.Fields(v)
		if len(f) == 0 {
			continue
		}
		switch k {
		case "Threads":
			st.Threads, _ = strconv.Atoi(f[0])
		case "VmRSS":
			kb, _ := strconv.ParseInt(f[0], 10, 64)
			st.RSS = kb << 10
		}
	}
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		return st, err
	}
	st.FDs = len(ents)
	return st, nil
}

// PeakThreads runs fn while sampling pid's thread count, and returns the
// most it saw.
func PeakThreads(pid int, fn func() error) (int, error) {
	var mu sync.Mutex
	peak := 0
	sample := func() {
		if st, err := ReadProcFigures(pid); err == nil {
			mu.Lock()
			peak = max(peak, st.Threads)
			mu.Unlock()
		}
	}
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTicker(5 * time.Millisecond)
		defer t.Stop()
		for {
			sample()
			select {
			case <-done:
				return
			case <-t.C:
			}
		}
	}()
	err := fn()
	close(done)
	wg.Wait()
	sample()
	return peak, err
}

// IdleCrowd is a process holding idle connections to a daemon
// ('__child idle').
type IdleCrowd struct {
	cmd     *exec.Cmd
	stdin   io.WriteCloser
	out     *bufio.Reader
	done    chan error
	once    sync.Once
	exitErr error
}

type idleReady struct {
	Opened int
}

// StartIdleCrowd starts a process that opens n connections to socket (as
// uid, when it is not -1) and holds them idle until close, and waits until
// it opened them. The process is this binary again.
func StartIdleCrowd(ctx context.Context, socket string, n, uid int) (*IdleCrowd, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	return StartIdleCrowdFrom(ctx, self, socket, n, uid)
}

// StartIdleCrowdFrom is StartIdleCrowd with the process a run of the gpushm
// binary exe (its hidden __child command), for a caller that is not one:
// a test.
func StartIdleCrowdFrom(ctx context.Context, exe, socket string, n, uid int) (*IdleCrowd, error) {
	cmd := exec.CommandContext(ctx, exe, "__child", "idle", "--socket", socket, "--count", strconv.Itoa(n), "--uid", strconv.Itoa(uid))
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start idle connections: %w", err)
	}
	cr := &IdleCrowd{cmd: cmd, stdin: stdin, out: bufio.NewReader(stdout), done: make(chan error, 1)}
	line, err := cr.out.ReadBytes('\n')
	var r idleReady
	if err == nil {
		err = json.Unmarshal(line, &r)
	}
	if err == nil && r.Opened != n {
		err = fmt.Errorf("opened %d of %d", r.Opened, n)
	}
	go func() { cr.done <- cmd.Wait() }()
	if err != nil {
		cr.Close()
		return nil, fmt.Errorf("idle connections: %w", err)
	}
	return cr, nil
}

// close makes the process close its connections and exit, and waits for
// it; later calls return the first one's result.
func (cr *IdleCrowd) Close() error {
	cr.once.Do(func() {
		cr.stdin.Close()
		select {
		case cr.exitErr = <-cr.done:
		case <-time.After(60 * time.Second):
			cr.cmd.Process.Kill()
			cr.exitErr = fmt.Errorf("idle connections: no exit within 60s: %w", <-cr.done)
		}
	})
	return cr.exitErr
}

func idleChildCmd() *cobra.Command {
	var count, uid int
	cmd := &cobra.Command{
		Use: "idle",
		RunE: func(cmd *cobra.Command, args []string) error {
			if uid >= 0 {
				// Drop to another user: idle connections of an
				// unprivileged neighbour. The limits stay as inherited.
				if err := dropTo(uid); err != nil {
					return err
				}
			}
			conns, err := openIdle(socketOf(cmd), count)
			defer func() {
				for _, c := range conns {
					c.Close()
				}
			}()
			if err != nil {
				return err
			}
			if err := emit(idleReady{Opened: len(conns)}); err != nil {
				return err
			}
			// Hold them until the parent closes stdin.
			io.Copy(io.Discard, os.Stdin)
			return nil
		},
	}
	cmd.Flags().IntVar(&count, "count", 0, "connections to hold")
	cmd.Flags().IntVar(&uid, "uid", -1, "run as this user (and group) id")
	return cmd
}

func dropTo(id int) error {
	if err := unix.Setgroups(nil); err != nil {
		return err
	}
	if err := unix.Setresgid(id, id, id); err != nil {
		return err
	}
	return unix.Setresuid(id, id, id)
}

// openIdle opens n connections to socket; every other one says hello (and
// closes the epoch page's descriptor the reply brings), the rest say
// nothing.
func openIdle(socket string, n int) ([]*wire.Conn, error) {
	hello, err := wire.Encode(&wire.Request{ID: 1, Op: wire.OpHello, Version: wire.Version})
	if err != nil {
		return nil, err
	}
	conns := make([]*wire.Conn, 0, n)
	for i := range n {
		c, err := wire.Dial(socket)
		if err != nil {
			return conns, fmt.Errorf("connection %d: %w", i, err)
		}
		conns = append(conns, c)
		if i%2 == 1 {
			continue
		}
		if err := c.Send(hello, -1); err != nil {
			return conns, fmt.Errorf("connection %d: hello: %w", i, err)
		}
		b, fd, err := c.Recv()
		if fd >= 0 {
			unix.Close(fd)
		}
		if err == nil {
			var rep *wire.Reply
			if rep, err = wire.DecodeReply(b); err == nil && rep.Error != nil {
				err = rep.Error
			}
		}
		if err != nil {
			return conns, fmt.Errorf("connection %d: hello: %w", i, err)
		}
		c.ReleaseBuffer()
	}
	return conns, nil
}

// idleSpare is what the daemon needs besides its connections' descriptors,
// before it serves; daemonSpare what it may open while it serves (an
// eventfd for each of up to 64 workers, and some slack), beyond what it
// holds once it serves (on cuda, the driver's own descriptors: more than
// idleSpare on an H200 machine, whose daemon ran out at 19,871
// connections of a crowd fitted to 19,872).
const (
	idleSpare   = 128
	daemonSpare = 128
)

// fitCounts scales the crowd to the descriptor limit this machine allows:
// counts above it become the most it can hold, said on stderr, rather than
// failing the run (a machine whose hard limit is 20,000 cannot hold 20,000
// connections and the daemon's own descriptors).
func fitCounts(counts []int) ([]int, error) {
	need := uint64(counts[len(counts)-1]) + idleSpare
	got, err := RaiseNofile(need)
	if got >= need {
		return counts, nil
	}
	most := int(got) - idleSpare
	if most < 1 {
		return nil, fmt.Errorf("a descriptor limit of %d leaves no room for idle connections (%v): raise the hard limit ('ulimit -Hn') or run as root", got, err)
	}
	return fitTo(counts, most, fmt.Sprintf("this machine allows %d descriptors", got)), nil
}

// fitTo caps counts at most, saying why on stderr for each it lowers.
func fitTo(counts []int, most int, why string) []int {
	var out []int
	for _, n := range counts {
		if n > most {
			fmt.Fprintf(os.Stderr, "bench idle: %d idle connections do not fit (%s): measuring %d instead\n", n, why, most)
			n = most
		}
		if len(out) == 0 || n > out[len(out)-1] {
			out = append(out, n)
		}
	}
	return out
}

// daemonRoom is how many more connections the serving process pid can
// hold: its descriptor limit, less what it holds now and daemonSpare.
func daemonRoom(pid int) (room int, why string, err error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/limits", pid))
	if err != nil {
		return 0, "", err
	}
	limit := -1
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "Max open files"); ok {
			if f := strings.Fields(rest); len(f) > 0 {
				limit, _ = strconv.Atoi(f[0]) // "unlimited" stays -1
			}
		}
	}
	st, err := ReadProcFigures(pid)
	if err != nil {
		return 0, "", err
	}
	if limit < 0 {
		return math.MaxInt, "", nil
	}
	return limit - st.FDs - daemonSpare, fmt.Sprintf("the serving process may hold %d descriptors and holds %d", limit, st.FDs), nil
}
