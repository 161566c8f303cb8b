package wire

import (
	"fmt"
	"io"
	"net"
	"os"

	"golang.org/x/sys/unix"
)

// Conn is one end of a SOCK_SEQPACKET connection. It is not safe for
// concurrent Recv calls or concurrent Send calls.
type Conn struct {
	c   *net.UnixConn
	buf []byte
	oob []byte
}

// NewConn wraps a connected "unixpacket" socket.
func NewConn(c *net.UnixConn) *Conn {
	return &Conn{
		c:   c,
		buf: make([]byte, MaxMessage+1),
		oob: make([]byte, unix.CmsgSpace(4*4)),
	}
}

// Dial connects to a daemon's socket.
func Dial(path string) (*Conn, error) {
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		return nil, err
	}
	return NewConn(c), nil
}

// Close closes the socket.
func (c *Conn) Close() error { return c.c.Close() }

// UnixConn is the underlying socket.
func (c *Conn) UnixConn() *net.UnixConn { return c.c }

// Send writes one packet with an optional descriptor (fd < 0 for none).
func (c *Conn) Send(b []byte, fd int) error {
	var oob []byte
	if fd >= 0 {
		oob = unix.UnixRights(fd)
	}
	n, oobn, err := c.c.WriteMsgUnix(b, oob, nil)
	if err != nil {
		return err
	}
	if n != len(b) || oobn != len(oob) {
		return fmt.Errorf("short write: %d of %d bytes", n, len(b))
	}
	return nil
}

// Recv reads one packet. The returned slice is valid until the next Recv.
// fd is -1 when the packet carried no descriptor. A packet over MaxMessage
// bytes, or one carrying more than one descriptor, is consumed whole (its
// descriptors closed) and reported as an error wrapping ErrProto; the
// connection stays usable. io.EOF means the peer hung up.
func (c *Conn) Recv() (b []byte, fd int, err error) {
	n, oobn, flags, _, err := c.c.ReadMsgUnix(c.buf, c.oob)
	if err != nil {
		return nil, -1, err
	}
	if n == 0 && oobn == 0 {
		return nil, -1, io.EOF
	}
	fds, perr := parseRights(c.oob[:oobn])
	if flags&unix.MSG_CTRUNC != 0 && flags&unix.MSG_TRUNC == 0 {
		// The kernel dropped descriptors we had no room for, most likely
		// because this process is out of them; the message itself is whole,
		// so hand it back: the caller may owe the peer a close.
		closeAll(fds)
		return c.buf[:n], -1, ErrFDDropped
	}
	if perr != nil || len(fds) > 1 {
		closeAll(fds)
		return nil, -1, fmt.Errorf("%w: at most one file descriptor per message", ErrProto)
	}
	fd = -1
	if len(fds) == 1 {
		fd = fds[0]
	}
	if flags&unix.MSG_TRUNC != 0 || n > MaxMessage {
		if fd >= 0 {
			unix.Close(fd)
		}
		return nil, -1, fmt.Errorf("%w: message exceeds %d bytes", ErrProto, MaxMessage)
	}
	return c.buf[:n], fd, nil
}

func parseRights(oob []byte) ([]int, error) {
	if len(oob) == 0 {
		return nil, nil
	}
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, err
	}
	var fds []int
	for _, m := range msgs {
		if m.Header.Level != unix.SOL_SOCKET || m.Header.Type != unix.SCM_RIGHTS {
			continue
		}
		got, err := unix.ParseUnixRights(&m)
		if err != nil {
			closeAll(fds)
			return nil, err
		}
		fds = append(fds, got...)
	}
	return fds, nil
}

func closeAll(fds []int) {
	for _, fd := range fds {
		unix.Close(fd)
	}
}

// ErrFDDropped is returned with a whole message whose descriptor the kernel
// could not deliver.
var ErrFDDropped = fmt.Errorf("file descriptor dropped in transit (out of descriptors? raise 'ulimit -n'): %w", unix.EMFILE)

// Cred is the identity of the process at the other end, from SO_PEERCRED.
type Cred struct {
	UID, GID uint32
	PID      int32
}

// PeerCred reads SO_PEERCRED: the credentials of the peer when it connected.
func (c *Conn) PeerCred() (Cred, error) {
	raw, err := c.c.SyscallConn()
	if err != nil {
		return Cred{}, err
	}
	var uc *unix.Ucred
	var serr error
	if err := raw.Control(func(fd uintptr) {
		uc, serr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return Cred{}, err
	}
	if serr != nil {
		return Cred{}, os.NewSyscallError("getsockopt SO_PEERCRED", serr)
	}
	return Cred{UID: uc.Uid, GID: uc.Gid, PID: uc.Pid}, nil
}
