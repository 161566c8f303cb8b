package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/bytesize"
	"github.com/gpushm/gpushm/internal/cuda"
	"github.com/gpushm/gpushm/internal/ucx"
)

func benchPullCmd() *cobra.Command {
	var (
		backend   string
		size      string
		receivers string
		srcDev    int
		devs      string
		chunk     string
	)
	cmd := &cobra.Command{
		Use:   "pull",
		Short: "Time pulls between daemons over UCX against UCX alone, and fan-out to several receivers",
		Long: `Start a source daemon and receiver daemons on this machine, each a node of
its own, peered over loopback (UCX's tcp unless UCX_TLS says otherwise).
The source makes a segment of --size, filled with a pattern and offered.

First the engine alone: one process maps the source's segment, copies it
to a pinned buffer (not timed) and registers it with UCX; another gets it
in chunks of --chunk into two pinned buffers, copying each up to its GPU
(or into host memory) while the next is on the wire. Then 'pull' of the
same bytes through the daemons, for each count in --receivers: that many
receivers pull at once (chains form), every byte checked after. The table
gives the times, the rates and each pull's ratio to the engine alone.

--backend host runs the same steps without a GPU (scripts/bench-smoke).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			n, err := bytesize.Parse(size)
			if err != nil {
				return fmt.Errorf("--size: %w", err)
			}
			ck, err := bytesize.Parse(chunk)
			if err != nil {
				return fmt.Errorf("--chunk: %w", err)
			}
			var counts []int
			for _, s := range strings.Split(receivers, ",") {
				k, err := strconv.Atoi(strings.TrimSpace(s))
				if err != nil || k < 1 || k > 8 {
					return fmt.Errorf("--receivers: %q: counts from 1 to 8", s)
				}
				counts = append(counts, k)
			}
			var devices []int
			if backend == "cuda" {
				for _, s := range strings.Split(devs, ",") {
					d, err := strconv.Atoi(strings.TrimSpace(s))
					if err != nil {
						return fmt.Errorf("--devices: %q", s)
					}
					devices = append(devices, d)
				}
			}
			return runBenchPull(cmd.Context(), backend, n, ck, counts, srcDev, devices)
		},
	}
	cmd.Flags().StringVar(&backend, "backend", "cuda", "backend: cuda, or host for a smoke run without GPUs")
	cmd.Flags().StringVar(&size, "size", "1GiB", "the segment's size")
	cmd.Flags().StringVar(&receivers, "receivers", "1", "counts of receivers pulling at once, separated by commas")
	cmd.Flags().IntVar(&srcDev, "source-device", 0, "the source daemon's GPU")
	cmd.Flags().StringVar(&devs, "devices", "1", "the receivers' GPUs, taken in turn")
	cmd.Flags().StringVar(&chunk, "chunk", "16MiB", "the engine alone's get size (pulls use 16 MiB)")
	return cmd
}

// freeAddr is a loopback address with a port free now.
func freeAddr() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer l.Close()
	return l.Addr().String(), nil
}

type pullNode struct {
	d    *privateDaemon
	addr string
}

func startPullNode(ctx context.Context, backend, name, secret string, device int, peers []string) (*pullNode, error) {
	addr, err := freeAddr()
	if err != nil {
		return nil, err
	}
	args := []string{"--node", name, "--peer-secret", secret, "--listen-peers", addr}
	if len(peers) > 0 {
		args = append(args, "--peers", strings.Join(peers, ","))
	}
	if backend == "cuda" {
		args = append(args, "--devices", strconv.Itoa(device))
	}
	d, err := startDaemon(ctx, backend, args...)
	if err != nil {
		return nil, err
	}
	return &pullNode{d: d, addr: addr}, nil
}

const pullSeed = 7

func runBenchPull(ctx context.Context, backend string, size, chunk int64, counts []int, srcDev int, devices []int) error {
	dir, err := os.MkdirTemp("", "gpushm-bench-pull-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	secret := filepath.Join(dir, "secret")
	if err := os.WriteFile(secret, []byte(strings.Repeat("bench-pull-secret-", 3)), 0o600); err != nil {
		return err
	}
	src, err := startPullNode(ctx, backend, "source", secret, srcDev, nil)
	if err != nil {
		return err
	}
	defer src.d.stop()
	c, err := gpushm.Dial(ctx, src.d.socket)
	if err != nil {
		return err
	}
	defer c.Close()
	const name = "bench-pull"
	seg, err := c.Create(ctx, name, size, &gpushm.CreateOptions{Offer: true})
	if err != nil {
		return err
	}
	m, err := seg.Map()
	if err != nil {
		seg.Close()
		return err
	}
	if _, err := m.ReadFrom(newPatternReader(pullSeed, size)); err != nil {
		seg.Close()
		return fmt.Errorf("fill: %w", err)
	}
	seg.Close()

	where := "host memory"
	if backend == "cuda" {
		where = fmt.Sprintf("GPU %d to GPU(s) %v", srcDev, devices)
	}
	fmt.Printf("pull of %s, %s, UCX %s (UCX_TLS=%s), over loopback\n", bytesize.Format(size), where, ucxVersion(), os.Getenv("UCX_TLS"))
	w := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	defer w.Flush() // the rows so far, should a later one fail
	fmt.Fprintln(w, "what\treceivers\ttime\tGB/s (each)\tvs engine alone\t")
	engine, err := engineAlone(ctx, backend, src.d.socket, name, size, chunk, devAt(devices, 0))
	if err != nil {
		return fmt.Errorf("the engine alone: %w", err)
	}
	gbps := func(d time.Duration) string { return fmt.Sprintf("%.2f", float64(size)/d.Seconds()/1e9) }
	fmt.Fprintf(w, "UCX alone: get %s chunks, staged\t1\t%s\t%s\t1.00x\t\n", bytesize.Format(chunk), fmtDur(engine), gbps(engine))
	for _, k := range counts {
		d, err := fanOut(ctx, backend, secret, src, name, size, k, devices)
		if err != nil {
			return fmt.Errorf("%d receivers: %w", k, err)
		}
		fmt.Fprintf(w, "gpushm pull, checked\t%d\t%s\t%s\t%.2fx\t\n", k, fmtDur(d), gbps(d), engine.Seconds()/d.Seconds())
	}
	return nil
}

func devAt(devices []int, i int) int {
	if len(devices) == 0 {
		return -1
	}
	return devices[i%len(devices)]
}

func ucxVersion() string {
	if ucx.Load() != nil {
		return "(not loaded)"
	}
	return ucx.Version()
}

// fanOut starts k receivers peered with the source and each other, has
// them pull name at once, checks every byte of each, and says how long
// the last pull took.
func fanOut(ctx context.Context, backend, secret string, src *pullNode, name string, size int64, k int, devices []int) (time.Duration, error) {
	peers := []string{src.addr}
	var nodes []*pullNode
	defer func() {
		for _, n := range nodes {
			n.d.stop()
		}
	}()
	for i := range k {
		n, err := startPullNode(ctx, backend, fmt.Sprintf("r%d", i+1), secret, devAt(devices, i), peers)
		if err != nil {
			return 0, err
		}
		nodes = append(nodes, n)
		peers = append(peers, n.addr)
	}
	// Every receiver connected to the source and the receivers before it
	// (which dialed it, or it them).
	for _, n := range nodes {
		cl, err := gpushm.Dial(ctx, n.d.socket)
		if err != nil {
			return 0, err
		}
		for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
			r, err := cl.Peers(ctx)
			up := 0
			if err == nil && r != nil {
				for _, p := range r.Peers {
					if p.Connected {
						up++
					}
				}
			}
			if up >= k {
				break
			}
			if time.Now().After(deadline) {
				cl.Close()
				return 0, fmt.Errorf("receiver %s: %d of %d peers connected after 30s", n.d.socket, up, k)
			}
		}
		cl.Close()
	}
	start := time.Now()
	var wg sync.WaitGroup
	errs := make([]error, k)
	for i, n := range nodes {
		wg.Go(func() {
			cl, err := gpushm.Dial(ctx, n.d.socket)
			if err != nil {
				errs[i] = err
				return
			}
			defer cl.Close()
			_, errs[i] = cl.Pull(ctx, name, "")
		})
	}
	wg.Wait()
	d := time.Since(start)
	for i, n := range nodes {
		if errs[i] != nil {
			return 0, fmt.Errorf("receiver %d: %w", i+1, errs[i])
		}
		if err := verifyPulled(ctx, n.d.socket, name); err != nil {
			return 0, fmt.Errorf("receiver %d: %w", i+1, err)
		}
	}
	return d, nil
}

// verifyPulled checks every byte of a pulled segment, in a second process
// (this one may have a CUDA context of its own on another GPU).
func verifyPulled(ctx context.Context, socket, name string) error {
	self, err := os.Executable()
	if err != nil {
		return err
	}
	cmd := exec.CommandContext(ctx, self, "__child", "verify", "--socket", socket, "--name", name, "--seed", strconv.Itoa(pullSeed))
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("verify: %v: %s", err, out.String())
	}
	return nil
}

// engineAlone times UCX alone moving the segment's bytes: a child that
// serves them from a registered buffer (pinned host memory, filled from
// the GPU first, not timed), and a second child that gets them to
// device (or host memory, device -1). It says the get's time.
func engineAlone(ctx context.Context, backend, socket, name string, size, chunk int64, device int) (time.Duration, error) {
	self, err := os.Executable()
	if err != nil {
		return 0, err
	}
	serve := exec.CommandContext(ctx, self, "__child", "ucx-serve", "--socket", socket, "--name", name)
	serve.Stderr = os.Stderr
	in, err := serve.StdinPipe()
	if err != nil {
		return 0, err
	}
	out, err := serve.StdoutPipe()
	if err != nil {
		return 0, err
	}
	if err := serve.Start(); err != nil {
		return 0, err
	}
	defer func() { in.Close(); serve.Wait() }()
	var g ucxGrant
	if err := json.NewDecoder(out).Decode(&g); err != nil {
		return 0, fmt.Errorf("the serving child: %w", err)
	}
	gb, _ := json.Marshal(g)
	get := exec.CommandContext(ctx, self, "__child", "ucx-get", "--device", strconv.Itoa(device), "--chunk", strconv.FormatInt(chunk, 10))
	get.Stdin = bytes.NewReader(gb)
	var res bytes.Buffer
	get.Stdout, get.Stderr = &res, os.Stderr
	if err := get.Run(); err != nil {
		return 0, fmt.Errorf("the getting child: %w", err)
	}
	var r struct{ NS int64 }
	if err := json.Unmarshal(res.Bytes(), &r); err != nil {
		return 0, fmt.Errorf("the getting child said %q: %w", res.String(), err)
	}
	return time.Duration(r.NS), nil
}

type ucxGrant struct {
	Worker []byte
	Addr   uint64
	RKey   []byte
	Size   int64
}

// ucxServeChildCmd serves a segment's bytes from a registered buffer until
// stdin closes: GPU memory copied to pinned host memory first, host
// memory in place.
func ucxServeChildCmd() *cobra.Command {
	var name string
	cmd := &cobra.Command{
		Use: "ucx-serve",
		RunE: withClient(func(ctx context.Context, c *gpushm.Client) error {
			seg, err := c.Open(ctx, name, nil)
			if err != nil {
				return err
			}
			defer seg.Close()
			m, err := seg.Map()
			if err != nil {
				return err
			}
			buf := m.Bytes()
			if m.OnDevice() {
				dev, err := cuda.GetDevice(m.Device())
				if err != nil {
					return err
				}
				if buf, err = dev.AllocHost(m.Size()); err != nil {
					return err
				}
				defer dev.FreeHost(buf)
				if err := dev.CopyDtoH(buf, m.DevicePtr()); err != nil {
					return err
				}
			}
			uc, w, err := ucx.Open()
			if err != nil {
				return err
			}
			defer uc.Close()
			defer w.Close()
			r, err := uc.Map(buf)
			if err != nil {
				return err
			}
			defer r.Free()
			g := ucxGrant{Addr: r.Addr(), Size: m.Size()}
			if g.RKey, err = r.PackKey(); err != nil {
				return err
			}
			if g.Worker, err = w.Address(); err != nil {
				return err
			}
			if err := emit(g); err != nil {
				return err
			}
			ctx, cancel := context.WithCancel(ctx)
			go func() {
				var b [1]byte
				os.Stdin.Read(b[:])
				cancel()
			}()
			w.Serve(ctx)
			return nil
		}),
	}
	cmd.Flags().StringVar(&name, "name", "", "segment")
	return cmd
}

// ucxGetChildCmd gets a ucx-serve child's bytes in chunks into two pinned
// buffers, each copied up to a GPU while the next is on the wire (or into
// host memory), and says how long it took.
func ucxGetChildCmd() *cobra.Command {
	var (
		device int
		chunk  int64
	)
	cmd := &cobra.Command{
		Use: "ucx-get",
		RunE: func(cmd *cobra.Command, _ []string) error {
			var g ucxGrant
			if err := json.NewDecoder(os.Stdin).Decode(&g); err != nil {
				return err
			}
			var (
				dev     *cuda.Device
				ptr     uint64
				bufs    [2][]byte
				streams [2]*cuda.Stream
				host    []byte
			)
			if device >= 0 {
				if err := cuda.Init(); err != nil {
					return err
				}
				var err error
				if dev, err = cuda.GetDevice(device); err != nil {
					return err
				}
				gran, err := dev.Granularity()
				if err != nil {
					return err
				}
				alloc := (g.Size + gran - 1) / gran * gran
				h, err := dev.Create(alloc)
				if err != nil {
					return err
				}
				defer dev.Release(h)
				if ptr, err = dev.Map(h, alloc, false, dev); err != nil {
					return err
				}
				defer dev.Unmap(ptr, alloc)
				for k := range bufs {
					if bufs[k], err = dev.AllocHost(chunk); err != nil {
						return err
					}
					defer dev.FreeHost(bufs[k])
					if streams[k], err = dev.NewStream(); err != nil {
						return err
					}
					defer streams[k].Close()
				}
			} else {
				var err error
				if host, err = unix.Mmap(-1, 0, int(g.Size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS); err != nil {
					return err
				}
				defer unix.Munmap(host)
			}
			uc, w, err := ucx.Open()
			if err != nil {
				return err
			}
			defer uc.Close()
			defer w.Close()
			ep, err := w.Connect(g.Worker)
			if err != nil {
				return err
			}
			defer ep.Close()
			ctx := cmd.Context()
			start := time.Now()
			for i, off := 0, int64(0); off < g.Size; i, off = i+1, off+chunk {
				n := min(chunk, g.Size-off)
				if dev == nil {
					if err := ep.Get(ctx, host[off:off+n], g.Addr+uint64(off), g.RKey); err != nil {
						return err
					}
					continue
				}
				k := i % 2
				if err := streams[k].Synchronize(); err != nil {
					return err
				}
				if err := ep.Get(ctx, bufs[k][:n], g.Addr+uint64(off), g.RKey); err != nil {
					return err
				}
				if err := streams[k].CopyHtoDAsync(ptr+uint64(off), bufs[k][:n]); err != nil {
					return err
				}
			}
			for _, s := range streams {
				if s != nil {
					if err := s.Synchronize(); err != nil {
						return err
					}
				}
			}
			return emit(struct{ NS int64 }{time.Since(start).Nanoseconds()})
		},
	}
	cmd.Flags().IntVar(&device, "device", -1, "the GPU to get to (-1: host memory)")
	cmd.Flags().Int64Var(&chunk, "chunk", 16<<20, "bytes a get")
	return cmd
}
