package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/bytesize"
)

// DemoCommand is "gpushm demo": the whole path once, step by step, on a
// private daemon.
func DemoCommand() *cobra.Command {
	var (
		backend string
		sizeStr string
	)
	cmd := &cobra.Command{
		Use:   "demo",
		Short: "Run the whole path once: daemon, a segment shared by two processes, verified, timed",
		Long: `Start a private daemon on a temporary socket, create a segment, fill it with a
known pattern, have a second process open it by name, verify every byte and
write a second pattern back, verify that write here, remove the segment, check
that its memory is back, and stop the daemon. Prints a table of timings. Uses
the CUDA backend when a GPU is present, host memory otherwise.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			size, err := bytesize.Parse(sizeStr)
			if err != nil {
				return err
			}
			return runDemo(cmd.Context(), backend, size)
		},
	}
	cmd.Flags().StringVar(&backend, "backend", "auto", "backend for the private daemon: auto, cuda or host")
	cmd.Flags().StringVar(&sizeStr, "size", "256MiB", "segment size")
	return cmd
}

type step struct {
	what string
	d    time.Duration
	note string
}

func runDemo(ctx context.Context, backend string, size int64) error {
	t := time.Now()
	return withPrivateDaemon(ctx, backend, func(d *privateDaemon, c *gpushm.Client) error {
		r := &demoRun{size: size}
		r.add("start daemon", time.Since(t), "backend "+c.Backend())
		return r.run(ctx, d, c)
	})
}

// demoRun collects the demo's timed steps.
type demoRun struct {
	size  int64
	steps []step
}

func (r *demoRun) add(what string, d time.Duration, note string) {
	r.steps = append(r.steps, step{what, d, note})
}

func (r *demoRun) gbps(d time.Duration) string {
	return fmt.Sprintf("%.2f GB/s", float64(r.size)/d.Seconds()/1e9)
}

func (r *demoRun) run(ctx context.Context, d *privateDaemon, c *gpushm.Client) (err error) {
	size := r.size
	inf, err := c.Info(ctx)
	if err != nil {
		return err
	}
	dev := inf.Devices[0]

	const name = "demo"
	t := time.Now()
	seg, err := c.Create(ctx, name, size, nil)
	if err != nil {
		return err
	}
	defer func() {
		if seg != nil {
			seg.Close()
			c.Unlink(context.Background(), name)
		}
	}()
	r.add("create", time.Since(t), fmt.Sprintf("%s on %s", bytesize.Format(size), dev.Name))
	seg0 := seg.Info()
	t = time.Now()
	m, err := seg.Map()
	if err != nil {
		return err
	}
	r.add("map (creator)", time.Since(t), firstUse(c.Backend()))
	// The baseline is taken with this process's own CUDA context already
	// alive (the map made it), so the check below sees the segment alone.
	before, err := c.Info(ctx)
	if err != nil {
		return err
	}
	t = time.Now()
	if _, err := m.ReadFrom(newPatternReader(1, size)); err != nil {
		return fmt.Errorf("fill: %w", err)
	}
	r.add("fill from host", time.Since(t), r.gbps(time.Since(t))+", bound by making the pattern")

	t = time.Now()
	self, err := os.Executable()
	if err != nil {
		return err
	}
	child := exec.CommandContext(ctx, self, "__child", "verify", "--socket", d.socket,
		"--name", name, "--seed", "1", "--write-seed", "2")
	var out bytes.Buffer
	child.Stdout, child.Stderr = &out, os.Stderr
	if err := child.Run(); err != nil {
		return fmt.Errorf("second process: %w", err)
	}
	childTotal := time.Since(t)
	var v verifyResult
	if err := json.Unmarshal(out.Bytes(), &v); err != nil {
		return fmt.Errorf("second process said %q: %w", out.String(), err)
	}
	r.add("2nd process: open by name", time.Duration(v.OpenNS), "")
	r.add("2nd process: map", time.Duration(v.MapNS), firstUse(c.Backend()))
	r.add("2nd process: verify all bytes", time.Duration(v.VerifyNS), r.gbps(time.Duration(v.VerifyNS))+", bound by the byte compare")
	r.add("2nd process: write back", time.Duration(v.WriteNS), r.gbps(time.Duration(v.WriteNS)))
	r.add("2nd process: whole run", childTotal, "exec to exit")

	t = time.Now()
	chk := newPatternChecker(2, size)
	if _, err := m.WriteTo(chk); err != nil {
		return fmt.Errorf("verify the second process's write: %w", err)
	}
	if err := chk.done(); err != nil {
		return fmt.Errorf("verify the second process's write: %w", err)
	}
	r.add("verify write-back here", time.Since(t), r.gbps(time.Since(t)))

	t = time.Now()
	if err := c.Unlink(ctx, name); err != nil {
		return err
	}
	if err := seg.Close(); err != nil {
		return err
	}
	seg = nil
	r.add("unlink + close", time.Since(t), "")
	after, err := c.Info(ctx)
	if err != nil {
		return err
	}
	memNote := fmt.Sprintf("daemon holds %d segments, %s", after.Usage.Segments, bytesize.Format(after.Usage.Bytes))
	if after.Usage.Segments != 0 || after.Usage.Bytes != 0 {
		return fmt.Errorf("memory not released: %s", memNote)
	}
	if c.Backend() == "cuda" {
		alloc := seg0.AllocSize
		freed, waited, err := gpuMemoryBack(ctx, c, before.Devices[0].FreeBytes, alloc)
		if err != nil {
			return err
		}
		memNote += fmt.Sprintf("; GPU free memory rose by %s after unlink (the segment allocated %s", bytesize.Format(freed), bytesize.Format(alloc))
		if waited > 0 {
			memNote += fmt.Sprintf("; back %s after the unlink's reply", fmtDur(waited))
		}
		memNote += ")"
		if freed < alloc/2 {
			return fmt.Errorf("GPU memory not back %s after unlink: free rose by %s, the segment had %s", fmtDur(waited), bytesize.Format(freed), bytesize.Format(alloc))
		}
	}

	fmt.Printf("gpushm demo: %s segment, backend %s, device %q\n\n", bytesize.Format(size), c.Backend(), dev.Name)
	w := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "STEP\tTIME\tNOTE")
	for _, s := range r.steps {
		fmt.Fprintf(w, "%s\t%s\t%s\n", s.what, fmtDur(s.d), s.note)
	}
	w.Flush()
	fmt.Printf("\nverified: both processes saw every byte the other wrote; %s\n", memNote)
	return nil
}

// firstUse notes that a process's first cuda mapping creates its CUDA
// context, which dwarfs the mapping itself (see 'gpushm bench open').
func firstUse(backend string) string {
	if backend == "cuda" {
		return "includes creating this process's CUDA context"
	}
	return ""
}

func fmtDur(d time.Duration) string {
	switch {
	case d < time.Millisecond:
		return fmt.Sprintf("%.1f us", float64(d.Nanoseconds())/1e3)
	case d < time.Second:
		return fmt.Sprintf("%.2f ms", float64(d.Nanoseconds())/1e6)
	}
	return fmt.Sprintf("%.2f s", d.Seconds())
}

// gpuMemoryBack waits up to memoryBackWithin for the device's free memory
// to rise by half of alloc over before, and returns by how much it rose and
// how long that took. The memory of an unlinked segment goes back once the
// supervisor has closed its copy of the segment's descriptor, which it does
// when the serving process's journal message reaches it: after the
// unlink's reply, not before.
func gpuMemoryBack(ctx context.Context, c *gpushm.Client, before uint64, alloc int64) (freed int64, waited time.Duration, err error) {
	start := time.Now()
	for look := 0; ; look++ {
		inf, err := c.Info(ctx)
		if err != nil {
			return 0, 0, err
		}
		freed = int64(inf.Devices[0].FreeBytes) - int64(before)
		if look > 0 {
			waited = time.Since(start)
		}
		if freed >= alloc/2 || waited > memoryBackWithin {
			return freed, waited, nil
		}
		time.Sleep(time.Millisecond)
	}
}

// memoryBackWithin bounds the demo's wait for an unlinked segment's GPU
// memory.
const memoryBackWithin = 5 * time.Second
