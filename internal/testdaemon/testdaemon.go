// Package testdaemon runs a real daemon on a socket in a test's temporary
// directory, for tests in any package, and says what the daemon's put
// should record of a file (StatFile).
package testdaemon

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/gpushm/gpushm/internal/backend"
	"github.com/gpushm/gpushm/internal/cuda"
	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/server"
)

// Backends lists the backends tests should run against: host always, cuda
// where a GPU is present.
func Backends() []string {
	if cuda.Init() == nil {
		return []string{"host", "cuda"}
	}
	return []string{"host"}
}

// RequireBackend skips the test, with the reason, when the backend cannot
// run here.
func RequireBackend(t testing.TB, name string) {
	t.Helper()
	if name != "cuda" {
		return
	}
	if err := cuda.Init(); err != nil {
		t.Skipf("cuda backend needs a GPU: %v", err)
	}
}

// Daemon is a running server.
type Daemon struct {
	Socket  string
	Server  *server.Server
	Backend backend.Backend

	stop func()
}

// Stop stops serving: the daemon ends every connection, frees every
// segment and removes its socket, as a daemon that exits does. The test's
// end stops a daemon not stopped before.
func (d *Daemon) Stop() { d.stop() }

// Start serves backend on a socket in a temporary directory until the test
// ends.
func Start(t testing.TB, backendName string) *Daemon {
	t.Helper()
	return StartWith(t, backendName, nil)
}

// StartWith is Start with a hook that sees the server and its backend
// before it serves.
func StartWith(t testing.TB, backendName string, setup func(*server.Server, backend.Backend)) *Daemon {
	t.Helper()
	dir := tempDir(t)
	return start(t, backendName, filepath.Join(dir, "s.sock"), setup)
}

// tempDir makes a directory for a socket, removed when the test ends.
func tempDir(t testing.TB) string {
	t.Helper()
	// Socket paths are limited to 108 bytes; t.TempDir can be long. The
	// directory is open to all, for tests that run clients as other users.
	dir, err := os.MkdirTemp("", "gpushm-test-")
	if err != nil {
		t.Fatal(err)
	}
	os.Chmod(dir, 0o755)
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// StartAt is Start on the socket at path, whose directory the daemon makes
// if it is not there (and leaves there).
func StartAt(t testing.TB, backendName, path string) *Daemon {
	t.Helper()
	return start(t, backendName, path, nil)
}

func start(t testing.TB, backendName, path string, setup func(*server.Server, backend.Backend)) *Daemon {
	t.Helper()
	RequireBackend(t, backendName)
	d, wait, err := launch(backendName, path, setup)
	return stopAtEnd(t, d, wait, err)
}

// StartOn serves b, a backend of the test's own (a fake allocator), on a
// socket in a temporary directory until the test ends; setup, if not nil,
// sees the server before it serves. Segments move between tiers only
// where b is a segment.Mover. The Daemon's Backend is nil.
func StartOn(t testing.TB, b server.Backend, setup func(*server.Server)) *Daemon {
	t.Helper()
	dir := tempDir(t)
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	d, wait, err := serve(b, filepath.Join(dir, "s.sock"), log, setup)
	return stopAtEnd(t, d, wait, err)
}

// stopAtEnd stops d when the test ends, or fails the test with err.
func stopAtEnd(t testing.TB, d *Daemon, wait func() error, err error) *Daemon {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	d.stop = func() {
		once.Do(func() {
			if err := wait(); err != nil {
				t.Errorf("Serve: %v", err)
			}
		})
	}
	t.Cleanup(d.stop)
	return d
}

// Run starts a daemon of backend on a socket in a directory of its own,
// for a TestMain: runnable examples have no test to start one for them.
// stop ends it, removes the directory and returns what Serve returned.
func Run(backendName string) (d *Daemon, stop func() error, err error) {
	dir, err := os.MkdirTemp("", "gpushm-test-")
	if err != nil {
		return nil, nil, err
	}
	d, wait, err := launch(backendName, filepath.Join(dir, "s.sock"), nil)
	if err != nil {
		os.RemoveAll(dir)
		return nil, nil, err
	}
	var once sync.Once
	var serveErr error
	d.stop = func() {
		once.Do(func() {
			serveErr = wait()
			os.RemoveAll(dir)
		})
	}
	return d, func() error { d.stop(); return serveErr }, nil
}

// RunAt serves backend on a socket at path until stop, for a test's child
// process that plays a daemon of its own (another user's, say); setup, if
// not nil, sees the server before it serves.
func RunAt(backendName, path string, setup func(*server.Server, backend.Backend)) (d *Daemon, stop func() error, err error) {
	return launch(backendName, path, setup)
}

// RunExamples runs m's tests and examples with a daemon of the host
// backend at $GPUSHM_SOCKET, where the examples find it as programs do,
// and exits with their status: a TestMain's whole body.
func RunExamples(m interface{ Run() int }) {
	d, stop, err := Run("host")
	if err != nil {
		fmt.Fprintf(os.Stderr, "the examples' daemon: %v\n", err)
		os.Exit(1)
	}
	os.Setenv("GPUSHM_SOCKET", d.Socket)
	code := m.Run()
	if err := stop(); err != nil {
		fmt.Fprintf(os.Stderr, "the examples' daemon: %v\n", err)
		code = 1
	}
	os.Exit(code)
}

// launch serves backend on a socket at path, as the daemon does on the
// host backend with a host budget (segments move when asked to); wait
// stops it and says what Serve returned.
func launch(backendName, path string, setup func(*server.Server, backend.Backend)) (d *Daemon, wait func() error, err error) {
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	b, err := backend.Open(backendName, "all", log)
	if err != nil {
		return nil, nil, fmt.Errorf("backend %s: %w", backendName, err)
	}
	d, stop, err := serve(b, path, log, func(srv *server.Server) {
		if setup != nil {
			setup(srv, b)
		}
	})
	if err != nil {
		b.Close()
		return nil, nil, err
	}
	d.Backend = b
	wait = func() error {
		err := stop()
		b.Close()
		return err
	}
	return d, wait, nil
}

// serve serves b on a socket at path, with channels' control blocks in
// host memory and, where b can move segments, a host budget; wait stops
// it and says what Serve returned.
func serve(b server.Backend, path string, log *slog.Logger, setup func(*server.Server)) (d *Daemon, wait func() error, err error) {
	srv, err := server.New(b, log, "test")
	if err != nil {
		return nil, nil, err
	}
	host, err := backend.NewHost()
	if err != nil {
		return nil, nil, err
	}
	srv.Registry().SetControlAllocator(host)
	// No budget (as the daemon on the host backend), and a host budget:
	// segments move when asked to.
	if mover, ok := b.(segment.Mover); ok {
		srv.Registry().SetTiers(segment.Tiers{HostBudget: 1 << 30, Spill: backend.NewSpill(host, 64<<20), Mover: mover})
	}
	if setup != nil {
		setup(srv)
	}
	ln, err := server.Listen(path, "")
	if err != nil {
		return nil, nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx, ln, false) }()
	wait = func() error {
		cancel()
		return <-done
	}
	return &Daemon{Socket: path, Server: srv}, wait, nil
}
