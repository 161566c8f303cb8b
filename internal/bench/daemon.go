package bench

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"time"

	"github.com/gpushm/gpushm"
)

// privateDaemon is a daemon this process started on a socket of its own,
// for demo and bench: they must not disturb a daemon already serving users.
type privateDaemon struct {
	socket string
	dir    string
	cmd    *exec.Cmd
	done   chan error
}

func startDaemon(ctx context.Context, backend string, extra ...string) (*privateDaemon, error) {
	dir, err := os.MkdirTemp("", "gpushm-")
	if err != nil {
		return nil, err
	}
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	d := &privateDaemon{socket: filepath.Join(dir, "gpushm.sock"), dir: dir, done: make(chan error, 1)}
	// GPUSHM_BENCH_LOG shows the daemons' own account (info: a pull's
	// phases, for one).
	level := "warn"
	if v := os.Getenv("GPUSHM_BENCH_LOG"); v != "" {
		level = v
	}
	args := []string{"daemon", "--socket", d.socket, "--backend", backend, "--log-level", level}
	if v := os.Getenv("GPUSHM_DAEMON_SPIN"); v != "" {
		args = append(args, "--spin", v)
	}
	args = append(args, extra...)
	d.cmd = exec.Command(self, args...)
	d.cmd.Stderr = os.Stderr
	if level != "warn" {
		d.cmd.Stdout = os.Stderr
	}
	if err := d.cmd.Start(); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("start daemon: %w", err)
	}
	go func() { d.done <- d.cmd.Wait() }()
	deadline := time.Now().Add(30 * time.Second)
	for {
		c, err := gpushm.Dial(ctx, d.socket)
		if err == nil {
			c.Close()
			return d, nil
		}
		select {
		case err := <-d.done:
			os.RemoveAll(dir)
			return nil, fmt.Errorf("daemon exited before serving: %v", err)
		case <-time.After(5 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			d.cmd.Process.Kill()
			<-d.done
			os.RemoveAll(dir)
			return nil, fmt.Errorf("daemon did not answer on %s within 30s", d.socket)
		}
	}
}

// stop sends SIGTERM and waits for a clean exit.
func (d *privateDaemon) stop() error {
	defer os.RemoveAll(d.dir)
	d.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-d.done:
		if err != nil {
			return fmt.Errorf("daemon exit: %w", err)
		}
		return nil
	case <-time.After(30 * time.Second):
		d.cmd.Process.Kill()
		<-d.done
		return fmt.Errorf("daemon ignored SIGTERM for 30s; killed")
	}
}

// withPrivateDaemon starts a daemon of backend (with daemonArgs) on a
// socket of its own, connects to it, runs fn, and stops the daemon,
// reporting fn's error first.
func withPrivateDaemon(ctx context.Context, backend string, fn func(d *privateDaemon, c *gpushm.Client) error, daemonArgs ...string) (err error) {
	before, _ := memoryInUse(resolvedBackend(backend))
	d, err := startDaemon(ctx, backend, daemonArgs...)
	if err != nil {
		return err
	}
	defer func() {
		if serr := d.stop(); err == nil {
			err = serr
		}
		if err == nil {
			reportLeftovers(os.Stdout, resolvedBackend(backend), d.socket, before)
		}
	}()
	c, err := gpushm.Dial(ctx, d.socket)
	if err != nil {
		return err
	}
	defer c.Close()
	return fn(d, c)
}
