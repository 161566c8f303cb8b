// Package memfd gives what the daemon's packages do with a memfd (host
// memory as a file descriptor) beside making it: a descriptor of one
// that allows reading only. The server hands those to clients; the host
// backend makes memfds that keep them read-only.
package memfd

import (
	"fmt"
	"strconv"

	"golang.org/x/sys/unix"
)

// ReadOnly returns a new descriptor of the memfd fd that allows reading
// only: a new open file description, opened O_RDONLY through
// /proc/self/fd, which the kernel refuses to map writable (mmap with
// PROT_WRITE and MAP_SHARED) or write (write, pwrite, fallocate,
// ftruncate), where a copy of fd would allow both. The caller closes it.
func ReadOnly(fd int) (int, error) {
	ro, err := unix.Open("/proc/self/fd/"+strconv.Itoa(fd), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("a read-only descriptor of memfd %d (through /proc/self/fd): %w", fd, err)
	}
	return ro, nil
}
