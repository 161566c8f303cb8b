package main

import (
	"context"
	"fmt"
	"os"
	"slices"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/cuda"
)

func benchPeerCmd() *cobra.Command {
	var (
		sizes string
		iters int
	)
	cmd := &cobra.Command{
		Use:   "peer",
		Short: "Time GPU 1 reading a GPU 0 segment against cuMemcpyPeer",
		Long: `On a private daemon, create a segment on GPU 0, open it with access for GPUs
0 and 1, and time a copy run by GPU 1 from the segment into GPU 1's memory
(reading over NVLink through the mapping). In the same run, time
cuMemcpyPeerAsync of the same bytes from a GPU 0 buffer to GPU 1. Both are
timed with events on a GPU 1 stream; the table gives the medians and the
ratio. Needs two GPUs with peer access.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			list, err := parseSizes(sizes)
			if err != nil {
				return err
			}
			return runBenchPeer(cmd.Context(), list, iters)
		},
	}
	cmd.Flags().StringVar(&sizes, "sizes", "64MiB,1GiB", "comma-separated sizes")
	cmd.Flags().IntVar(&iters, "iters", 20, "timed copies per measurement")
	return cmd
}

// gpuBuffer is plain VMM memory on one GPU, mapped for the GPUs given.
type gpuBuffer struct {
	d    *cuda.Device
	h    cuda.Handle
	ptr  uint64
	size int64
}

func newGPUBuffer(d *cuda.Device, size int64, access ...*cuda.Device) (*gpuBuffer, error) {
	h, err := d.Create(size)
	if err != nil {
		return nil, err
	}
	ptr, err := d.Map(h, size, false, access...)
	if err != nil {
		d.Release(h)
		return nil, err
	}
	return &gpuBuffer{d, h, ptr, size}, nil
}

func (b *gpuBuffer) free() { b.d.Unmap(b.ptr, b.size); b.d.Release(b.h) }

// timeCopies runs copy iters times on s, after one warm-up, and returns
// the median bandwidth in GB/s.
func timeCopies(d *cuda.Device, s *cuda.Stream, n int64, iters int, copy func() error) (float64, error) {
	start, err := d.NewEvent()
	if err != nil {
		return 0, err
	}
	defer start.Close()
	end, err := d.NewEvent()
	if err != nil {
		return 0, err
	}
	defer end.Close()
	var rates []float64
	for i := -1; i < iters; i++ {
		if err := start.Record(s); err != nil {
			return 0, err
		}
		if err := copy(); err != nil {
			return 0, err
		}
		if err := end.Record(s); err != nil {
			return 0, err
		}
		if err := end.Synchronize(); err != nil {
			return 0, err
		}
		ms, err := cuda.ElapsedMs(start, end)
		if err != nil {
			return 0, err
		}
		if i >= 0 {
			rates = append(rates, float64(n)/(float64(ms)/1e3)/1e9)
		}
	}
	slices.Sort(rates)
	return rates[len(rates)/2], nil
}

func runBenchPeer(ctx context.Context, sizes []int64, iters int) error {
	n, err := cuda.DeviceCount()
	if err != nil {
		return err
	}
	if n < 2 {
		return fmt.Errorf("bench peer needs two GPUs; this machine has %d", n)
	}
	d0, err := cuda.GetDevice(0)
	if err != nil {
		return err
	}
	d1, err := cuda.GetDevice(1)
	if err != nil {
		return err
	}
	if ok, err := d1.CanAccessPeer(d0); err != nil || !ok {
		return fmt.Errorf("GPU 1 cannot reach GPU 0's memory (peer access: %v, %v)", ok, err)
	}
	return withPrivateDaemon(ctx, "cuda", func(_ *privateDaemon, c *gpushm.Client) error {
		return benchPeer(ctx, c, d0, d1, sizes, iters)
	})
}

func benchPeer(ctx context.Context, c *gpushm.Client, d0, d1 *cuda.Device, sizes []int64, iters int) error {
	s1, err := d1.NewStream()
	if err != nil {
		return err
	}
	defer s1.Close()
	name0, _ := d0.Name()
	name1, _ := d1.Name()
	type row struct {
		size       int64
		shared, pr float64
	}
	var rows []row
	dev0 := 0
	for _, size := range sizes {
		g, err := d0.Granularity()
		if err != nil {
			return err
		}
		size = (size + g - 1) / g * g
		seg, err := c.Create(ctx, "peer-bench", size, &gpushm.CreateOptions{Device: &dev0})
		if err != nil {
			return err
		}
		// This process is also the GPU 1 consumer: it opens the segment by
		// name with access for both GPUs. The name goes at once; the memory
		// when the open is closed.
		shared, err := c.Open(ctx, "peer-bench", &gpushm.OpenOptions{Devices: []int{0, 1}})
		seg.Close()
		c.Unlink(ctx, "peer-bench")
		if err != nil {
			return err
		}
		m, err := shared.Map()
		if err != nil {
			shared.Close()
			return err
		}
		dst, err := newGPUBuffer(d1, size, d1)
		if err != nil {
			shared.Close()
			return err
		}
		src, err := newGPUBuffer(d0, size, d0, d1)
		if err != nil {
			dst.free()
			shared.Close()
			return err
		}
		r := row{size: size}
		r.shared, err = timeCopies(d1, s1, size, iters, func() error { return s1.CopyDtoDAsync(dst.ptr, m.DevicePtr(), size) })
		if err == nil {
			r.pr, err = timeCopies(d1, s1, size, iters, func() error { return s1.CopyPeerAsync(dst.ptr, d1, src.ptr, d0, size) })
		}
		src.free()
		dst.free()
		shared.Close()
		if err != nil {
			return err
		}
		rows = append(rows, r)
	}
	fmt.Printf("gpushm bench peer: GPU 1 (%s) reading GPU 0 (%s), %d copies each, median, %s\n\n",
		name1, name0, iters, time.Now().UTC().Format("2006-01-02"))
	w := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "size\tGPU 1 copy from the gpushm segment\tcuMemcpyPeer\tratio\t")
	for _, r := range rows {
		fmt.Fprintf(w, "%s\t%.1f GB/s\t%.1f GB/s\t%.3f\t\n", formatSize(r.size), r.shared, r.pr, r.shared/r.pr)
	}
	return w.Flush()
}
