package wire

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Conn is one end of a SOCK_SEQPACKET connection. It is not safe for
// concurrent Recv calls or concurrent Send calls.
//
// The socket is in blocking mode and Send and Recv are plain system calls:
// a thread blocked in recvmsg is woken by the kernel itself, where Go's
// network poller would add two scheduler hand-offs to every round trip
// (measured: about half of a host-memory open). The price is an OS thread
// per connection while it waits: a client can afford one; a server reads
// only connections that are busy this way and watches idle ones with epoll.
type Conn struct {
	fd        int
	closeOnce sync.Once
	closeErr  error
	closed    atomic.Bool
	buf       *[]byte // the receive buffer; from bufPool unless ownBuf
	ownBuf    bool    // buf is SetMaxMessage's, not the pool's
	oob       []byte
	spin      time.Duration
	timeout   time.Duration
	drain     bool // SetDrain
	pollOnly  bool // Poll: return ErrNothing when the spin ends
	batch     time.Duration
	waited    bool // the last Recv slept in the kernel (SetBatch)
	// pfds are what Recv polls: the socket, then the wake descriptors.
	pfds  [1 + maxWake]unix.PollFd
	nwake int
}

// maxWake is how many wake descriptors a Conn takes.
const maxWake = 2

// bufPool holds receive buffers: a connection needs one only while it
// reads, and a server with thousands of idle connections gives theirs back
// (Conn.ReleaseBuffer).
var bufPool = sync.Pool{New: func() any {
	b := make([]byte, MaxMessage+1)
	return &b
}}

// ErrWouldBlock is TrySend's answer when the peer's receive queue is full:
// nothing was sent.
var ErrWouldBlock = fmt.Errorf("peer is not reading: %w", unix.EAGAIN)

// ErrWoken is Recv's answer when the wake descriptor became readable
// before a message arrived: no message was consumed.
var ErrWoken = errors.New("woken")

// SetWake makes Recv return ErrWoken, without consuming a message, once
// one of fds (eventfds, say; at most two) is readable; it replaces the
// last call's. A server uses it to stop a connection between requests: to
// hand it to another process, or to let it go idle.
func (c *Conn) SetWake(fds ...int) {
	if len(fds) > maxWake {
		panic("wire: more than two wake descriptors")
	}
	for i, fd := range fds {
		c.pfds[1+i] = unix.PollFd{Fd: int32(fd), Events: unix.POLLIN}
	}
	c.nwake = len(fds)
}

// SetMaxMessage sets the largest packet Recv accepts (MaxMessage unless
// set), for a connection that is not the client protocol's. Call it before
// the first Recv.
func (c *Conn) SetMaxMessage(n int) {
	b := make([]byte, n+1)
	c.buf, c.ownBuf = &b, true
}

// SetDrain makes Recv deliver every message the peer sent before it
// closed. A peer that closes while messages to it are still unread in its
// own queue makes the kernel report ECONNRESET once, ahead of the messages
// it had sent, which stay queued here; Recv otherwise ends the connection
// there as at EOF, and those messages are never read. With drain set it
// reads on, and reports EOF once they are all read. It is for a
// connection whose every message counts whether or not its sender lived
// to see an answer: a journal, such as the supervisor's control socket.
func (c *Conn) SetDrain(on bool) { c.drain = on }

// SetSpin makes Recv poll without blocking for up to d before it sleeps in
// the kernel. A reply that arrives within d is then seen without a wake-up
// of a sleeping thread, which on virtual machines costs tens of
// microseconds (an inter-processor interrupt and a VM exit); the price is a
// busy core for at most d per Recv.
func (c *Conn) SetSpin(d time.Duration) { c.spin = d }

// Poll is Recv that polls without blocking for up to d and then, instead
// of sleeping, returns ErrNothing: a caller that counts its pollers knows
// when one stops.
func (c *Conn) Poll(d time.Duration) (b []byte, fd int, err error) {
	spin := c.spin
	c.spin, c.pollOnly = max(d, 1), true // one look at least
	defer func() { c.spin, c.pollOnly = spin, false }()
	return c.Recv()
}

// ErrNothing is Poll's answer when no message came within its time: none
// was consumed.
var ErrNothing = errors.New("no message")

// SetBatch makes a Recv that follows one that slept in the kernel wait d
// first, and then read what came meanwhile without sleeping: a burst of
// messages costs the reader one wake-up, not one each. It is for a
// reader whose sender must not pay for its wake-ups: a sendmsg to a
// socket nobody sleeps on wakes nobody, while waking a thread costs the
// sender a few microseconds (on a virtual machine an inter-processor
// interrupt and a VM exit; 9 of an open's 15 us on a 2-core VM). The
// price is up to d of latency for each message after the first of a
// burst.
func (c *Conn) SetBatch(d time.Duration) { c.batch = d }

