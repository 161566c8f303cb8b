package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"os/signal"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/gpushm/gpushm/internal/backend"
	"github.com/gpushm/gpushm/internal/fusefs"
	"github.com/gpushm/gpushm/internal/metrics"
	"github.com/gpushm/gpushm/internal/nvml"
	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/server"
)

func daemonCmd() *cobra.Command {
	var (
		backendName string
		devices     string
		device      int
		logLevel    string
		spin        time.Duration
		o           daemonOptions
	)
	cmd := &cobra.Command{
		Use:   "daemon",
		Short: "Run the daemon that owns the segments",
		Long: `Run the gpushm daemon in the foreground. It serves the socket until SIGINT or
SIGTERM, then frees every segment it holds and exits 0.

--backend auto (the default) uses CUDA when libcuda.so.1 loads and a device
with VMM and POSIX file descriptor handles is present, and host memory
(memfd) otherwise. It refuses to start when another daemon answers on the
socket, and replaces a stale socket file.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			var lvl slog.Level
			if err := lvl.UnmarshalText([]byte(logLevel)); err != nil {
				return fmt.Errorf("--log-level: %w", err)
			}
			log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: lvl}))
			if cmd.Flags().Changed("device") {
				if cmd.Flags().Changed("devices") {
					return fmt.Errorf("give --device or --devices, not both")
				}
				devices = strconv.Itoa(device)
			}
			o.backend, o.devices, o.spin = backendName, devices, spin
			return runDaemon(cmd.Context(), log, o)
		},
	}
	f := cmd.Flags()
	f.StringVar(&backendName, "backend", "auto", "memory backend: auto, cuda or host")
	f.StringVar(&devices, "devices", "all", "GPUs to serve: all, or ordinals and UUIDs separated by commas (0,1 or GPU-5e6f...)")
	f.IntVar(&device, "device", 0, "serve only this GPU ordinal (short for --devices N)")
	f.StringVar(&logLevel, "log-level", "info", "log level: debug, info, warn or error")
	f.StringVar(&o.socketGroup, "socket-group", "", "let only this group connect (socket mode 0660; default: every user, 0666)")
	f.StringVar(&o.maxMemory, "max-memory", "", "cap what segments may hold on each device: a size (64G) or a share of the device (90%)")
	f.StringVar(&o.userQuota, "user-quota", "", "cap the bytes each non-root user's segments may hold (all devices)")
	f.IntVar(&o.userSegments, "user-segments", 0, "cap how many segments each non-root user may hold (0: no cap)")
	f.StringVar(&o.metrics, "metrics-listen", "", "serve Prometheus metrics at http://ADDR/metrics (e.g. 127.0.0.1:9464)")
	f.StringVar(&o.mount, "mount", "", "also serve the segments as files in this directory (FUSE; see docs/fuse.md)")
	f.StringVar(&o.nvml, "nvml", "auto", "GPU figures for info and metrics from NVML: auto (when libnvidia-ml.so.1 loads and works), require (refuse to start without it) or off")
	f.StringVar(&o.nvmlLibrary, "nvml-library", nvml.Library, "the NVML library to load (a name for the loader, or a path)")
	f.DurationVar(&spin, "spin", 50*time.Microsecond, "how long each connection polls for its next request before sleeping (0 disables; off below 4 cores): a little CPU for latency")
	return cmd
}

type daemonOptions struct {
	backend     string
	devices     string
	spin        time.Duration
	socketGroup string
	metrics     string
	mount       string
	maxMemory   string
	userQuota   string
	// userSegments caps each non-root user's segment count.
	userSegments int
	// nvml is auto, require or off; nvmlLibrary what to dlopen.
	nvml, nvmlLibrary string
}

// limits turns the quota flags into registry limits for b's devices.
func (o daemonOptions) limits(b backend.Backend) (segment.Limits, error) {
	var l segment.Limits
	if o.userSegments < 0 {
		return l, fmt.Errorf("--user-segments %d: want 0 or more", o.userSegments)
	}
	l.UserSegments = o.userSegments
	if o.userQuota != "" {
		n, err := parseSize(o.userQuota)
		if err != nil {
			return l, fmt.Errorf("--user-quota: %w", err)
		}
		l.UserBytes = n
	}
	if o.maxMemory != "" {
		devs, err := b.Devices()
		if err != nil {
			return l, err
		}
		l.DeviceBytes = map[int]int64{}
		for _, d := range devs {
			n, err := sizeOrShare(o.maxMemory, int64(d.TotalBytes))
			if err != nil {
				return l, fmt.Errorf("--max-memory: %w", err)
			}
			l.DeviceBytes[d.Index] = n
		}
	}
	return l, nil
}

// sizeOrShare reads "64G" as bytes and "90%" as that share of total.
func sizeOrShare(s string, total int64) (int64, error) {
	if p, ok := strings.CutSuffix(strings.TrimSpace(s), "%"); ok {
		f, err := strconv.ParseFloat(p, 64)
		if err != nil || f <= 0 || f > 100 {
			return 0, fmt.Errorf("%q: want a share between 0%% and 100%%", s)
		}
		return int64(f / 100 * float64(total)), nil
	}
	return parseSize(s)
}

func runDaemon(ctx context.Context, log *slog.Logger, o daemonOptions) error {
	b, err := backend.Open(o.backend, o.devices, log)
	if err != nil {
		return err
	}
	defer b.Close()
	srv, err := server.New(b, log, version)
	if err != nil {
		return err
	}
	lim, err := o.limits(b)
	if err != nil {
		return err
	}
	srv.Registry().SetLimits(lim)
	spin := o.spin
	if spin > 0 && runtime.NumCPU() < 4 {
		// Polling would take the core the client needs.
		log.Debug("not spinning: fewer than 4 cores", "cores", runtime.NumCPU())
		spin = 0
	}
	srv.SetSpin(spin)
	gpus, closeGPUs, err := openGPUMonitor(o.nvml, o.nvmlLibrary, b, log)
	if err != nil {
		return err
	}
	defer closeGPUs()
	srv.SetGPUReport(gpus.ReportFor)
	// Bind the metrics port before the socket: a client that finds the
	// socket finds a daemon with every part it was asked to serve.
	mln, err := listenMetrics(o.metrics)
	if err != nil {
		return err
	}
	path := socketPath()
	ln, err := server.Listen(path, o.socketGroup)
	if errors.Is(err, server.ErrRunning) {
		return fmt.Errorf("%w (stop it first, or pick another --socket)", err)
	}
	if err != nil {
		closeListener(mln)
		return err
	}
	ctx, stop := signal.NotifyContext(ctx, syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	var wg sync.WaitGroup
	defer wg.Wait()
	if mln != nil {
		m := metrics.New(b.Name(), struct {
			*segment.Registry
			backend.Backend
		}{srv.Registry(), b})
		m.SetGPUs(gpus.Report)
		srv.SetObserver(m)
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(m.Registry(), promhttp.HandlerOpts{}))
		hs := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
		wg.Go(func() { hs.Serve(mln) })
		context.AfterFunc(ctx, func() { hs.Close() })
		log.Info("metrics", "url", "http://"+mln.Addr().String()+"/metrics")
	}
	serveCtx := ctx
	if o.mount != "" {
		view, err := fusefs.Mount(o.mount, srv.Registry(), b, log)
		if err != nil {
			ln.Close()
			os.Remove(path) // ours: Listen made it, and nobody was served
			return err
		}
		// Unmount before Serve closes the registry, so that no FUSE request
		// meets a closed one.
		unmount := sync.OnceFunc(func() {
			if err := view.Unmount(); err != nil {
				log.Error("unmount FUSE view", "err", err)
			}
		})
		defer unmount()
		var cancel context.CancelFunc
		serveCtx, cancel = context.WithCancel(context.WithoutCancel(ctx))
		context.AfterFunc(ctx, func() { unmount(); cancel() })
		log.Info("FUSE view", "mount", o.mount)
	}
	var nofile syscall.Rlimit
	syscall.Getrlimit(syscall.RLIMIT_NOFILE, &nofile)
	log.Info("serving", "socket", path, "backend", b.Name(), "version", version, "pid", os.Getpid(), "max_fds", nofile.Cur)
	if err := srv.Serve(serveCtx, ln); err != nil {
		return err
	}
	log.Info("stopped")
	return nil
}
