package bench

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"slices"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/bytesize"
	"github.com/gpushm/gpushm/internal/cuda"
)

func benchPeerCmd() *cobra.Command {
	var (
		backend string
		sizes   string
		iters   int
	)
	cmd := &cobra.Command{
		Use:   "peer",
		Short: "Time GPU 1 reading a GPU 0 segment against cuMemcpyPeer",
		Long: `On a private daemon, create a segment on GPU 0, open it with access for GPUs
0 and 1, and time a copy run by GPU 1 from the segment into GPU 1's memory
(reading over NVLink through the mapping). In the same run, time
cuMemcpyPeerAsync of the same bytes from a GPU 0 buffer to GPU 1. Both are
timed with events on a GPU 1 stream; the table gives the medians and the
ratio. Needs two GPUs with peer access.

--backend host runs the same steps without a GPU, copying host memory: the
segment's mapping against a private buffer. Its figures say nothing about
GPUs; it checks that the benchmark still runs (scripts/bench-smoke).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			list, err := parseSizes(sizes, "--iters", iters)
			if err != nil {
				return err
			}
			return runBenchPeer(cmd.Context(), backend, list, iters)
		},
	}
	cmd.Flags().StringVar(&backend, "backend", "cuda", "backend: cuda, or host for a smoke run without GPUs")
	cmd.Flags().StringVar(&sizes, "sizes", "64MiB,1GiB", "comma-separated sizes")
	cmd.Flags().IntVar(&iters, "iters", 20, "timed copies per measurement")
	return cmd
}

// peerCopies are the two copies bench peer compares: out of the shared
// segment, and between private buffers.
type peerCopies interface {
	// title heads the table; columns name the two copies.
	title(iters int) string
	columns() (shared, plain string)
	// devices are the GPUs the reader opens the segment with.
	devices() []int
	// round rounds a size up to a whole allocation.
	round(size int64) (int64, error)
	// measure returns the median rates, in GB/s, of iters copies of size
	// bytes out of m and between private buffers.
	measure(m *gpushm.Mapping, size int64, iters int) (shared, plain float64, err error)
	close()
}

func runBenchPeer(ctx context.Context, backend string, sizes []int64, iters int) error {
	var p peerCopies
	switch backend {
	case "host":
		p = hostCopies{}
	case "cuda":
		cp, err := newCUDACopies()
		if err != nil {
			return err
		}
		p = cp
	default:
		return fmt.Errorf("--backend %q: want cuda or host", backend)
	}
	defer p.close()
	return withPrivateDaemon(ctx, backend, func(_ *privateDaemon, c *gpushm.Client) error {
		return benchPeer(ctx, c, p, sizes, iters)
	})
}

func benchPeer(ctx context.Context, c *gpushm.Client, p peerCopies, sizes []int64, iters int) error {
	type row struct {
		size          int64
		shared, plain float64
	}
	var rows []row
	dev0 := 0
	for _, size := range sizes {
		size, err := p.round(size)
		if err != nil {
			return err
		}
		seg, err := c.Create(ctx, "peer-bench", size, &gpushm.CreateOptions{Device: &dev0})
		if err != nil {
			return err
		}
		// This process is also the reader: it opens the segment by name
		// with access for the reading GPUs. The name goes at once; the
		// memory when the open is closed.
		shared, err := c.Open(ctx, "peer-bench", &gpushm.OpenOptions{Devices: p.devices()})
		seg.Close()
		c.Unlink(ctx, "peer-bench")
		if err != nil {
			return err
		}
		m, err := shared.Map()
		if err == nil {
			r := row{size: size}
			r.shared, r.plain, err = p.measure(m, size, iters)
			rows = append(rows, r)
		}
		shared.Close()
		if err != nil {
			return err
		}
	}
	fmt.Printf("%s, %s\n\n", p.title(iters), time.Now().UTC().Format("2006-01-02"))
	w := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', tabwriter.AlignRight)
	shared, plain := p.columns()
	fmt.Fprintf(w, "size\t%s\t%s\tratio\t\n", shared, plain)
	for _, r := range rows {
		fmt.Fprintf(w, "%s\t%.1f GB/s\t%.1f GB/s\t%.3f\t\n", bytesize.Format(r.size), r.shared, r.plain, r.shared/r.plain)
	}
	return w.Flush()
}

// cudaCopies copies on GPU 1: from the segment on GPU 0 through its
// mapping, and with cuMemcpyPeerAsync from a GPU 0 buffer.
type cudaCopies struct {
	d0, d1 *cuda.Device
	s1     *cuda.Stream
}

func newCUDACopies() (*cudaCopies, error) {
	n, err := cuda.DeviceCount()
	if err != nil {
		return nil, err
	}
	if n < 2 {
		return nil, fmt.Errorf("bench peer needs two GPUs; this machine has %d (--backend host runs without)", n)
	}
	d0, err := cuda.GetDevice(0)
	if err != nil {
		return nil, err
	}
	d1, err := cuda.GetDevice(1)
	if err != nil {
		return nil, err
	}
	if ok, err := d1.CanAccessPeer(d0); err != nil || !ok {
		return nil, fmt.Errorf("GPU 1 cannot reach GPU 0's memory (peer access: %v, %v)", ok, err)
	}
	s1, err := d1.NewStream()
	if err != nil {
		return nil, err
	}
	return &cudaCopies{d0, d1, s1}, nil
}

func (p *cudaCopies) close() { p.s1.Close() }

func (p *cudaCopies) title(iters int) string {
	name0, _ := p.d0.Name()
	name1, _ := p.d1.Name()
	return fmt.Sprintf("gpushm bench peer: GPU 1 (%s) reading GPU 0 (%s), %d copies each, median", name1, name0, iters)
}

func (p *cudaCopies) columns() (string, string) {
	return "GPU 1 copy from the gpushm segment", "cuMemcpyPeer"
}

func (p *cudaCopies) devices() []int { return []int{0, 1} }

func (p *cudaCopies) round(size int64) (int64, error) {
	g, err := p.d0.Granularity()
	if err != nil {
		return 0, err
	}
	return (size + g - 1) / g * g, nil
}

func (p *cudaCopies) measure(m *gpushm.Mapping, size int64, iters int) (shared, plain float64, err error) {
	dst, err := newGPUBuffer(p.d1, size, p.d1)
	if err != nil {
		return 0, 0, err
	}
	defer dst.free()
	src, err := newGPUBuffer(p.d0, size, p.d0, p.d1)
	if err != nil {
		return 0, 0, err
	}
	defer src.free()
	s1 := p.s1
	shared, err = timeCopies(p.d1, s1, size, iters, func() error { return s1.CopyDtoDAsync(dst.ptr, m.DevicePtr(), size) })
	if err != nil {
		return 0, 0, err
	}
	plain, err = timeCopies(p.d1, s1, size, iters, func() error { return s1.CopyPeerAsync(dst.ptr, p.d1, src.ptr, p.d0, size) })
	return shared, plain, err
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

// hostCopies stands in for the GPUs on the host backend: the same steps,
// with memory copies in this process.
type hostCopies struct{}

func (hostCopies) close() {}

func (hostCopies) title(iters int) string {
	return fmt.Sprintf("gpushm bench peer: backend host (no GPUs: a smoke run, copies of host memory), %d copies each, median", iters)
}

func (hostCopies) columns() (string, string) {
	return "copy from the gpushm segment", "copy between private buffers"
}

func (hostCopies) devices() []int { return nil }

func (hostCopies) round(size int64) (int64, error) { return size, nil }

func (hostCopies) measure(m *gpushm.Mapping, size int64, iters int) (shared, plain float64, err error) {
	seg := m.Bytes()
	for i := range seg {
		seg[i] = byte(i * 7)
	}
	dst, src := make([]byte, size), make([]byte, size)
	shared = timeHostCopies(size, iters, func() { copy(dst, seg) })
	// A copy that timed nothing would make the table a lie.
	if !bytes.Equal(dst, seg) {
		return 0, 0, fmt.Errorf("the copy out of the segment differs from its bytes")
	}
	plain = timeHostCopies(size, iters, func() { copy(dst, src) })
	return shared, plain, nil
}

// timeHostCopies runs copy iters times, after one warm-up, and returns the
// median bandwidth in GB/s.
func timeHostCopies(n int64, iters int, copy func()) float64 {
	var rates []float64
	for i := -1; i < iters; i++ {
		t := time.Now()
		copy()
		if d := time.Since(t); i >= 0 {
			rates = append(rates, float64(n)/max(d.Seconds(), 1e-9)/1e9)
		}
	}
	slices.Sort(rates)
	return rates[len(rates)/2]
}
