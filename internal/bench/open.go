package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/bytesize"
)

// Command is "gpushm bench": the benchmarks that print tables.
func Command() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "Benchmarks that print tables",
	}
	cmd.AddCommand(benchOpenCmd(), benchPeerCmd(), benchIdleCmd(), benchFilesCmd(), benchChannelCmd(), benchPullCmd())
	return cmd
}

// parseSizes reads a bench's --sizes and checks its count flag (--iters,
// --reps), which needs at least 1.
func parseSizes(sizes, flag string, n int) ([]int64, error) {
	if n < 1 {
		return nil, fmt.Errorf("%s %d: want at least 1", flag, n)
	}
	return bytesize.ParseList(sizes)
}

func benchOpenCmd() *cobra.Command {
	var (
		backend string
		sizes   string
		iters   int
		pool    string
	)
	cmd := &cobra.Command{
		Use:   "open",
		Short: "Time create, open-to-mapped in a second process, and reopen, against the raw floor",
		Long: `For each size, on a private daemon:

  floor    a second process imports an exported handle it inherited and maps
           it, with no daemon: cuMemImportFromShareableHandle +
           cuMemAddressReserve + cuMemMap + cuMemSetAccess on cuda, mmap on host
  open     the same second process opens the segment by name through the
           daemon and maps it (round trip, SCM_RIGHTS, import, map, set
           access); floor and open samples alternate, so both see the same
           machine
  reopen   the same, while that process already holds the segment mapped
  echo     the same process, in turn with its opens, round trips to three
           bare echo servers, each in a process of its own, that answer
           with an open's reply and a descriptor: blocking (a thread in
           recvmsg), net (Go's network poller) and poll (a daemon
           worker's wait: ppoll on the socket and an eventfd, then
           recvmsg); the open's round trip is given as a multiple of each
  create   create a segment through the daemon (allocate + export), back
           to back, then again one every few milliseconds (paced), when
           each finds its size made ahead (daemon --create-pool); beside
           them, the steps of an allocation made while a create waits,
           timed in this process: cuMemCreate and the export on cuda,
           memfd and fallocate on host

Each row reports p50 and p99 over --iters samples, and open's p50 as a
multiple of the floor's p50 measured in the same run. The daemon times
the steps of every create and open it answers (the protocol's "trace"),
and two tables split them: what the daemon spent, step by step, and what
is left of the client's time for the socket and the client. At the end it says
whether any process of the private daemon outlived it, and the memory in
use against its start.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			list, err := parseSizes(sizes, "--iters", iters)
			if err != nil {
				return err
			}
			var daemonArgs []string
			if pool != "" {
				daemonArgs = []string{"--create-pool", pool}
			}
			return runBenchOpen(cmd.Context(), backend, list, iters, daemonArgs)
		},
	}
	cmd.Flags().StringVar(&backend, "backend", "auto", "backend: auto, cuda or host")
	cmd.Flags().StringVar(&sizes, "sizes", "2MiB,64MiB,1GiB", "comma-separated segment sizes")
	cmd.Flags().IntVar(&iters, "iters", 200, "samples per measurement")
	cmd.Flags().StringVar(&pool, "create-pool", "", "the private daemon's --create-pool (default: its default; 0 times creates that allocate)")
	return cmd
}

type Dist struct{ P50, P99 time.Duration }

func Summarize(ns []int64) Dist {
	s := slices.Clone(ns)
	slices.Sort(s)
	if len(s) == 0 {
		return Dist{}
	}
	i99 := (len(s)*99+99)/100 - 1
	return Dist{time.Duration(s[len(s)/2]), time.Duration(s[min(i99, len(s)-1)])}
}

func runBenchOpen(ctx context.Context, backend string, sizes []int64, iters int, daemonArgs []string) error {
	return withPrivateDaemon(ctx, backend, func(d *privateDaemon, c *gpushm.Client) error {
		return benchOpen(ctx, d, c, sizes, iters)
	}, daemonArgs...)
}

// createSamples are creates' timings, the client's and the daemon's own
// (its trace), sample by sample.
type createSamples struct {
	ns     []int64            // the client's: request to reply
	daemon []int64            // the daemon's: request read to reply ready
	steps  map[string][]int64 // each step; alloc and alloc-pool both count as alloc
	order  []string           // the steps, in the order the daemon reported them
	pooled int                // creates served by allocations made ahead
}

func (s *createSamples) add(total time.Duration, tr *gpushm.Trace) {
	if s.steps == nil {
		s.steps = map[string][]int64{}
	}
	s.ns = append(s.ns, total.Nanoseconds())
	s.daemon = append(s.daemon, tr.TotalNS)
	for _, st := range tr.Steps {
		name := st.Step
		if name == "alloc-pool" {
			name = "alloc"
			s.pooled++
		}
		if _, ok := s.steps[name]; !ok {
			s.order = append(s.order, name)
		}
		s.steps[name] = append(s.steps[name], st.NS)
	}
}

// rest is what the daemon's trace does not cover, sample by sample: the
// socket both ways, encoding the reply, and the client.
func rest(ns, daemon []int64) []int64 {
	out := make([]int64, len(ns))
	for i := range out {
		out[i] = ns[i] - daemon[i]
	}
	return out
}

// openRow is one size's figures in bench open.
type openRow struct {
	size                        int64
	floor, open, reopen, create Dist
	roundTrip                   Dist
	paced                       Dist // creates one per pace
	pace                        time.Duration
	alloc, commit, free         Dist // createSteps
	b2bSteps, pacedSteps        createSamples
	openDaemon                  Dist
	openSteps                   map[string]Dist
	echo                        map[string]Dist
}

func benchOpen(ctx context.Context, d *privateDaemon, c *gpushm.Client, sizes []int64, iters int) error {
	inf, err := c.Info(ctx)
	if err != nil {
		return err
	}
	dev := inf.Devices[0]
	var echoArgs []string
	for _, mode := range echoModes {
		e, err := startEcho(ctx, d.dir, mode)
		if err != nil {
			return err
		}
		defer e.stop()
		echoArgs = append(echoArgs, "--echo", mode+"="+e.socket)
	}
	var rows []openRow
	for _, size := range sizes {
		r := openRow{size: size}
		if err := measureCreates(ctx, c, dev, iters, &r); err != nil {
			return err
		}
		if err := measureOpens(ctx, d, c, dev, iters, echoArgs, &r); err != nil {
			return err
		}
		rows = append(rows, r)
	}
	fmt.Printf("gpushm bench open: backend %s, device %d %q, %d samples each, %s\n\n",
		c.Backend(), dev.Index, dev.Name, iters, time.Now().UTC().Format("2006-01-02"))
	for _, table := range []func(string, []openRow) error{openTable, createSplitTable, createStepsTable, openSplitTable, echoTable} {
		if err := table(c.Backend(), rows); err != nil {
			return err
		}
	}
	return nil
}

// measureCreates times r.size's creates, back to back and paced, and the
// steps of an allocation in this process.
func measureCreates(ctx context.Context, c *gpushm.Client, dev gpushm.Device, iters int, r *openRow) (err error) {
	size := r.size
	r.alloc, r.commit, r.free, err = createSteps(c.Backend(), dev, size, min(iters, 50))
	if err != nil {
		return fmt.Errorf("create steps: %w", err)
	}
	// Back to back, creates come faster than the pool makes
	// allocations ahead; paced, each finds one ready, as a service
	// creating a segment per request would.
	pace := 4*(r.alloc.P50+r.commit.P50+r.free.P50) + time.Millisecond
	for _, paced := range []bool{false, true} {
		var cs createSamples
		for i := range iters {
			if paced {
				time.Sleep(pace)
			}
			name := fmt.Sprintf("bench-create-%d", i)
			var tr gpushm.Trace
			t := time.Now()
			if _, _, err := c.CreateOnly(ctx, name, size, &gpushm.CreateOptions{Trace: &tr}); err != nil {
				return err
			}
			cs.add(time.Since(t), &tr)
			if err := c.Unlink(ctx, name); err != nil {
				return err
			}
		}
		if paced {
			r.paced, r.pace, r.pacedSteps = Summarize(cs.ns), pace, cs
		} else {
			r.create, r.b2bSteps = Summarize(cs.ns), cs
		}
	}
	return nil
}

// measureOpens times opens and reopens of r.size in a second process,
// against the floor (the driver's own import and map) and echo servers.
func measureOpens(ctx context.Context, d *privateDaemon, c *gpushm.Client, dev gpushm.Device, iters int, echoArgs []string, r *openRow) error {
	size := r.size
	seg, err := c.Create(ctx, "bench", size, nil)
	if err != nil {
		return err
	}
	f, spec, release, err := exportFloor(c.Backend(), dev, size)
	if err != nil {
		seg.Close()
		return fmt.Errorf("floor: %w", err)
	}
	s, err := runChild(ctx, []*os.File{f}, append([]string{"open", "--socket", d.socket, "--name", "bench",
		"--iters", fmt.Sprint(iters), "--floor-handle", spec.handle,
		"--floor-device", fmt.Sprint(spec.device), "--floor-size", fmt.Sprint(spec.size)}, echoArgs...)...)
	f.Close()
	release()
	if err == nil {
		r.open, r.roundTrip, r.floor = Summarize(s.NS), Summarize(s.RoundTripNS), Summarize(s.FloorNS)
		r.openDaemon, r.openSteps, r.echo = Summarize(s.DaemonNS), map[string]Dist{}, map[string]Dist{}
		for mode, ns := range s.EchoNS {
			r.echo[mode] = Summarize(ns)
		}
		for name, ns := range s.StepNS {
			r.openSteps[name] = Summarize(ns)
		}
		s, err = runChild(ctx, nil, "open", "--socket", d.socket, "--name", "bench", "--iters", fmt.Sprint(iters), "--reopen")
		r.reopen = Summarize(s.NS)
	}
	seg.Close()
	if uerr := c.Unlink(ctx, "bench"); err == nil {
		err = uerr
	}
	return err
}

func openTable(_ string, rows []openRow) error {
	w := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "size\tfloor p50\tfloor p99\topen p50\topen p99\topen/floor\treopen p50\treopen p99\tcreate p50\tcreate p99\t")
	for _, r := range rows {
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%.3fx\t%s\t%s\t%s\t%s\t\n", bytesize.Format(r.size),
			fmtDur(r.floor.P50), fmtDur(r.floor.P99), fmtDur(r.open.P50), fmtDur(r.open.P99),
			float64(r.open.P50)/float64(r.floor.P50),
			fmtDur(r.reopen.P50), fmtDur(r.reopen.P99), fmtDur(r.create.P50), fmtDur(r.create.P99))
	}
	return w.Flush()
}

func createSplitTable(backend string, rows []openRow) error {
	fmt.Printf("\ncreate, split: the daemon's create back to back and one per pace (each finding its size made ahead, --create-pool), and the steps of an allocation made while a create waits, timed in this process\n\n")
	w := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', tabwriter.AlignRight)
	alloc, commit := "memfd p50", "fallocate p50"
	if backend == "cuda" {
		alloc, commit = "cuMemCreate p50", "export p50"
	}
	fmt.Fprintf(w, "size\tcreate p50\tpace\tpaced p50\tpaced p99\t%s\t%s\tfree p50\t\n", alloc, commit)
	for _, r := range rows {
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t\n", bytesize.Format(r.size), fmtDur(r.create.P50), fmtDur(r.pace),
			fmtDur(r.paced.P50), fmtDur(r.paced.P99), fmtDur(r.alloc.P50), fmtDur(r.commit.P50), fmtDur(r.free.P50))
	}
	return w.Flush()
}

func createStepsTable(_ string, rows []openRow) error {
	fmt.Printf("\ncreate, the daemon's steps (its trace; p50 of each, which need not add up): from the pool is how many\n" +
		"creates took an allocation made ahead; socket+client is the client's time less the daemon's, sample by sample\n\n")
	w := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', tabwriter.AlignRight)
	var order []string
	for _, r := range rows {
		for _, name := range append(slices.Clone(r.b2bSteps.order), r.pacedSteps.order...) {
			if !slices.Contains(order, name) {
				order = append(order, name)
			}
		}
	}
	fmt.Fprint(w, "size\tcreates\tfrom the pool\tclient p50\tdaemon p50\t")
	for _, name := range order {
		fmt.Fprintf(w, "%s\t", name)
	}
	fmt.Fprintln(w, "socket+client\t")
	for _, r := range rows {
		for _, m := range []struct {
			what string
			s    createSamples
		}{{"back to back", r.b2bSteps}, {"paced", r.pacedSteps}} {
			fmt.Fprintf(w, "%s\t%s\t%d/%d\t%s\t%s\t", bytesize.Format(r.size), m.what, m.s.pooled, len(m.s.ns),
				fmtDur(Summarize(m.s.ns).P50), fmtDur(Summarize(m.s.daemon).P50))
			for _, name := range order {
				if ns, ok := m.s.steps[name]; ok {
					fmt.Fprintf(w, "%s\t", fmtDur(Summarize(ns).P50))
				} else {
					fmt.Fprint(w, "-\t")
				}
			}
			fmt.Fprintf(w, "%s\t\n", fmtDur(Summarize(rest(m.s.ns, m.s.daemon)).P50))
		}
	}
	return w.Flush()
}

func openSplitTable(_ string, rows []openRow) error {
	fmt.Printf("\nopen, split: the daemon round trip (Open), the daemon's part of it and its steps (its trace), and\n" +
		"import + map (Map) in the second process (open less round trip) against the floor\n\n")
	w := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "size\topen p50\tround trip p50\tround trip p99\tdaemon p50\tlookup p50\thandout p50\topen - round trip\tfloor p50\t")
	for _, r := range rows {
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t\n", bytesize.Format(r.size), fmtDur(r.open.P50),
			fmtDur(r.roundTrip.P50), fmtDur(r.roundTrip.P99), fmtDur(r.openDaemon.P50),
			fmtDur(r.openSteps["lookup"].P50), fmtDur(r.openSteps["handout"].P50),
			fmtDur(r.open.P50-r.roundTrip.P50), fmtDur(r.floor.P50))
	}
	return w.Flush()
}

func echoTable(_ string, rows []openRow) error {
	fmt.Printf("\nround trip against a bare echo server: the same second process, in turn with its opens, sends\n"+
		"%d bytes to an echo server in a process of its own and waits for %d bytes and a descriptor, as an open's\n"+
		"reply brings (blocking: a goroutine per connection in recvmsg; net: Go's network poller; poll: the\n"+
		"daemon's wait for a request without its spin, ppoll on the socket and an eventfd, then recvmsg)\n\n", echoRequest, echoReply)
	w := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprint(w, "size\tround trip p50\tp99\t")
	for _, mode := range echoModes {
		fmt.Fprintf(w, "echo %s p50\tp99\tratio p50\tratio p99\t", mode)
	}
	fmt.Fprintln(w)
	for _, r := range rows {
		fmt.Fprintf(w, "%s\t%s\t%s\t", bytesize.Format(r.size), fmtDur(r.roundTrip.P50), fmtDur(r.roundTrip.P99))
		for _, mode := range echoModes {
			e := r.echo[mode]
			fmt.Fprintf(w, "%s\t%s\t%.2fx\t%.2fx\t", fmtDur(e.P50), fmtDur(e.P99),
				float64(r.roundTrip.P50)/float64(e.P50), float64(r.roundTrip.P99)/float64(e.P99))
		}
		fmt.Fprintln(w)
	}
	return w.Flush()
}

// runChild runs '__child ARGS' in a fresh process and collects its samples.
func runChild(ctx context.Context, extra []*os.File, args ...string) (samples, error) {
	var s samples
	err := runChildFiles(ctx, &s, extra, args...)
	return s, err
}

// runChildJSON runs '__child ARGS' in a fresh process and decodes what it
// printed into out.
func runChildJSON(ctx context.Context, out any, args ...string) error {
	return runChildFiles(ctx, out, nil, args...)
}

func runChildFiles(ctx context.Context, v any, extra []*os.File, args ...string) error {
	self, err := os.Executable()
	if err != nil {
		return err
	}
	cmd := exec.CommandContext(ctx, self, append([]string{"__child"}, args...)...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr, cmd.ExtraFiles = &out, os.Stderr, extra
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("second process %v: %w", args, err)
	}
	if err := json.Unmarshal(out.Bytes(), v); err != nil {
		return fmt.Errorf("second process said %q: %w", out.String(), err)
	}
	return nil
}