// ReleaseBuffer gives the receive buffer back to a pool shared by every
// Conn; the next Recv takes one again. The slice the last Recv returned is
// invalid from now on. A server calls it for connections going idle.
func (c *Conn) ReleaseBuffer() {
	if c.buf != nil && !c.ownBuf {
		bufPool.Put(c.buf)
		c.buf = nil
	}
}

// NewConn takes ownership of a connected SOCK_SEQPACKET socket and puts it
// in blocking mode.
func NewConn(fd int) (*Conn, error) {
	if err := unix.SetNonblock(fd, false); err != nil {
		return nil, os.NewSyscallError("fcntl", err)
	}
	c := &Conn{
		fd:  fd,
		oob: make([]byte, unix.CmsgSpace(4*4)),
	}
	c.pfds[0] = unix.PollFd{Fd: int32(fd), Events: unix.POLLIN}
	return c, nil
}

// FromUnixConn takes over an accepted connection: the descriptor moves out
// of Go's network poller into a Conn, and uc is closed.
func FromUnixConn(uc *net.UnixConn) (*Conn, error) {
	defer uc.Close()
	raw, err := uc.SyscallConn()
	if err != nil {
		return nil, err
	}
	fd := -1
	var derr error
	if err := raw.Control(func(s uintptr) { fd, derr = unix.FcntlInt(s, unix.F_DUPFD_CLOEXEC, 0) }); err != nil {
		return nil, err
	}
	if derr != nil {
		return nil, os.NewSyscallError("dup", derr)
	}
	c, err := NewConn(fd)
	if err != nil {
		unix.Close(fd)
		return nil, err
	}
	return c, nil
}

// Dial connects to a daemon's socket.
func Dial(path string) (*Conn, error) { return DialTimeout(path, 0) }

// DialTimeout is Dial with every wait bounded by d (0: none), as after
// SetTimeout; the connect too, which waits while the daemon's backlog of
// connections is full.
func DialTimeout(path string, d time.Duration) (*Conn, error) {
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, os.NewSyscallError("socket", err)
	}
	c, err := NewConn(fd)
	if err != nil {
		unix.Close(fd)
		return nil, err
	}
	if err := c.SetTimeout(d); err != nil {
		c.Close()
		return nil, err
	}
	for {
		err = unix.Connect(fd, &unix.SockaddrUnix{Name: path})
		if err != unix.EINTR {
			break
		}
	}
	if err == unix.EAGAIN && d > 0 {
		err = fmt.Errorf("the daemon accepted no connection within %s: %w", d, os.ErrDeadlineExceeded)
	}
	if err != nil {
		c.Close()
		return nil, &net.OpError{Op: "dial", Net: "unixpacket", Addr: &net.UnixAddr{Name: path, Net: "unixpacket"}, Err: os.NewSyscallError("connect", err)}
	}
	return c, nil
}

// Shutdown wakes any Send or Recv blocked on the connection and makes all
// later ones fail; the descriptor stays open until Close, so it cannot be
// reused under a call still in flight.
func (c *Conn) Shutdown() error {
	return unix.Shutdown(c.fd, unix.SHUT_RDWR)
}

// Close shuts the connection down and closes the descriptor. Call it only
// when no Send or Recv is in flight (use Shutdown to end those first).
func (c *Conn) Close() error {
	c.closeOnce.Do(func() {
		c.closed.Store(true)
		unix.Shutdown(c.fd, unix.SHUT_RDWR)
		c.closeErr = unix.Close(c.fd)
	})
	return c.closeErr
}

// HungUp reports, without waiting, whether the peer closed the connection
// (or it was closed here).
func (c *Conn) HungUp() bool {
	if c.closed.Load() {
		return true
	}
	fds := []unix.PollFd{{Fd: int32(c.fd), Events: unix.POLLIN | unix.POLLRDHUP}}
	for {
		_, err := unix.Poll(fds, 0)
		if err == unix.EINTR {
			continue
		}
		return err != nil || fds[0].Revents&(unix.POLLHUP|unix.POLLRDHUP|unix.POLLERR) != 0
	}
}

// Send writes one packet with an optional descriptor (fd < 0 for none),
// waiting while the peer's receive queue is full.
func (c *Conn) Send(b []byte, fd int) error { return c.send(b, fd, 0) }

// TrySend is Send without the wait: when the peer's receive queue is full
// it sends nothing and returns ErrWouldBlock. A server uses it so that a
// client that does not read its replies cannot hold a thread.
func (c *Conn) TrySend(b []byte, fd int) error { return c.send(b, fd, unix.MSG_DONTWAIT) }

