package server_test

import (
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm/internal/backend"
	"github.com/gpushm/gpushm/internal/server"
	"github.com/gpushm/gpushm/internal/testdaemon"
	"github.com/gpushm/gpushm/internal/testutil"
	"github.com/gpushm/gpushm/internal/wire"
)

// within runs fn and fails the test if it takes longer than d: a daemon
// that stopped answering shows as a failure, not a hung test.
func within(t *testing.T, d time.Duration, what string, fn func() error) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- fn() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	case <-time.After(d):
		t.Fatalf("%s: no answer within %v", what, d)
	}
}

// ask sends msg on c and returns the reply's error code ("" for none).
func ask(c *wire.Conn, msg string) (string, error) {
	if err := c.Send([]byte(msg), -1); err != nil {
		return "", err
	}
	b, fd, err := c.Recv()
	if fd >= 0 {
		unix.Close(fd)
	}
	if err != nil {
		return "", err
	}
	rep, err := wire.DecodeReply(b)
	if err != nil || rep.Error == nil {
		return "", err
	}
	return rep.Error.Code, nil
}

// A client that sends requests and never reads the replies must not hold
// a worker: more such clients than there can be workers, and another
// client is still answered.
func TestClientsThatDoNotReadHoldNoWorker(t *testing.T) {
	d := testdaemon.Start(t, "host")
	const stuck = 80 // more than the most workers a server runs
	var flooders []*wire.Conn
	sent := make([]int, stuck)
	within(t, 60*time.Second, "clients that stop reading", func() error {
		for k := range stuck {
			c := testutil.DialRaw(t, d.Socket).Conn
			if _, err := ask(c, `{"id":1,"op":"hello","version":1}`); err != nil {
				return fmt.Errorf("client %d: hello: %w", k, err)
			}
			flooders = append(flooders, c)
			// Requests until the daemon stops reading them: its replies
			// filled this client's queue.
			for sent[k] < 1<<16 {
				msg := fmt.Sprintf(`{"id":%d,"op":"stat","name":"none"}`, sent[k]+2)
				err := c.TrySend([]byte(msg), -1)
				if errors.Is(err, wire.ErrWouldBlock) {
					break
				}
				if err != nil {
					return err
				}
				sent[k]++
			}
		}
		return nil
	})
	other := testutil.DialRaw(t, d.Socket).Conn
	within(t, 30*time.Second, "another client's hello and stat", func() error {
		if _, err := ask(other, `{"id":1,"op":"hello","version":1}`); err != nil {
			return err
		}
		if got, err := ask(other, `{"id":2,"op":"stat","name":"none"}`); err != nil || got != "ENOENT" {
			return fmt.Errorf("stat: %q, %v, want ENOENT", got, err)
		}
		return nil
	})
	// A client that reads at last gets every reply, in order.
	r := flooders[0]
	within(t, 30*time.Second, "the replies a client had not read", func() error {
		for i := range sent[0] {
			b, fd, err := r.Recv()
			if fd >= 0 {
				unix.Close(fd)
			}
			if err != nil {
				return fmt.Errorf("reply %d of %d: %w", i, sent[0], err)
			}
			rep, err := wire.DecodeReply(b)
			if err != nil {
				return err
			}
			if rep.ID != uint64(i+2) || rep.Error == nil || rep.Error.Code != "ENOENT" {
				return fmt.Errorf("reply %d: %s, want id %d ENOENT", i, b, i+2)
			}
		}
		return nil
	})
}

// More clients asking without a pause than there can be workers: each
// still gets its turn, and so does one more.
func TestBusyClientsTakeTurns(t *testing.T) {
	d := testdaemon.Start(t, "host")
	const busy = 80 // more than the most workers a server runs
	stop := make(chan struct{})
	errs := make(chan error, busy)
	counts := make([]atomic.Int64, busy)
	var conns []*wire.Conn
	for k := range busy {
		c := testutil.DialRaw(t, d.Socket).Conn
		conns = append(conns, c)
		go func() {
			if _, err := ask(c, `{"id":1,"op":"hello","version":1}`); err != nil {
				select {
				case <-stop:
					errs <- nil
				default:
					errs <- fmt.Errorf("busy client %d: hello: %v", k, err)
				}
				return
			}
			for {
				select {
				case <-stop:
					errs <- nil
					return
				default:
				}
				if got, err := ask(c, `{"id":2,"op":"stat","name":"none"}`); err != nil || got != "ENOENT" {
					select {
					case <-stop: // shut down below
						errs <- nil
					default:
						errs <- fmt.Errorf("busy client %d: %q, %v", k, got, err)
					}
					return
				}
				counts[k].Add(1)
			}
		}()
	}
	defer func() {
		close(stop)
		for _, c := range conns {
			c.Shutdown() // a client the daemon never answers waits no more
		}
		for range busy {
			if err := <-errs; err != nil {
				t.Error(err)
			}
		}
	}()
	other := testutil.DialRaw(t, d.Socket).Conn
	within(t, 60*time.Second, "another client among busy ones", func() error {
		if _, err := ask(other, `{"id":1,"op":"hello","version":1}`); err != nil {
			return err
		}
		for i := range 20 {
			if got, err := ask(other, `{"id":2,"op":"stat","name":"none"}`); err != nil || got != "ENOENT" {
				return fmt.Errorf("stat %d: %q, %v", i, got, err)
			}
		}
		return nil
	})
	within(t, 60*time.Second, "every busy client answered again and again", func() error {
		for {
			least := int64(-1)
			for k := range counts {
				if n := counts[k].Load(); least < 0 || n < least {
					least = n
				}
			}
			if least >= 10 {
				return nil
			}
			time.Sleep(10 * time.Millisecond)
		}
	})
}

