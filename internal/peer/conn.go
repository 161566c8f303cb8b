package peer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"
)

// maxInflight bounds the calls a connection serves at once; one more is
// answered CodeBusy rather than queued, so that a peer cannot make this
// node hold unbounded goroutines and memory.
const maxInflight = 64

// conn is an authenticated connection to a peer, either way round. One
// goroutine (read) reads it; writers take wmu. Calls in flight wait on
// their channel in calls; all end with the connection.
type conn struct {
	n        *Node
	c        net.Conn
	s        *session
	addr     string // the peer's address as dialed, or as it came from
	outbound bool
	since    time.Time

	wmu sync.Mutex // held while sealing and writing a message

	mu       sync.Mutex
	nextID   uint64
	calls    map[uint64]chan *message
	inflight int
	err      error // why it ended, once done is closed

	done     chan struct{}
	doneOnce sync.Once
}

func newConn(n *Node, c net.Conn, s *session, addr string, outbound bool) *conn {
	return &conn{n: n, c: c, s: s, addr: addr, outbound: outbound, since: time.Now(),
		calls: map[uint64]chan *message{}, done: make(chan struct{})}
}

// close ends the connection for reason: calls in flight fail, the reader
// and the pinger return.
func (c *conn) close(reason error) {
	c.doneOnce.Do(func() {
		c.mu.Lock()
		c.err = reason
		c.mu.Unlock()
		close(c.done)
		c.c.Close()
	})
}

// reason says why the connection ended.
func (c *conn) reason() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err
}

// run serves the connection until it ends or ctx is done: it reads
// messages, pings the peer while idle, and waits for its handlers.
func (c *conn) run(ctx context.Context) error {
	var wg sync.WaitGroup
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(ctx, func() { c.close(ErrClosed) })
	defer stop()
	wg.Add(1)
	go func() {
		defer wg.Done()
		c.ping(ctx)
	}()
	err := c.read(ctx, &wg)
	c.close(err)
	cancel()
	wg.Wait()
	return c.reason()
}

// ping sends a ping every KeepAlive, so that the peer's reads, and this
// side's through its pongs, see a live connection; a peer silent for
// three intervals is taken for dead by read.
func (c *conn) ping(ctx context.Context) {
	t := time.NewTicker(c.n.cfg.KeepAlive)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-c.done:
			return
		case <-t.C:
			if err := c.send(&message{Kind: kindPing}); err != nil {
				c.close(err)
				return
			}
		}
	}
}

// read reads and dispatches messages until the connection fails: a bad
// MAC, sequence number or message ends it, as does silence longer than
// three keepalive intervals.
func (c *conn) read(ctx context.Context, wg *sync.WaitGroup) error {
	dead := 3 * c.n.cfg.KeepAlive
	for {
		c.c.SetReadDeadline(time.Now().Add(dead))
		body, err := readFrame(c.c, MaxMessage)
		if err != nil {
			if errors.Is(err, errTooLong) {
				return fmt.Errorf("from %s: %w", c.s.peer, err)
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				return fmt.Errorf("no message from %s for %v: taken for dead", c.s.peer, dead)
			}
			return err
		}
		b, err := c.s.recv.open(body)
		if err != nil {
			return fmt.Errorf("from %s: %w", c.s.peer, err)
		}
		m, err := decodeMessage(b)
		if err != nil {
			return fmt.Errorf("from %s: %w", c.s.peer, err)
		}
		switch m.Kind {
		case kindPing:
			if err := c.send(&message{Kind: kindPong}); err != nil {
				return err
			}
		case kindPong:
		case kindReply:
			c.deliver(m)
		case kindCall:
			c.serve(ctx, wg, m)
		}
	}
}

// deliver hands a reply to its call; one for a call that gave up is
// dropped.
func (c *conn) deliver(m *message) {
	c.mu.Lock()
	ch := c.calls[m.ID]
	delete(c.calls, m.ID)
	c.mu.Unlock()
	if ch != nil {
		ch <- m
	}
}

// serve runs the handler for a peer's call in its own goroutine, within
// maxInflight, and sends its reply.
func (c *conn) serve(ctx context.Context, wg *sync.WaitGroup, m *message) {
	c.mu.Lock()
	busy := c.inflight >= maxInflight
	if !busy {
		c.inflight++
	}
	c.mu.Unlock()
	if busy {
		c.reply(m.ID, nil, Errorf(CodeBusy, "%d calls already being served on this connection", maxInflight))
		return
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer func() {
			c.mu.Lock()
			c.inflight--
			c.mu.Unlock()
		}()
		left := c.n.cfg.CallTimeout
		if m.MS > 0 {
			left = time.Duration(m.MS) * time.Millisecond
		}
		hctx, cancel := context.WithTimeout(ctx, left)
		defer cancel()
		resp, err := c.n.handle(hctx, c.s.peer, m.Op, m.Body)
		if m.MS > 0 && errors.Is(hctx.Err(), context.DeadlineExceeded) {
			return // the caller gave up first, and says so itself
		}
		c.reply(m.ID, resp, err)
	}()
}

// reply sends the answer to call id: resp as JSON, or err as an Error.
func (c *conn) reply(id uint64, resp any, err error) {
	r := &message{Kind: kindReply, ID: id}
	if err == nil {
		b, merr := json.Marshal(resp)
		if merr != nil {
			err = fmt.Errorf("reply: %w", merr)
		} else {
			r.Body = b
		}
	}
	if err != nil {
		r.Body, r.Err = nil, toError(err)
	}
	serr := c.send(r)
	if errors.Is(serr, errTooLong) {
		serr = c.send(&message{Kind: kindReply, ID: id, Err: Errorf(CodeFailed, "reply: %v", serr)})
	}
	if serr != nil {
		c.close(serr)
	}
}

// send seals and writes m; a write that does not finish within three
// keepalive intervals (a peer that stopped reading) fails.
func (c *conn) send(m *message) error {
	b, err := json.Marshal(m)
	if err != nil {
		return err
	}
	c.wmu.Lock()
	defer c.wmu.Unlock()
	f, err := c.s.send.seal(b)
	if err != nil {
		return err
	}
	c.c.SetWriteDeadline(time.Now().Add(3 * c.n.cfg.KeepAlive))
	if _, err := c.c.Write(f); err != nil {
		return fmt.Errorf("send to %s: %w", c.s.peer, err)
	}
	return nil
}

// call sends a call and waits for its reply, ctx's end, or the
// connection's.
func (c *conn) call(ctx context.Context, op string, body []byte) (*message, error) {
	ch := make(chan *message, 1)
	c.mu.Lock()
	c.nextID++
	id := c.nextID
	c.calls[id] = ch
	c.mu.Unlock()
	defer func() {
		c.mu.Lock()
		delete(c.calls, id)
		c.mu.Unlock()
	}()
	m := &message{Kind: kindCall, ID: id, Op: op, Body: body}
	if d, ok := ctx.Deadline(); ok {
		m.MS = max(1, time.Until(d).Milliseconds())
	}
	if err := c.send(m); errors.Is(err, errTooLong) {
		return nil, fmt.Errorf("request: %w", err)
	} else if err != nil {
		c.close(err)
		return nil, fmt.Errorf("%w: %v", ErrClosed, err)
	}
	select {
	case r := <-ch:
		return r, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-c.done:
		return nil, fmt.Errorf("%w: %v", ErrClosed, c.reason())
	}
}
