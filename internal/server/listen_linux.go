package server

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"syscall"
	"time"
)

// ErrRunning means a live daemon already answers on the socket.
var ErrRunning = errors.New("a daemon is already running")

// Listen binds a SOCK_SEQPACKET socket at path, creating its directory. A
// socket file nobody answers on is stale and replaced; a live one is left
// alone and reported as ErrRunning.
func Listen(path string) (*net.UnixListener, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, fmt.Errorf("create socket directory: %w", err)
	}
	if _, err := os.Lstat(path); err == nil {
		c, err := net.DialTimeout("unixpacket", path, time.Second)
		if err == nil {
			c.Close()
			return nil, fmt.Errorf("%w on %s", ErrRunning, path)
		}
		if !errors.Is(err, syscall.ECONNREFUSED) {
			return nil, fmt.Errorf("probe existing socket %s: %w", path, err)
		}
		if err := os.Remove(path); err != nil {
			return nil, fmt.Errorf("remove stale socket: %w", err)
		}
	}
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", path, err)
	}
	// Removing the file on Close would race with a successor daemon that
	// already replaced it; Serve removes it itself, only if it is still ours.
	ln.SetUnlinkOnClose(false)
	// Every local user may connect; each operation is authorized against the
	// peer's credentials.
	if err := os.Chmod(path, 0o666); err != nil {
		ln.Close()
		return nil, fmt.Errorf("chmod socket: %w", err)
	}
	return ln, nil
}
