package testutil

import (
	"fmt"
	"strings"
	"syscall"
	"testing"

	"github.com/gpushm/gpushm/internal/wire"
)

// Raw is a connection that speaks the protocol by hand, for requests the
// client library never sends.
type Raw struct {
	t    testing.TB
	Conn *wire.Conn
	id   uint64 // the last id Hello or Do gave
}

// DialRaw connects to the daemon at socket, saying nothing yet; the
// connection closes with the test.
func DialRaw(t testing.TB, socket string) *Raw {
	t.Helper()
	c, err := wire.Dial(socket)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return NewRaw(t, c)
}

// NewRaw speaks by hand on c, which stays the caller's to close.
func NewRaw(t testing.TB, c *wire.Conn) *Raw { return &Raw{t: t, Conn: c} }

// Call sends msg as it is (and fd, unless -1) and returns the reply that
// comes next, closing any descriptor that came with it.
func (r *Raw) Call(msg string, fd int) *wire.Reply {
	r.t.Helper()
	if err := r.Conn.Send([]byte(msg), fd); err != nil {
		r.t.Fatalf("send %.80q: %v", msg, err)
	}
	b, rfd, err := r.Conn.Recv()
	if err != nil {
		r.t.Fatalf("reply to %.80q: %v", msg, err)
	}
	if rfd >= 0 {
		syscall.Close(rfd)
	}
	rep, err := wire.DecodeReply(b)
	if err != nil {
		r.t.Fatalf("decode reply %q: %v", b, err)
	}
	return rep
}

// Hello says hello (protocol version 1, the next id) and fails the test
// unless the daemon answers with its epoch page.
func (r *Raw) Hello() {
	r.t.Helper()
	r.id++
	if rep := r.Call(fmt.Sprintf(`{"id":%d,"op":"hello","version":1}`, r.id), -1); rep.Error != nil || !rep.Epoch {
		r.t.Fatalf("hello = %+v", rep)
	}
}

// Do sends req (a JSON object without its id) under the next id and
// returns its reply, passing over a channel's control block packet and
// closing any descriptor that came.
func (r *Raw) Do(req string) *wire.Reply {
	r.t.Helper()
	r.id++
	b := fmt.Sprintf(`{"id":%d,%s`, r.id, strings.TrimPrefix(req, "{"))
	if err := r.Conn.Send([]byte(b), -1); err != nil {
		r.t.Fatal(err)
	}
	for {
		p, fd, err := r.Conn.Recv()
		if err != nil {
			r.t.Fatalf("%s: %v", req, err)
		}
		if fd >= 0 {
			syscall.Close(fd)
		}
		rep, err := wire.DecodeReply(p)
		if err != nil {
			r.t.Fatal(err)
		}
		// A request that could not be decoded may be answered with id 0.
		if (rep.ID == r.id || rep.ID == 0 && rep.Error != nil) && !rep.ControlFD {
			return rep
		}
	}
}
