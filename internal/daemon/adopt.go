package daemon

import (
	"context"
	"fmt"
	"log/slog"
	"os"

	"github.com/gpushm/gpushm/internal/server"
	"github.com/gpushm/gpushm/internal/supervisor"
)

// Adopt is a supervisor started by a serving process whose own
// supervisor died: it takes over the lock, the listener and the epoch page
// from it, then the segments, and supervises it as the first one did. Its
// flags are the first supervisor's, passed on by the serving process.
func Adopt(ctx context.Context, log *slog.Logger, o Options) error {
	h, err := supervisor.TakeHandover()
	if err != nil {
		return err
	}
	defer h.Lock.Close()
	defer h.Listener.Close()
	defer h.Epoch.Close()
	if err := server.TakeLock(h.Lock); err != nil {
		return err
	}
	exe, err := os.Executable()
	if err != nil {
		return fmt.Errorf("find this binary to run it as the serving process: %w", err)
	}
	sup := supervisor.New(supervisor.Config{
		Exe: exe, Args: os.Args[1:], Listener: h.Listener, Epoch: h.Epoch,
		Grace: o.Grace, Log: log, Lock: h.Lock, Heal: true, Handover: h,
	}, nil)
	log.Debug("adopting", "socket", o.Socket, "pid", os.Getpid(), "exe", exe)
	return supervise(ctx, sup, log, o.Socket, h.Listener, false)
}
