package server

import (
	"errors"
	"fmt"
	"net"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// ErrRunning means a live daemon already answers on the socket.
var ErrRunning = errors.New("a daemon is already running")

// Listen binds a SOCK_SEQPACKET socket at path, creating its directory
// (socketDirMode) if it is not there. A socket file nobody answers on is stale and replaced; a live
// one is left alone and reported as ErrRunning. The socket is open to every
// local user (0666), or, with group not empty, to that group only (0660):
// either way each operation is authorized against the caller's credentials.
func Listen(path, group string) (*net.UnixListener, error) {
	gid := -1
	if group != "" {
		g, err := user.LookupGroup(group)
		if err != nil {
			return nil, fmt.Errorf("socket group: %w", err)
		}
		if gid, err = strconv.Atoi(g.Gid); err != nil {
			return nil, fmt.Errorf("socket group %q: gid %q", group, g.Gid)
		}
	}
	if err := os.MkdirAll(filepath.Dir(path), socketDirMode()); err != nil {
		return nil, fmt.Errorf("create socket directory: %w (create it for the daemon's user, or pick another --socket)", err)
	}
	if err := checkSocketDir(filepath.Dir(path)); err != nil {
		return nil, err
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
	mode := os.FileMode(0o666)
	if gid >= 0 {
		mode = 0o660
		if err := os.Chown(path, -1, gid); err != nil {
			ln.Close()
			os.Remove(path)
			return nil, fmt.Errorf("chown socket to group %s: %w", group, err)
		}
	}
	if err := os.Chmod(path, mode); err != nil {
		ln.Close()
		os.Remove(path)
		return nil, fmt.Errorf("chmod socket: %w", err)
	}
	return ln, nil
}

// socketDirMode is the mode of a socket directory the daemon makes: 0755
// for root, the node's daemon that every user reaches; else 0700, the
// daemon's user's alone. Clients use a user's own socket only in a
// directory of theirs that nobody else may write, and nobody else would
// talk to that daemon. A dedicated user serving the node listens in a
// directory made for it (0755, owned by that user), and its clients set
// GPUSHM_DAEMON_UID (docs/security.md, "Finding the daemon").
func socketDirMode() os.FileMode {
	if os.Geteuid() == 0 {
		return 0o755
	}
	return 0o700
}

// Lock takes the daemon lock for the socket at path: a file beside it
// (path + ".lock") held with flock(2) for as long as the returned file is
// open, and by the processes that inherit it. Two daemons started at once
// on one socket race here, not on the socket: the loser gets ErrRunning,
// with the winner's pid.
func Lock(path string) (*os.File, error) {
	if err := os.MkdirAll(filepath.Dir(path), socketDirMode()); err != nil {
		return nil, fmt.Errorf("create socket directory: %w (create it for the daemon's user, or pick another --socket)", err)
	}
	if err := checkSocketDir(filepath.Dir(path)); err != nil {
		return nil, err
	}
	f, err := os.OpenFile(path+".lock", os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, fmt.Errorf("daemon lock: %w", err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		b := make([]byte, 32)
		n, _ := f.ReadAt(b, 0)
		f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			pid := strings.TrimSpace(string(b[:n]))
			if pid == "" {
				pid = "unknown"
			}
			return nil, fmt.Errorf("%w on %s (pid %s holds %s.lock)", ErrRunning, path, pid, path)
		}
		return nil, fmt.Errorf("daemon lock %s.lock: %w", path, err)
	}
	f.Truncate(0)
	f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	return f, nil
}

// TakeLock takes over a daemon lock inherited from the process that held
// it (a serving process whose supervisor died passes it to the new one):
// the lock belongs to the open file, which both share, so it never went
// free. It checks that f holds the lock and writes this pid into it.
func TakeLock(f *os.File) error {
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		return fmt.Errorf("inherited daemon lock: %w", err)
	}
	if err := f.Truncate(0); err != nil {
		return fmt.Errorf("inherited daemon lock: %w", err)
	}
	_, err := f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	return err
}
