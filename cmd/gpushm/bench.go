package main

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
)

func benchCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "Benchmarks that print tables",
	}
	cmd.AddCommand(benchOpenCmd(), benchPeerCmd(), benchIdleCmd(), benchFilesCmd())
	return cmd
}

func benchOpenCmd() *cobra.Command {
	var (
		backend string
		sizes   string
		iters   int
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
  create   create a segment through the daemon (allocate + export), back
           to back, then again one every few milliseconds (paced), when
           each finds its size made ahead (daemon --create-pool); beside
           them, the steps of an allocation made while a create waits,
           timed in this process: cuMemCreate and the export on cuda,
           memfd and fallocate on host

Each row reports p50 and p99 over --iters samples, and open's p50 as a
multiple of the floor's p50 measured in the same run. At the end it says
whether any process of the private daemon outlived it, and the memory in
use against its start.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			list, err := parseSizes(sizes)
			if err != nil {
				return err
			}
			if iters < 1 {
				return fmt.Errorf("--iters %d: want at least 1", iters)
			}
			return runBenchOpen(cmd.Context(), backend, list, iters)
		},
	}
	cmd.Flags().StringVar(&backend, "backend", "auto", "backend: auto, cuda or host")
	cmd.Flags().StringVar(&sizes, "sizes", "2MiB,64MiB,1GiB", "comma-separated segment sizes")
	cmd.Flags().IntVar(&iters, "iters", 200, "samples per measurement")
	return cmd
}

type dist struct{ p50, p99 time.Duration }

func summarize(ns []int64) dist {
	s := slices.Clone(ns)
	slices.Sort(s)
	if len(s) == 0 {
		return dist{}
	}
	i99 := (len(s)*99+99)/100 - 1
	return dist{time.Duration(s[len(s)/2]), time.Duration(s[min(i99, len(s)-1)])}
}

func runBenchOpen(ctx context.Context, backend string, sizes []int64, iters int) error {
	return withPrivateDaemon(ctx, backend, func(d *privateDaemon, c *gpushm.Client) error {
		return benchOpen(ctx, d, c, sizes, iters)
	})
}