func (c *Conn) send(b []byte, fd int, flags int) error {
	var oob []byte
	if fd >= 0 {
		oob = unix.UnixRights(fd)
	}
	for {
		n, err := unix.SendmsgN(c.fd, b, oob, nil, unix.MSG_NOSIGNAL|flags)
		if err == unix.EINTR {
			continue
		}
		if err == unix.EAGAIN && flags&unix.MSG_DONTWAIT != 0 {
			return ErrWouldBlock
		}
		if err == unix.EAGAIN && c.timeout > 0 {
			return fmt.Errorf("sendmsg: %w", os.ErrDeadlineExceeded)
		}
		if err != nil {
			return os.NewSyscallError("sendmsg", err)
		}
		if n != len(b) {
			return fmt.Errorf("short write: %d of %d bytes", n, len(b))
		}
		return nil
	}
}

// Recv reads one packet. The returned slice is valid until the next Recv.
// fd is -1 when the packet carried no descriptor. A packet over MaxMessage
// bytes (or what SetMaxMessage set), or one carrying more than one
// descriptor, is consumed whole (its descriptors closed) and reported as an
// error wrapping ErrProto, with as much of the packet as was read (so that
// a server can still find its id); the connection stays usable. io.EOF
// means the peer hung up (or Shutdown; see SetDrain for a peer that hung
// up on messages it had not read). With a timeout set (SetTimeout), a
// wait that outlasts it is an error wrapping os.ErrDeadlineExceeded.
func (c *Conn) Recv() (b []byte, fd int, err error) {
	if c.buf == nil {
		c.buf = bufPool.Get().(*[]byte)
	}
	buf := *c.buf
	var n, oobn, flags int
	block := unix.MSG_DONTWAIT
	var deadline time.Time
	if c.spin > 0 {
		deadline = time.Now().Add(c.spin)
	} else {
		block = 0
	}
	reset := false
	if c.batch > 0 && block == 0 && c.nwake == 0 {
		if c.waited {
			time.Sleep(c.batch)
		}
		// Whatever is queued is read without sleeping; only a read that
		// finds nothing sleeps, and makes the next one wait first.
		c.waited = false
		block = unix.MSG_DONTWAIT
		deadline = time.Time{}
	}
	for {
		if block == 0 && c.nwake > 0 {
			woken, perr := c.waitReadable()
			if perr != nil {
				return nil, -1, perr
			}
			if woken {
				return nil, -1, ErrWoken
			}
			n, oobn, flags, err = recvmsg(c.fd, buf, c.oob, unix.MSG_CMSG_CLOEXEC|unix.MSG_DONTWAIT)
			if err == unix.EAGAIN {
				continue
			}
		} else {
			n, oobn, flags, err = recvmsg(c.fd, buf, c.oob, unix.MSG_CMSG_CLOEXEC|block)
			if err == unix.EAGAIN && block != 0 {
				if time.Now().After(deadline) {
					if c.pollOnly {
						return nil, -1, ErrNothing
					}
					block = 0
					c.waited = c.batch > 0
				}
				continue
			}
		}
		if err == unix.ECONNRESET && c.drain && !reset {
			// The peer closed with our messages unread: the kernel says so
			// once (the error is cleared as it is reported), and what the
			// peer sent before it closed is still queued, then EOF.
			reset = true
			continue
		}
		if err != unix.EINTR {
			break
		}
	}
	if err != nil {
		if errors.Is(err, unix.ECONNRESET) {
			return nil, -1, io.EOF
		}
		if err == unix.EAGAIN && c.timeout > 0 {
			return nil, -1, fmt.Errorf("recvmsg: %w", os.ErrDeadlineExceeded)
		}
		return nil, -1, os.NewSyscallError("recvmsg", err)
	}
	if n == 0 && oobn == 0 {
		return nil, -1, io.EOF
	}
	b = buf[:min(n, len(buf))]
	fds, perr := parseRights(c.oob[:oobn])
	if flags&unix.MSG_CTRUNC != 0 && flags&unix.MSG_TRUNC == 0 && perr == nil && len(fds) < maxFDs(len(c.oob)) {
		// The kernel dropped descriptors although there was room for
		// them: this process is out of descriptors. The message itself is
		// whole, so hand it back: the caller may owe the peer a close.
		// (When there was no room, the packet carried more descriptors
		// than fit, which is a protocol error, below.)
		closeAll(fds)
		return b, -1, ErrFDDropped
	}
	if perr != nil || len(fds) > 1 || flags&unix.MSG_CTRUNC != 0 {
		closeAll(fds)
		return b, -1, fmt.Errorf("%w: at most one file descriptor per message", ErrProto)
	}
	fd = -1
	if len(fds) == 1 {
		fd = fds[0]
	}
	if max := len(buf) - 1; flags&unix.MSG_TRUNC != 0 || n > max {
		if fd >= 0 {
			unix.Close(fd)
		}
		return b, -1, fmt.Errorf("%w: message exceeds %d bytes", ErrProto, max)
	}
	return b, fd, nil
}

