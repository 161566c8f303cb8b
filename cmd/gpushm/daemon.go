package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"runtime"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/gpushm/gpushm/internal/backend"
	"github.com/gpushm/gpushm/internal/server"
)

func daemonCmd() *cobra.Command {
	var (
		backendName string
		device      int
		logLevel    string
		spin        time.Duration
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
			return runDaemon(cmd.Context(), log, backendName, device, spin)
		},
	}
	f := cmd.Flags()
	f.StringVar(&backendName, "backend", "auto", "memory backend: auto, cuda or host")
	f.IntVar(&device, "device", -1, "serve only this GPU ordinal (default: every GPU)")
	f.StringVar(&logLevel, "log-level", "info", "log level: debug, info, warn or error")
	f.DurationVar(&spin, "spin", 50*time.Microsecond, "how long each connection polls for its next request before sleeping (0 disables; off below 4 cores): a little CPU for latency")
	return cmd
}

func runDaemon(ctx context.Context, log *slog.Logger, backendName string, device int, spin time.Duration) error {
	b, err := backend.Open(backendName, device, log)
	if err != nil {
		return err
	}
	defer b.Close()
	srv, err := server.New(b, log, version)
	if err != nil {
		return err
	}
	if spin > 0 && runtime.NumCPU() < 4 {
		// Polling would take the core the client needs.
		log.Info("not spinning: fewer than 4 cores", "cores", runtime.NumCPU())
		spin = 0
	}
	srv.SetSpin(spin)
	path := socketPath()
	ln, err := server.Listen(path)
	if errors.Is(err, server.ErrRunning) {
		return fmt.Errorf("%w (stop it first, or pick another --socket)", err)
	}
	if err != nil {
		return err
	}
	var lim syscall.Rlimit
	syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim)
	log.Info("serving", "socket", path, "backend", b.Name(), "version", version, "pid", os.Getpid(), "max_fds", lim.Cur)
	ctx, stop := signal.NotifyContext(ctx, syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := srv.Serve(ctx, ln); err != nil {
		return err
	}
	log.Info("stopped")
	return nil
}