func benchOpen(ctx context.Context, d *privateDaemon, c *gpushm.Client, sizes []int64, iters int) error {
	inf, err := c.Info(ctx)
	if err != nil {
		return err
	}
	dev := inf.Devices[0]
	type row struct {
		size                        int64
		floor, open, reopen, create dist
		roundTrip                   dist
		paced                       dist // creates one per pace
		pace                        time.Duration
		alloc, commit, free         dist // createSteps

	}
	var rows []row
	for _, size := range sizes {
		r := row{size: size}
		r.alloc, r.commit, r.free, err = createSteps(c.Backend(), dev, size, min(iters, 50))
		if err != nil {
			return fmt.Errorf("create steps: %w", err)
		}
		// Back to back, creates come faster than the pool makes
		// allocations ahead; paced, each finds one ready, as a service
		// creating a segment per request would.
		pace := 4*(r.alloc.p50+r.commit.p50+r.free.p50) + time.Millisecond
		for _, paced := range []bool{false, true} {
			var createNS []int64
			for i := range iters {
				if paced {
					time.Sleep(pace)
				}
				name := fmt.Sprintf("bench-create-%d", i)
				t := time.Now()
				if _, _, err := c.CreateOnly(ctx, name, size, nil); err != nil {
					return err
				}
				createNS = append(createNS, time.Since(t).Nanoseconds())
				if err := c.Unlink(ctx, name); err != nil {
					return err
				}
			}
			if paced {
				r.paced, r.pace = summarize(createNS), pace
			} else {
				r.create = summarize(createNS)
			}
		}

		seg, err := c.Create(ctx, "bench", size, nil)
		if err != nil {
			return err
		}
		f, spec, release, err := exportFloor(c.Backend(), dev, size)
		if err != nil {
			seg.Close()
			return fmt.Errorf("floor: %w", err)
		}
		s, err := runChild(ctx, []*os.File{f}, "open", "--socket", d.socket, "--name", "bench",
			"--iters", fmt.Sprint(iters), "--floor-handle", spec.handle,
			"--floor-device", fmt.Sprint(spec.device), "--floor-size", fmt.Sprint(spec.size))
		f.Close()
		release()
		if err == nil {
			r.open, r.roundTrip, r.floor = summarize(s.NS), summarize(s.RoundTripNS), summarize(s.FloorNS)
			s, err = runChild(ctx, nil, "open", "--socket", d.socket, "--name", "bench", "--iters", fmt.Sprint(iters), "--reopen")
			r.reopen = summarize(s.NS)
		}
		seg.Close()
		if uerr := c.Unlink(ctx, "bench"); err == nil {
			err = uerr
		}
		if err != nil {
			return err
		}
		rows = append(rows, r)
	}

	fmt.Printf("gpushm bench open: backend %s, device %d %q, %d samples each, %s\n\n",
		c.Backend(), dev.Index, dev.Name, iters, time.Now().UTC().Format("2006-01-02"))
	w := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "size\tfloor p50\tfloor p99\topen p50\topen p99\topen/floor\treopen p50\treopen p99\tcreate p50\tcreate p99\t")
	for _, r := range rows {
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%.3fx\t%s\t%s\t%s\t%s\t\n", formatSize(r.size),
			fmtDur(r.floor.p50), fmtDur(r.floor.p99), fmtDur(r.open.p50), fmtDur(r.open.p99),
			float64(r.open.p50)/float64(r.floor.p50),
			fmtDur(r.reopen.p50), fmtDur(r.reopen.p99), fmtDur(r.create.p50), fmtDur(r.create.p99))
	}
	if err := w.Flush(); err != nil {
		return err
	}
	fmt.Printf("\ncreate, split: the daemon's create back to back and one per pace (each finding its size made ahead, --create-pool), and the steps of an allocation made while a create waits, timed in this process\n\n")
	w = tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', tabwriter.AlignRight)
	alloc, commit := "memfd p50", "fallocate p50"
	if c.Backend() == "cuda" {
		alloc, commit = "cuMemCreate p50", "export p50"
	}
	fmt.Fprintf(w, "size\tcreate p50\tpace\tpaced p50\tpaced p99\t%s\t%s\tfree p50\t\n", alloc, commit)
	for _, r := range rows {
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t\n", formatSize(r.size), fmtDur(r.create.p50), fmtDur(r.pace),
			fmtDur(r.paced.p50), fmtDur(r.paced.p99), fmtDur(r.alloc.p50), fmtDur(r.commit.p50), fmtDur(r.free.p50))
	}
	if err := w.Flush(); err != nil {
		return err
	}
	fmt.Printf("\nopen, split: the daemon round trip (Open) and import + map (Map) in the second process\n\n")
	w = tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "size\topen p50\tround trip p50\tround trip p99\tfloor p50\t")
	for _, r := range rows {
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t\n", formatSize(r.size), fmtDur(r.open.p50),
			fmtDur(r.roundTrip.p50), fmtDur(r.roundTrip.p99), fmtDur(r.floor.p50))
	}
	return w.Flush()
}

// runChild runs '__child ARGS' in a fresh process and collects its samples.
func runChild(ctx context.Context, extra []*os.File, args ...string) (samples, error) {
	self, err := os.Executable()
	if err != nil {
		return samples{}, err
	}
	cmd := exec.CommandContext(ctx, self, append([]string{"__child"}, args...)...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr, cmd.ExtraFiles = &out, os.Stderr, extra
	var s samples
	if err := cmd.Run(); err != nil {
		return s, fmt.Errorf("second process %v: %w", args, err)
	}
	if err := json.Unmarshal(out.Bytes(), &s); err != nil {
		return s, fmt.Errorf("second process said %q: %w", out.String(), err)
	}
	return s, nil
}
