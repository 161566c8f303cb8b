package disk

import (
	"errors"

	"golang.org/x/sys/unix"
)

const oDirect = unix.O_DIRECT

// directAlign is the alignment of O_DIRECT offsets, lengths and buffers for
// the files of the directory fd: what statx says, and at least 4096, which
// serves devices of 512-byte and 4 KiB blocks alike. ok is false where the
// file system says it takes no O_DIRECT.
func directAlign(fd int) (align int64, ok bool) {
	var sx unix.Statx_t
	align = 4096
	if unix.Statx(fd, "", unix.AT_EMPTY_PATH, unix.STATX_DIOALIGN, &sx) == nil && sx.Mask&unix.STATX_DIOALIGN != 0 {
		if sx.Dio_offset_align == 0 || sx.Dio_mem_align == 0 {
			return 0, false
		}
		align = max(align, int64(sx.Dio_offset_align), int64(sx.Dio_mem_align))
	}
	return align, true
}

// reserve gives fd its n bytes of blocks before any is written, so that a
// full disk is found before the copy starts (ENOSPC) rather than in its
// middle. A file system that cannot (EOPNOTSUPP) is written as it comes.
func reserve(fd int, n int64) error {
	if n == 0 {
		return nil
	}
	err := unix.Fallocate(fd, 0, 0, n)
	if errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.ENOSYS) {
		return nil
	}
	return err
}

// directRefused says whether an open or a write failed because the file
// system takes no O_DIRECT.
func directRefused(err error) bool {
	return errors.Is(err, unix.EINVAL) || errors.Is(err, unix.EOPNOTSUPP)
}