// maxFDs is how many descriptors a control buffer of n bytes holds: the
// kernel delivers that many of a packet's and drops the rest.
func maxFDs(n int) int { return (n - unix.CmsgLen(0)) / 4 }

// SetTimeout bounds every wait of Send and Recv on a blocking socket (0:
// none): a wait that outlasts d fails with an error wrapping
// os.ErrDeadlineExceeded. A client sets it so that a daemon that never
// answers cannot hang it; the socket timeouts it sets cost nothing per
// message.
func (c *Conn) SetTimeout(d time.Duration) error {
	tv := unix.NsecToTimeval(d.Nanoseconds())
	if d > 0 && tv.Sec == 0 && tv.Usec == 0 {
		tv.Usec = 1 // a zero timeval would mean "no timeout"
	}
	for _, opt := range []int{unix.SO_RCVTIMEO, unix.SO_SNDTIMEO} {
		if err := unix.SetsockoptTimeval(c.fd, unix.SOL_SOCKET, opt, &tv); err != nil {
			return os.NewSyscallError("setsockopt", err)
		}
	}
	c.timeout = d
	return nil
}

// waitReadable blocks until the socket or a wake descriptor is readable
// (or hung up), and reports whether a wake descriptor is.
//
// It waits without a timeout on purpose: on a virtual machine, arming and
// cancelling the kernel timer of a timed wait costs a few microseconds a
// round trip (measured: 19 us became 25 us). A server that wants a
// connection back after a while writes a wake descriptor instead.
func (c *Conn) waitReadable() (woken bool, err error) {
	fds := c.pfds[:1+c.nwake]
	for {
		_, err := unix.Poll(fds, -1)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return false, os.NewSyscallError("poll", err)
		}
		for _, p := range fds[1:] {
			if p.Revents != 0 {
				return true, nil
			}
		}
		return false, nil
	}
}

// recvmsg is unix.Recvmsg without the sender's address, which that makes
// anew on every call (the peer of a connected socket is known): every
// request would otherwise leave garbage behind.
func recvmsg(fd int, p, oob []byte, flags int) (n, oobn, recvflags int, err error) {
	iov := unix.Iovec{Base: &p[0]}
	iov.SetLen(len(p))
	msg := unix.Msghdr{Iov: &iov}
	msg.SetIovlen(1)
	if len(oob) > 0 {
		msg.Control = &oob[0]
		msg.SetControllen(len(oob))
	}
	r, _, e := unix.Syscall(unix.SYS_RECVMSG, uintptr(fd), uintptr(unsafe.Pointer(&msg)), uintptr(flags))
	if e != 0 {
		return 0, 0, 0, e
	}
	return int(r), int(msg.Controllen), int(msg.Flags), nil
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
	uc, err := unix.GetsockoptUcred(c.fd, unix.SOL_SOCKET, unix.SO_PEERCRED)
	if err != nil {
		return Cred{}, os.NewSyscallError("getsockopt SO_PEERCRED", err)
	}
	return Cred{UID: uc.Uid, GID: uc.Gid, PID: uc.Pid}, nil
}

// ErrNoPeerPidfd: the kernel has no SO_PEERPIDFD (before Linux 6.5).
var ErrNoPeerPidfd = errors.New("SO_PEERPIDFD not supported (Linux 6.5 or later has it)")

// PeerPidfd reads SO_PEERPIDFD: a pidfd of the process that connected,
// the one SO_PEERCRED names, even if that pid names another process now.
// The caller owns it (close-on-exec, blocking). It fails with
// ErrNoPeerPidfd where the kernel does not know the option; a peer that
// was reaped may give an error (older kernels) or a pidfd of an exited
// process (newer ones).
func (c *Conn) PeerPidfd() (int, error) {
	fd, err := unix.GetsockoptInt(c.fd, unix.SOL_SOCKET, unix.SO_PEERPIDFD)
	if errors.Is(err, unix.ENOPROTOOPT) {
		return -1, ErrNoPeerPidfd
	}
	if err != nil {
		return -1, os.NewSyscallError("getsockopt SO_PEERPIDFD", err)
	}
	return fd, nil
}

// FD is the connection's socket, for handing it to another process (the
// receiver gets its own descriptor; this one stays the Conn's).
func (c *Conn) FD() int { return c.fd }
