package wire

import (
	"errors"
	"syscall"
)

// codes are the errno names the protocol uses. docs/protocol.md lists what
// each means for each operation.
var codes = map[string]syscall.Errno{
	"ENOENT":       syscall.ENOENT,
	"EEXIST":       syscall.EEXIST,
	"EACCES":       syscall.EACCES,
	"EPERM":        syscall.EPERM,
	"EINVAL":       syscall.EINVAL,
	"ENAMETOOLONG": syscall.ENAMETOOLONG,
	"ENOMEM":       syscall.ENOMEM,
	"ENOSPC":       syscall.ENOSPC,
	"EBUSY":        syscall.EBUSY,
	"EAGAIN":       syscall.EAGAIN,
	"ETIMEDOUT":    syscall.ETIMEDOUT,
	"EMFILE":       syscall.EMFILE,
	"ENODEV":       syscall.ENODEV,
	"ENOSYS":       syscall.ENOSYS,
	"EOPNOTSUPP":   syscall.EOPNOTSUPP,
	"EPROTO":       syscall.EPROTO,
	"EBADF":        syscall.EBADF,
	"EIO":          syscall.EIO,
}

// Errno returns the errno for a protocol code, EIO for one it does not know.
func Errno(code string) syscall.Errno {
	if e, ok := codes[code]; ok {
		return e
	}
	return syscall.EIO
}

// Code returns the protocol code for an error: the name of the first
// syscall.Errno in its chain that the protocol knows, else "EIO".
func Code(err error) string {
	var e syscall.Errno
	if errors.As(err, &e) {
		for name, v := range codes {
			if v == e {
				return name
			}
		}
	}
	if errors.Is(err, ErrProto) {
		return "EPROTO"
	}
	return "EIO"
}

// Unwrap lets errors.Is(err, fs.ErrNotExist) and errors.Is(err,
// syscall.ENOENT) work on an Error received from the daemon.
func (e *Error) Unwrap() error { return Errno(e.Code) }
