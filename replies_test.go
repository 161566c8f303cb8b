package gpushm_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/epoch"
	"github.com/gpushm/gpushm/internal/testdaemon"
	"github.com/gpushm/gpushm/internal/wire"
)

// fakeDaemon listens on a socket and hands the one connection it accepts,
// after answering its hello, to serve. It stands for daemons that this
// project's daemon is not (an older one, a stuck one), which a client must
// survive all the same.
func fakeDaemon(t *testing.T, serve func(c *wire.Conn)) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "fake.sock")
	ln, err := unix.Socket(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Bind(ln, &unix.SockaddrUnix{Name: path}); err != nil {
		t.Fatal(err)
	}
	if err := unix.Listen(ln, 1); err != nil {
		t.Fatal(err)
	}
	page, err := epoch.New()
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	t.Cleanup(func() {
		unix.Shutdown(ln, unix.SHUT_RDWR)
		<-done
		unix.Close(ln)
		page.Close()
	})
	go func() {
		defer close(done)
		fd, _, err := unix.Accept4(ln, unix.SOCK_CLOEXEC)
		if err != nil {
			return // the test ended first
		}
		c, err := wire.NewConn(fd)
		if err != nil {
			unix.Close(fd)
			return
		}
		defer c.Close()
		b, _, err := c.Recv()
		if err != nil {
			return
		}
		req, err := wire.DecodeRequest(b)
		if err != nil || req.Op != wire.OpHello {
			return
		}
		rep, _ := wire.Encode(&wire.Reply{ID: req.ID, Version: wire.Version, Backend: "host", Epoch: true})
		if c.Send(rep, page.FD()) != nil {
			return
		}
		serve(c)
	}()
	return path
}

func TestClientGivesUpOnADaemonThatDoesNotAnswer(t *testing.T) {
	hold := make(chan struct{})
	defer close(hold)
	socket := fakeDaemon(t, func(c *wire.Conn) {
		c.Recv() // and never answer
		<-hold
	})
	t.Setenv("GPUSHM_TIMEOUT", "200ms")
	c, err := gpushm.Dial(context.Background(), socket)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	start := time.Now()
	_, err = c.Stat(context.Background(), "x")
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("Stat from a daemon that never answers = %v, want a timeout", err)
	}
	if d := time.Since(start); d < 200*time.Millisecond {
		t.Fatalf("gave up after %s, before the timeout", d)
	}
	// The reply stream cannot be trusted after that: the client says so.
	if _, err := c.Stat(context.Background(), "x"); err == nil {
		t.Fatal("a client that timed out answered the next request")
	}
}

func TestClientTakesAnErrorWithIDZeroAsItsAnswer(t *testing.T) {
	socket := fakeDaemon(t, func(c *wire.Conn) {
		// An older daemon that cannot read the first request's id answers
		// with 0; the second request gets a proper answer.
		if _, _, err := c.Recv(); err != nil {
			return
		}
		rep, _ := wire.Encode(&wire.Reply{ID: 0, Error: &wire.Error{Code: "EPROTO", Message: "unknown field"}})
		if c.Send(rep, -1) != nil {
			return
		}
		b, _, err := c.Recv()
		if err != nil {
			return
		}
		req, err := wire.DecodeRequest(b)
		if err != nil {
			return
		}
		rep, _ = wire.Encode(&wire.Reply{ID: req.ID, Error: &wire.Error{Code: "ENOENT", Message: "no such segment"}})
		c.Send(rep, -1)
		c.Recv() // until the client hangs up
	})
	// No timeout: only recognising the reply can end the wait.
	t.Setenv("GPUSHM_TIMEOUT", "0")
	c, err := gpushm.Dial(context.Background(), socket)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := c.Stat(ctx, "x"); !errors.Is(err, syscall.EPROTO) {
		t.Fatalf("Stat answered with id 0 = %v, want EPROTO", err)
	}
	// The connection is in step: the next reply is the next request's.
	if _, err := c.Stat(ctx, "y"); !errors.Is(err, syscall.ENOENT) {
		t.Fatalf("next Stat = %v, want ENOENT", err)
	}
}

func TestClientWaitsPastItsTimeoutForACommit(t *testing.T) {
	d := testdaemon.Start(t, "host")
	ctx := context.Background()
	w := dial(t, d.Socket)
	r := dial(t, d.Socket)
	if err := r.SetTimeout(300 * time.Millisecond); err != nil {
		t.Fatal(err)
	}
	seg, err := w.Create(ctx, "late", 4096, &gpushm.CreateOptions{Uncommitted: true})
	if err != nil {
		t.Fatal(err)
	}
	defer seg.Close()
	// The daemon answers an open that waits when the wait ends: the
	// reader's timeout must start after it.
	committed := make(chan error, 1)
	time.AfterFunc(time.Second, func() { committed <- seg.Commit(ctx) })
	got, err := r.Open(ctx, "late", &gpushm.OpenOptions{Wait: time.Minute})
	if cerr := <-committed; cerr != nil {
		t.Fatalf("Commit: %v", cerr)
	}
	if err != nil {
		t.Fatalf("Open waiting for a commit 1 s away, with a 300 ms timeout: %v", err)
	}
	got.Close()
	// And the timeout is the plain one again afterwards.
	if _, err := r.Stat(ctx, "late"); err != nil {
		t.Fatal(err)
	}
}
