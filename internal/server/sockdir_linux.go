package server

import (
	"errors"
	"fmt"
	"os"
	"syscall"

	"golang.org/x/sys/unix"
)

// checkSocketDir refuses a socket directory the daemon cannot use, or one
// where somebody else could replace the socket with their own and so
// receive every client's requests (and the descriptors they publish).
func checkSocketDir(dir string) error {
	st, err := os.Stat(dir)
	if err != nil {
		return fmt.Errorf("socket directory: %w", err)
	}
	if !st.IsDir() {
		return fmt.Errorf("socket directory %s is not a directory", dir)
	}
	sys := st.Sys().(*syscall.Stat_t)
	mode := st.Mode()
	euid := os.Geteuid()
	switch err := unix.Faccessat(unix.AT_FDCWD, dir, unix.W_OK|unix.X_OK, unix.AT_EACCESS); {
	case errors.Is(err, unix.EROFS):
		return fmt.Errorf("socket directory %s is on a read-only file system", dir)
	case err != nil:
		return fmt.Errorf("socket directory %s (owner uid %d, mode %04o) is not writable by the daemon's uid %d: give it to that uid, or pick another --socket",
			dir, sys.Uid, mode.Perm(), euid)
	}
	if sys.Uid != 0 && int(sys.Uid) != euid {
		return fmt.Errorf("socket directory %s belongs to uid %d, who could replace the socket: give it to the daemon's uid %d or to root",
			dir, sys.Uid, euid)
	}
	if mode.Perm()&0o022 != 0 && mode&os.ModeSticky == 0 {
		return fmt.Errorf("socket directory %s (mode %04o) lets group or others replace the socket: chmod go-w it, or set the sticky bit",
			dir, mode.Perm())
	}
	return nil
}
