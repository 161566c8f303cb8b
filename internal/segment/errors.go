package segment

import "syscall"

// Sentinel errors. Each unwraps to the errno that the wire protocol reports,
// so callers can test either.
var (
	ErrNotFound   = &Error{"no such segment", syscall.ENOENT}
	ErrExist      = &Error{"segment exists", syscall.EEXIST}
	ErrPermission = &Error{"permission denied", syscall.EACCES}
	ErrNotOwner   = &Error{"operation not permitted: not the owner", syscall.EPERM}
	ErrBadName    = &Error{"invalid name", syscall.EINVAL}
	ErrNameLong   = &Error{"name too long", syscall.ENAMETOOLONG}
	ErrBadSize    = &Error{"invalid size", syscall.EINVAL}
	ErrBadMode    = &Error{"invalid mode", syscall.EINVAL}
	ErrBadMeta    = &Error{"invalid metadata", syscall.EINVAL}
	ErrBadOption  = &Error{"invalid options", syscall.EINVAL}
	ErrBadOwner   = &Error{"invalid owner", syscall.EINVAL}
	ErrNoDevice   = &Error{"no such device", syscall.ENODEV}
	ErrClosed     = &Error{"registry closed", syscall.EIO}
	// ErrEmpty: a segment created empty (AllowEmpty) has no memory to open
	// until it is written or resized.
	ErrEmpty = &Error{"segment is empty", syscall.EINVAL}
	// ErrBusy: the size of a segment cannot change while a lease holder may
	// have it mapped.
	ErrBusy = &Error{"segment is open", syscall.EBUSY}
	// ErrNoData: the backend's memory cannot be read or written by the
	// daemon itself.
	ErrNoData = &Error{"memory not accessible to the daemon", syscall.EOPNOTSUPP}
)

// Error is a registry error with the errno it stands for.
type Error struct {
	msg   string
	errno syscall.Errno
}

func (e *Error) Error() string { return e.msg }
func (e *Error) Unwrap() error { return e.errno }