// Opens waiting for a commit, more of them than there can be workers,
// hold none: another client is answered meanwhile, and the commit answers
// them all.
func TestWaitingOpensHoldNoWorker(t *testing.T) {
	d := testdaemon.Start(t, "host")
	const waiting = 80
	var waiters []*wire.Conn
	within(t, 60*time.Second, "opens that wait", func() error {
		for k := range waiting {
			c := testutil.DialRaw(t, d.Socket).Conn
			if _, err := ask(c, `{"id":1,"op":"hello","version":1}`); err != nil {
				return fmt.Errorf("waiter %d: hello: %w", k, err)
			}
			if err := c.Send([]byte(`{"id":2,"op":"open","name":"late","wait":60}`), -1); err != nil {
				return err
			}
			waiters = append(waiters, c)
		}
		return nil
	})
	writer := testutil.DialRaw(t, d.Socket).Conn
	var id uint64
	within(t, 30*time.Second, "another client, while they wait", func() error {
		if _, err := ask(writer, `{"id":1,"op":"hello","version":1}`); err != nil {
			return err
		}
		if err := writer.Send([]byte(`{"id":2,"op":"create","name":"late","size":4096,"open":true,"uncommitted":true}`), -1); err != nil {
			return err
		}
		b, fd, err := writer.Recv()
		if fd >= 0 {
			unix.Close(fd)
		}
		if err != nil {
			return err
		}
		rep, err := wire.DecodeReply(b)
		if err != nil || rep.Error != nil || rep.Segment == nil {
			return fmt.Errorf("create: %s, %v", b, err)
		}
		id = rep.Segment.ID
		return nil
	})
	within(t, 30*time.Second, "every open waiting", func() error {
		for d.Server.Waiting() != waiting {
			time.Sleep(5 * time.Millisecond)
		}
		return nil
	})
	within(t, 30*time.Second, "the commit and every open it ends", func() error {
		if got, err := ask(writer, fmt.Sprintf(`{"id":3,"op":"commit","segment":%d}`, id)); err != nil || got != "" {
			return fmt.Errorf("commit: %q, %v", got, err)
		}
		for k, c := range waiters {
			b, fd, err := c.Recv()
			if fd >= 0 {
				unix.Close(fd)
			}
			if err != nil {
				return fmt.Errorf("waiter %d: %w", k, err)
			}
			if rep, err := wire.DecodeReply(b); err != nil || rep.Error != nil || !rep.FD || fd < 0 {
				return fmt.Errorf("waiter %d: %s, %v", k, b, err)
			}
			// The connection serves on after its wait.
			if got, err := ask(c, `{"id":4,"op":"stat","name":"late"}`); err != nil || got != "" {
				return fmt.Errorf("waiter %d: stat after the open: %q, %v", k, got, err)
			}
		}
		return nil
	})
}

// A worker that takes a connection from the idle set serves it once
// before it gives it back for another's turn, even when every worker is
// busy: with one worker there is never another one waiting, and a server
// that gave back every connection unserved would answer nobody. (With 64
// workers, a daemon with 20,000 connections each ready with its hang-up
// took over 30 s to stop on an H200 machine, passing them round.)
func TestBusyWorkersServeWhatTheyTake(t *testing.T) {
	d := testdaemon.StartWith(t, "host", func(s *server.Server, _ backend.Backend) { s.SetMaxWorkers(1) })
	var conns []*wire.Conn
	for range 20 {
		conns = append(conns, testutil.DialRaw(t, d.Socket).Conn)
	}
	within(t, 30*time.Second, "clients of a server with one worker", func() error {
		for round := range 3 {
			for k, c := range conns {
				msg := `{"id":1,"op":"hello","version":1}`
				want := ""
				if round > 0 {
					msg, want = `{"id":2,"op":"stat","name":"none"}`, "ENOENT"
				}
				if got, err := ask(c, msg); err != nil || got != want {
					return fmt.Errorf("round %d, client %d: %q, %v, want %q", round, k, got, err, want)
				}
			}
		}
		return nil
	})
	// Every connection hangs up at once; the server still stops.
	for _, c := range conns {
		c.Close()
	}
	within(t, 30*time.Second, "stopping the server", func() error {
		d.Stop()
		return nil
	})
}
