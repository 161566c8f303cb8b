package bench

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm/internal/wire"
)

// The floor of a round trip: a bare SOCK_SEQPACKET echo server, in a
// process of its own as the daemon is, that answers each packet with a
// reply of an open's size carrying a descriptor, as an open's does. What
// the daemon adds to that is its own: decoding, the registry, its threads.
//
// Three servers: the two ways Go code serves a socket, and the daemon's
// wait alone:
//
//	blocking  a goroutine per connection in a blocking recvmsg: the kernel
//	          wakes that thread itself
//	net       net.UnixConn, through Go's network poller
//	poll      the daemon's wait for a busy connection's next request,
//	          without its spin: ppoll on the socket and a wake eventfd,
//	          then recvmsg (what the daemon adds to blocking for being
//	          able to stop a connection between requests)
const (
	// echoRequest and echoReply are the sizes of an open's request and
	// reply as the client and daemon encode them (a name of a few bytes,
	// the segment's description and trace in the reply), rounded up.
	echoRequest = 128
	echoReply   = 640
)

// echoModes are the echo servers bench open runs, in its table's order.
var echoModes = []string{"blocking", "net", "poll"}

func echoChildCmd() *cobra.Command {
	var listen, mode string
	cmd := &cobra.Command{
		Use: "echo",
		RunE: func(cmd *cobra.Command, _ []string) error {
			return serveEcho(listen, mode)
		},
	}
	cmd.Flags().StringVar(&listen, "listen", "", "socket path")
	cmd.Flags().StringVar(&mode, "mode", "blocking", "blocking, net or poll")
	return cmd
}

// serveEcho listens on path, says "ready" on stdout, and serves until its
// stdin closes (the parent went away or is done).
func serveEcho(path, mode string) error {
	fd, err := unix.MemfdCreate("gpushm-echo", unix.MFD_CLOEXEC)
	if err != nil {
		return err
	}
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		return err
	}
	defer ln.Close()
	go func() {
		io.Copy(io.Discard, os.Stdin)
		ln.Close()
	}()
	// The poll server's wake descriptor, never written, as a worker's
	// nudge is not between requests.
	wake := -1
	if mode == "poll" {
		if wake, err = unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK); err != nil {
			return os.NewSyscallError("eventfd", err)
		}
	}
	reply := make([]byte, echoReply)
	fmt.Println("ready")
	for {
		uc, err := ln.AcceptUnix()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return nil
			}
			return err
		}
		switch mode {
		case "net":
			go echoNet(uc, reply, fd)
		default:
			c, err := wire.FromUnixConn(uc)
			if err != nil {
				return err
			}
			if mode == "poll" {
				c.SetWake(wake)
			}
			go echoBlocking(c, reply, fd)
		}
	}
}

func echoBlocking(c *wire.Conn, reply []byte, fd int) {
	defer c.Close()
	for {
		if _, _, err := c.Recv(); err != nil {
			return
		}
		if err := c.Send(reply, fd); err != nil {
			return
		}
	}
}

func echoNet(uc *net.UnixConn, reply []byte, fd int) {
	defer uc.Close()
	buf := make([]byte, wire.MaxMessage)
	oob := make([]byte, unix.CmsgSpace(4))
	rights := unix.UnixRights(fd)
	for {
		if _, _, _, _, err := uc.ReadMsgUnix(buf, oob); err != nil {
			return
		}
		if _, _, err := uc.WriteMsgUnix(reply, rights, nil); err != nil {
			return
		}
	}
}

// echoServer is a running echo child.
type echoServer struct {
	mode, socket string
	cmd          *exec.Cmd
	stdin        io.Closer
}

// startEcho starts an echo server of mode on a socket in dir.
func startEcho(ctx context.Context, dir, mode string) (*echoServer, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	e := &echoServer{mode: mode, socket: filepath.Join(dir, "echo-"+mode+".sock")}
	e.cmd = exec.CommandContext(ctx, self, "__child", "echo", "--listen", e.socket, "--mode", mode)
	e.cmd.Stderr = os.Stderr
	in, err := e.cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	out, err := e.cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := e.cmd.Start(); err != nil {
		return nil, fmt.Errorf("start echo server: %w", err)
	}
	e.stdin = in
	line, err := bufio.NewReader(out).ReadString('\n')
	if strings.TrimSpace(line) != "ready" {
		e.stop()
		return nil, fmt.Errorf("echo server (%s) did not start: %q %v", mode, line, err)
	}
	return e, nil
}

func (e *echoServer) stop() {
	e.stdin.Close()
	done := make(chan struct{})
	go func() { e.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		e.cmd.Process.Kill()
		<-done
	}
}

// echoClient is the client end of a round trip to an echo server, with
// the gpushm client's transport (its spin included).
type echoClient struct {
	c   *wire.Conn
	req []byte
}

func dialEcho(socket string, spin time.Duration) (*echoClient, error) {
	c, err := wire.Dial(socket)
	if err != nil {
		return nil, err
	}
	c.SetSpin(spin)
	return &echoClient{c: c, req: make([]byte, echoRequest)}, nil
}

// roundTrip sends a request and waits for the reply, closing the
// descriptor it brings as a client would once it has mapped it.
func (e *echoClient) roundTrip() (time.Duration, error) {
	t := time.Now()
	if err := e.c.Send(e.req, -1); err != nil {
		return 0, err
	}
	b, fd, err := e.c.Recv()
	d := time.Since(t)
	if err != nil {
		return 0, err
	}
	if fd < 0 || len(b) != echoReply {
		return 0, fmt.Errorf("echo: reply of %d bytes, descriptor %d", len(b), fd)
	}
	unix.Close(fd)
	return d, nil
}
