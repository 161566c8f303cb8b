package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"syscall"

	"github.com/gpushm/gpushm/internal/epoch"
	"github.com/gpushm/gpushm/internal/server"
	"github.com/gpushm/gpushm/internal/supervisor"
)

// Supervise holds the socket, the epoch page and every segment's
// descriptor, and runs the serving process (this binary again) under
// internal/supervisor.
func Supervise(ctx context.Context, log *slog.Logger, o Options) error {
	path := o.Socket
	lock, err := server.Lock(path)
	if err != nil {
		return fmt.Errorf("%w (stop it first, or pick another --socket)", err)
	}
	defer lock.Close()
	handed := supervisor.FromSystemd(log)
	listener := handed.Listener
	if listener == nil {
		ln, err := server.Listen(path, o.SocketGroup)
		if errors.Is(err, server.ErrRunning) {
			return fmt.Errorf("%w (stop it first, or pick another --socket)", err)
		}
		if err != nil {
			return err
		}
		listener, err = ln.File()
		ln.Close()
		if err != nil {
			return err
		}
	}
	defer listener.Close()
	page := handed.Epoch
	if page == nil {
		ep, err := epoch.New()
		if err != nil {
			return err
		}
		page = os.NewFile(uintptr(ep.FD()), "epoch")
	}
	defer page.Close()
	exe, err := os.Executable()
	if err != nil {
		return fmt.Errorf("find this binary to run it as the serving process: %w", err)
	}
	store := o.FDStore || supervisor.StoreWanted()
	if store {
		passStoreMax()
	}
	sup := supervisor.New(supervisor.Config{
		Exe: exe, Args: os.Args[1:], Listener: listener, Epoch: page,
		Grace: o.Grace, Store: store, Log: log,
		// Under systemd, systemd restarts the service when the supervisor
		// dies (and its fd store keeps the segments): a supervisor the
		// serving process started would be killed with the unit's cgroup.
		Lock: lock, Heal: !store && os.Getenv("NOTIFY_SOCKET") == "",
	}, handed.State)
	log.Debug("supervising", "socket", path, "pid", os.Getpid(), "exe", exe, "fd_store", store)
	return supervise(ctx, sup, log, path, listener, store)
}

// supervise runs sup until the daemon stops, and removes the socket file
// then.
func supervise(ctx context.Context, sup *supervisor.Supervisor, log *slog.Logger, path string, listener *os.File, store bool) error {
	err := sup.Run(ctx)
	if errors.Is(err, supervisor.ErrHandover) {
		// The serving process lives on, with the socket, and starts
		// another supervisor.
		return err
	}
	var se *supervisor.StartError
	if errors.As(err, &se) {
		// The serving process said why on standard error.
		log.Debug("first serving process failed", "err", se.Err)
		err = ExitCode(se.Code)
	}
	if !store {
		// The socket goes with the daemon; under systemd's store it stays,
		// since the stored listener is bound to it.
		removeSocket(path, listener)
	}
	return err
}

// removeSocket removes the socket file if it is still the one listener is
// bound to.
func removeSocket(path string, listener *os.File) {
	st, err := os.Stat(path)
	if err != nil {
		return
	}
	var ls syscall.Stat_t
	if syscall.Stat(path, &ls) == nil && st.Mode()&os.ModeSocket != 0 {
		name, err := syscall.Getsockname(int(listener.Fd()))
		if sa, ok := name.(*syscall.SockaddrUnix); err == nil && ok && sa.Name == path {
			os.Remove(path)
		}
	}
}
