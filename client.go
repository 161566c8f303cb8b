package gpushm

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/gpushm/gpushm/internal/epoch"
	"github.com/gpushm/gpushm/internal/wire"
)

// Client is a connection to the daemon. When the daemon restarts (its
// serving process crashed or was upgraded), the client reconnects on the
// next operation, reclaims the leases of the segments it has open and its
// temporary segments, and retries the operation; mappings never depended
// on the connection and keep working throughout. A client that holds
// segments or channels but makes no call notices the restart within
// WatchInterval and reclaims them then, inside the daemon's grace period.
type Client struct {
	socket  string
	origin  origin // how socket was found
	trust   trust  // who the client accepts there, at every connection
	server  string
	backend string
	epoch   atomic.Pointer[epoch.Page]
	session string // names this client across reconnections

	mu         sync.Mutex // serializes round trips
	conn       *wire.Conn
	enc        []byte // requests are encoded here, under mu
	nextID     uint64
	broken     error
	reconnect  time.Duration
	timeout    time.Duration
	oldEpochs  []*epoch.Page // pages of earlier connections, unmapped at Close
	reconnects int
	stopWatch  chan struct{} // closed by Close: ends watch

	cmu    sync.Mutex
	cache  map[cacheKey]*shared // opens by name, to share (Open)
	held   map[holder]struct{}  // leases and channel ends (hold)
	closed bool
}

// holder is what the client holds of the daemon's: a segment's lease and
// mapping (shared), a channel's end. The client core takes each back after
// a reconnection and ends it with the client, knowing nothing more of it.
type holder interface {
	// reclaimLocked takes back on c's new connection what the holder held
	// on the old one; c.mu is held. Only an error wrapping errLost (the
	// connection lost again) stops the reclaim. settle, if not "", names a
	// segment whose lease the holder gave back in a close that the restart
	// may have cut off: the daemon keeps such a lease journaled for this
	// session until the session's first request that is not a reclaim,
	// which the client then sends about settle.
	reclaimLocked(ctx context.Context, c *Client) (settle string, err error)
	// end ends it as c closes.
	end() error
}

// hold has c reclaim h after each reconnection, and end it at Close,
// until unhold.
func (c *Client) hold(h holder) {
	c.cmu.Lock()
	c.holdLocked(h)
	c.cmu.Unlock()
}

// holdLocked is hold with c.cmu held.
func (c *Client) holdLocked(h holder) {
	if c.held == nil {
		c.held = map[holder]struct{}{}
	}
	c.held[h] = struct{}{}
}

// unhold ends what hold began.
func (c *Client) unhold(h holder) {
	c.cmu.Lock()
	delete(c.held, h)
	c.cmu.Unlock()
}

// heldNow is what c holds, at this moment.
func (c *Client) heldNow() []holder {
	c.cmu.Lock()
	defer c.cmu.Unlock()
	hs := make([]holder, 0, len(c.held))
	for h := range c.held {
		hs = append(hs, h)
	}
	return hs
}

// Dial connects to the daemon at socket and says hello. With socket ""
// it tries SocketCandidates in order, and the client keeps the one that
// answered (Socket) for the rest of its life: after a restart it
// reconnects there, never to another candidate. When none answers, the
// error names every path tried, each with its reason.
//
// Before it sends anything, on every connection, reconnections included,
// the client checks who it talks to (docs/security.md, "Finding the
// daemon"): the daemon's SO_PEERCRED uid must be the caller's, root's, or
// $GPUSHM_DAEMON_UID; and a candidate found by convention must be in a
// directory no other user could have made or could write (the user's own,
// for the user's socket; root's, for SystemSocket), else it is skipped
// with the reason. A refused socket matches ErrUntrusted.
func Dial(ctx context.Context, socket string) (*Client, error) {
	timeout := clientTimeout()
	t, err := loadTrust()
	if err != nil {
		return nil, err
	}
	// A connection the daemon ends before its hello is answered (a
	// serving process restarting, or handing over to its successor,
	// as it accepted) is made again, as a request's would be.
	deadline := time.Now().Add(clientReconnect())
	for {
		cand, conn, err := discover(socket, t, timeout)
		if err != nil {
			return nil, err
		}
		c, err := greet(ctx, cand, t, conn, timeout)
		if err == nil || !errors.Is(err, errLost) || ctx.Err() != nil || time.Now().After(deadline) {
			return c, err
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// greet makes the client of conn, a new connection to cand, and says
// hello; conn is closed if that fails.
func greet(ctx context.Context, cand candidate, t trust, conn *wire.Conn, timeout time.Duration) (*Client, error) {
	var sid [16]byte
	rand.Read(sid[:])
	c := &Client{
		socket:    cand.path,
		origin:    cand.origin,
		trust:     t,
		conn:      conn,
		session:   hex.EncodeToString(sid[:]),
		reconnect: clientReconnect(),
		timeout:   timeout,
		cache:     make(map[cacheKey]*shared),
		stopWatch: make(chan struct{}),
	}
	c.mu.Lock()
	err := c.helloLocked(ctx)
	c.mu.Unlock()
	if err != nil {
		conn.Close()
		return nil, err
	}
	go c.watch()
	return c, nil
}

// WatchInterval is how often a client that holds segments or channels
// checks, between its calls, whether the daemon ended its connection. After
// a restart the daemon keeps what clients held for its grace period (10 s
// by default) and no longer: a client that maps a segment and makes no call
// would otherwise lose its lease, and the segment could be evicted or
// expire under it.
const WatchInterval = time.Second

// watch reconnects c, between its calls, when the daemon ends its
// connection while c holds something, until Close.
func (c *Client) watch() {
	t := time.NewTicker(WatchInterval)
	defer t.Stop()
	for {
		select {
		case <-c.stopWatch:
			return
		case <-t.C:
		}
		c.cmu.Lock()
		holds := len(c.held) > 0
		c.cmu.Unlock()
		// A call in flight holds mu, and reconnects by itself.
		if holds && c.mu.TryLock() {
			c.rejoinLocked()
			c.mu.Unlock()
		}
	}
}

// rejoinLocked reconnects a client whose connection the daemon ended since
// its last call and reclaims its leases, if the daemon answers at once.
// If it does not, the old connection stays, for the next tick or call to
// find ended.
func (c *Client) rejoinLocked() {
	ctx := context.Background()
	if !c.freshConnLocked(ctx) {
		return
	}
	c.reconnects++
	// A connection lost again while reclaiming is found by the next tick.
	_ = c.reclaimLocked(ctx)
}

// freshConnLocked replaces a connection that the daemon ended with a new
// one, greeted with this client's session, and reports whether it did. If
// the daemon does not answer (within ctx), c keeps the old connection, for
// the next call to find ended.
func (c *Client) freshConnLocked(ctx context.Context) bool {
	if c.broken != nil || c.reconnect <= 0 || !c.conn.HungUp() {
		return false
	}
	conn, err := dialConn(candidate{c.socket, c.origin}, c.trust, c.timeout)
	if err != nil {
		return false
	}
	old := c.conn
	c.conn = conn
	if err := c.helloLocked(ctx); err != nil {
		// A hello that failed may have marked the new connection
		// unusable; the client as a whole is not.
		c.conn, c.broken = old, nil
		conn.Close()
		return false
	}
	old.Close()
	return true
}

// helloLocked greets the daemon on c.conn and maps its epoch page.
func (c *Client) helloLocked(ctx context.Context) error {
	c.nextID++
	rep, fd, err := c.exchangeLocked(ctx, &wire.Request{ID: c.nextID, Op: wire.OpHello, Version: wire.Version, Session: c.session}, -1)
	if err != nil {
		return fmt.Errorf("gpushm: hello: %w", err)
	}
	if fd < 0 || !rep.Epoch {
		closeFD(fd)
		return fmt.Errorf("gpushm: hello: daemon sent no epoch page")
	}
	page, err := epoch.Map(fd)
	closeFD(fd)
	if err != nil {
		return fmt.Errorf("gpushm: %w", err)
	}
	if old := c.epoch.Swap(page); old != nil {
		// Another goroutine may be reading it; it goes at Close.
		c.oldEpochs = append(c.oldEpochs, old)
	}
	c.server, c.backend = rep.Server, rep.Backend
	return nil
}

// Reconnects is how many times this client reconnected to a daemon that
// went away (a serving process that crashed or was replaced).
func (c *Client) Reconnects() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.reconnects
}

// SetTimeout sets how long the client waits for each reply before it gives
// up on the connection (0: for ever); see DefaultTimeout.
func (c *Client) SetTimeout(d time.Duration) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.broken != nil {
		return c.broken
	}
	if err := c.conn.SetTimeout(d); err != nil {
		return fmt.Errorf("gpushm: %w", err)
	}
	c.timeout = d
	return nil
}

// SetReconnect sets how long an operation waits for a daemon that went
// away to come back (0: never reconnect; the operation fails).
func (c *Client) SetReconnect(d time.Duration) {
	c.mu.Lock()
	c.reconnect = d
	c.mu.Unlock()
}

// Backend is "cuda" or "host".
func (c *Client) Backend() string { return c.backend }

// Socket is the path of the daemon this client reached: the one it was
// given, or the candidate that answered (SocketCandidates). It reconnects
// there after a restart.
func (c *Client) Socket() string { return c.socket }

// Close closes every Segment opened through c (unmapping its memory) and the
// connection. The daemon ends the connection's leases.
func (c *Client) Close() error {
	c.cmu.Lock()
	if c.closed {
		c.cmu.Unlock()
		return nil
	}
	c.closed = true
	close(c.stopWatch)
	held := make([]holder, 0, len(c.held))
	for h := range c.held {
		held = append(held, h)
	}
	c.cmu.Unlock()
	// Still held while they end: a reconnection on the way (a channel's
	// close makes a round trip) reclaims them all first.
	var errs []error
	for _, h := range held {
		errs = append(errs, h.end())
	}
	c.cmu.Lock()
	c.held, c.cache = nil, nil
	c.cmu.Unlock()
	c.mu.Lock()
	c.endLostConnLocked()
	errs = append(errs, c.conn.Close())
	c.broken = errors.New("gpushm: client closed")
	for _, p := range c.oldEpochs {
		p.Close()
	}
	c.oldEpochs = nil
	c.mu.Unlock()
	c.epoch.Load().Close()
	return errors.Join(errs...)
}

// endLostConnLocked ends the temporary segments of a connection that a
// crash of the daemon's serving process took since the last call: the new
// serving process keeps them for as long as this process lives, waiting
// for its session. Saying hello with it on a new connection, about to be
// closed, takes them back to end with that connection. If the daemon does
// not answer in time, they end when this process exits.
func (c *Client) endLostConnLocked() {
	ctx, cancel := context.WithTimeout(context.Background(), min(c.reconnect, 5*time.Second))
	defer cancel()
	c.freshConnLocked(ctx)
}

// roundTrip sends req and waits for its reply. A reply carrying an error is
// returned as *Error. The returned fd, if not -1, belongs to the caller.
func (c *Client) roundTrip(ctx context.Context, req *wire.Request) (*wire.Reply, int, error) {
	return c.roundTripFD(ctx, req, -1)
}

// roundTripFD is roundTrip sending a descriptor (sendFD >= 0) with req.
//
// If the connection is lost (the daemon's serving process died or was
// replaced), it reconnects and sends req again, with the same id. That is
// safe for every operation: a create or publish that the first attempt
// applied is found again by its id (the daemon records which request made
// a segment), and an unlink or rename that finds its name gone had been
// applied by the first attempt, and a commit that the first attempt applied
// is answered as that one was. A close needs no retry: the lease ended
// with the connection.
func (c *Client) roundTripFD(ctx context.Context, req *wire.Request, sendFD int) (*wire.Reply, int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.broken != nil {
		return nil, -1, c.broken
	}
	c.nextID++
	req.ID = c.nextID
	start, wait := time.Now(), req.Wait
	for retried := false; ; retried = true {
		if retried && wait > 0 {
			// An open waiting for a commit waits what is left of its time.
			req.Wait = max(wait-time.Since(start).Seconds(), 0.001)
		}
		rep, fd, err := c.exchangeLocked(ctx, req, sendFD)
		if !errors.Is(err, errLost) {
			if retried && (req.Op == wire.OpUnlink || req.Op == wire.OpRename) && errors.Is(err, syscall.ENOENT) {
				return &wire.Reply{ID: req.ID}, -1, nil
			}
			return rep, fd, err
		}
		if req.Op == wire.OpClose {
			return &wire.Reply{ID: req.ID}, -1, nil
		}
		if err := c.reconnectLocked(ctx, err); err != nil {
			return nil, -1, err
		}
	}
}

// errLost marks a connection that the daemon ended: the request may be
// sent again on a new one.
var errLost = errors.New("connection to the daemon lost")

// reconnectLocked dials the daemon again until it answers or c.reconnect
// has passed, says hello with the same session (the daemon gives back this
// client's temporary segments), and reclaims the leases of every segment
// this client has open.
func (c *Client) reconnectLocked(ctx context.Context, cause error) error {
	c.conn.Close()
	if c.reconnect <= 0 {
		return c.fail(ctx, cause)
	}
	deadline := time.Now().Add(c.reconnect)
	wait := 2 * time.Millisecond
	for {
		conn, err := dialConn(candidate{c.socket, c.origin}, c.trust, c.timeout)
		if errors.Is(err, ErrUntrusted) {
			// Not the daemon this client reached before: nothing was
			// sent, and waiting will not make it so.
			c.broken = fmt.Errorf("gpushm: the daemon at %s went away, and what answers there now is not trusted: %w", c.socket, err)
			return c.broken
		}
		if err == nil {
			c.conn = conn
			if err = c.helloLocked(ctx); err == nil {
				break
			}
			if !errors.Is(err, errLost) {
				return err
			}
			conn.Close()
		}
		if ctx.Err() != nil {
			return c.fail(ctx, ctx.Err())
		}
		if time.Now().After(deadline) {
			c.broken = fmt.Errorf("gpushm: the daemon at %s went away and did not come back within %s: %w", c.socket, c.reconnect, err)
			return c.broken
		}
		time.Sleep(wait)
		wait = min(2*wait, 100*time.Millisecond)
	}
	c.reconnects++
	if err := c.reclaimLocked(ctx); err != nil {
		return c.reconnectLocked(ctx, err)
	}
	return nil
}

// reclaimLocked takes back, on a new connection, what c holds (hold). It
// fails only with a lost connection (errLost).
func (c *Client) reclaimLocked(ctx context.Context) error {
	// Names may mean other segments now: ask the daemon again for each.
	c.cmu.Lock()
	clear(c.cache)
	c.cmu.Unlock()
	var settle string
	for _, h := range c.heldNow() {
		name, err := h.reclaimLocked(ctx, c)
		if errors.Is(err, errLost) {
			return err
		}
		if name != "" {
			settle = name
		}
	}
	if settle != "" {
		// The daemon ends what the session did not take back at its first
		// request that is not a reclaim.
		c.nextID++
		_, fd, err := c.exchangeLocked(ctx, &wire.Request{ID: c.nextID, Op: wire.OpStat, Name: settle}, -1)
		closeFD(fd)
		if errors.Is(err, errLost) {
			return err
		}
	}
	return nil
}

// exchangeLocked sends req as it is (its ID set) and waits for the reply.
// A lost connection is reported wrapping errLost.
func (c *Client) exchangeLocked(ctx context.Context, req *wire.Request, sendFD int) (*wire.Reply, int, error) {
	b, err := c.encodeLocked(req)
	if err != nil {
		return nil, -1, err
	}
	if err := ctx.Err(); err != nil {
		return nil, -1, err
	}
	if ctx.Done() != nil {
		// Cancellation and deadlines end the connection: a blocked recvmsg
		// cannot be abandoned any other way, and the reply stream could no
		// longer be trusted anyway.
		// The connection this exchange uses, read under c.mu: the callback
		// runs without the lock, and a Close may replace c.conn by then
		// (shutting down the new one would end a connection that no
		// exchange is using).
		conn := c.conn
		stop := context.AfterFunc(ctx, func() { conn.Shutdown() })
		defer stop()
	}
	if c.timeout > 0 && c.limit(req) != c.timeout {
		// The daemon answers an open that waits for a commit when the wait
		// ends, a pull when the bytes are here: the timeout starts after.
		if err := c.conn.SetTimeout(c.limit(req)); err != nil {
			return nil, -1, c.fail(ctx, err)
		}
		defer c.conn.SetTimeout(c.timeout)
	}
	if err := c.conn.Send(b, sendFD); err != nil {
		if ctx.Err() == nil && isHangup(err) {
			return nil, -1, fmt.Errorf("%w: %v", errLost, err)
		}
		return nil, -1, c.fail(ctx, c.timedOut(req, err))
	}
	for {
		b, fd, err := c.conn.Recv()
		if err != nil && !errors.Is(err, wire.ErrFDDropped) {
			if ctx.Err() == nil && isHangup(err) {
				return nil, -1, fmt.Errorf("%w: %v", errLost, err)
			}
			return nil, -1, c.fail(ctx, c.timedOut(req, err))
		}
		rep, derr := wire.DecodeReply(b)
		if derr != nil {
			closeFD(fd)
			return nil, -1, c.fail(ctx, derr)
		}
		if rep.ID == 0 && rep.Error != nil && req.ID != 0 {
			// The daemon could not read this request's id. Requests go
			// one at a time, so the error answers this one: it is not a
			// stale reply to skip.
			closeFD(fd)
			return nil, -1, rep.Error
		}
		if rep.ID != req.ID {
			// A reply to a request given up on; the protocol never sends
			// unsolicited messages, so anything else is a stale answer.
			closeFD(fd)
			continue
		}
		if err != nil { // the descriptor was dropped
			if rep.FD && rep.Segment != nil {
				c.sendCloseLocked(rep.Segment.ID)
			}
			return nil, -1, err
		}
		if rep.Error != nil {
			closeFD(fd)
			return nil, -1, rep.Error
		}
		if rep.FD && fd < 0 {
			return nil, -1, c.fail(ctx, fmt.Errorf("%w: reply promised a descriptor and carried none", wire.ErrProto))
		}
		if rep.Control {
			// A channel's control block follows in a packet of its own.
			b, cfd, err := c.conn.Recv()
			var second *wire.Reply
			if err == nil {
				second, err = wire.DecodeReply(b)
			}
			if err == nil && (second.ID != req.ID || !second.ControlFD || cfd < 0) {
				err = fmt.Errorf("%w: the control block did not follow the reply", wire.ErrProto)
			}
			if err != nil {
				closeFD(fd)
				closeFD(cfd)
				if ctx.Err() == nil && isHangup(err) {
					return nil, -1, fmt.Errorf("%w: %v", errLost, err)
				}
				return nil, -1, c.fail(ctx, err)
			}
			rep.CtlFD = cfd
		}
		return rep, fd, nil
	}
}

// timedOut says what a timeout means, and how to change it; other errors
// pass as they are.
func (c *Client) timedOut(req *wire.Request, err error) error {
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		return err
	}
	return fmt.Errorf("gpushm: %s: the daemon at %s did not answer within %s (stuck? GPUSHM_TIMEOUT or SetTimeout sets the limit): %w",
		req.Op, c.socket, c.limit(req), err)
}

// limit is how long the client waits for req's reply.
func (c *Client) limit(req *wire.Request) time.Duration {
	d := c.timeout + time.Duration(req.Wait*float64(time.Second))
	if req.Op == wire.OpPull {
		d += wire.PullTime
	}
	return d
}

// isHangup tells a connection the daemon ended from other failures.
func isHangup(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, syscall.EPIPE) || errors.Is(err, syscall.ECONNRESET) ||
		errors.Is(err, syscall.ENOTCONN)
}

// fail marks the connection unusable: after a timeout or a protocol error
// the stream of replies can no longer be trusted.
func (c *Client) fail(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		err = ctx.Err()
	}
	c.broken = fmt.Errorf("gpushm: connection to %s unusable after: %w", c.socket, err)
	c.conn.Close()
	return err
}

// encodeLocked encodes req in c's buffer, valid until the next call.
func (c *Client) encodeLocked(req *wire.Request) ([]byte, error) {
	b, err := wire.AppendEncode(c.enc[:0], req)
	if err == nil && cap(b) <= wire.KeepBuffer {
		c.enc = b
	}
	return b, err
}

// sendCloseLocked ends a lease without waiting for the answer's content.
func (c *Client) sendCloseLocked(id uint64) {
	c.nextID++
	b, _ := c.encodeLocked(&wire.Request{ID: c.nextID, Op: wire.OpClose, Segment: id})
	if c.conn.Send(b, -1) == nil {
		_, fd, _ := c.conn.Recv()
		closeFD(fd)
	}
}

// Info asks the daemon about its backend and devices.
func (c *Client) Info(ctx context.Context) (*Info, error) {
	rep, _, err := c.roundTrip(ctx, &wire.Request{Op: wire.OpInfo})
	if err != nil {
		return nil, fmt.Errorf("gpushm: info: %w", err)
	}
	inf := &Info{Server: c.server, Backend: rep.Backend, Devices: rep.Devices, GPU: rep.GPU,
		PID: rep.PID, SupervisorPID: rep.SupervisorPID, Pool: rep.Pool, Tiers: rep.Tiers,
		Grace: time.Duration(rep.Grace * float64(time.Second)), GraceSeconds: rep.Grace,
		Users: rep.Users, Quotas: rep.Quotas}
	if rep.Usage != nil {
		inf.Usage = *rep.Usage
	}
	if rep.Restarts != nil {
		inf.Restarts = *rep.Restarts
	}
	return inf, nil
}

// Stat describes a segment.
func (c *Client) Stat(ctx context.Context, name string) (*SegmentInfo, error) {
	rep, _, err := c.roundTrip(ctx, &wire.Request{Op: wire.OpStat, Name: name})
	if err != nil {
		return nil, err
	}
	return rep.Segment, nil
}

// List returns every segment, in name order, without metadata.
func (c *Client) List(ctx context.Context) ([]SegmentInfo, error) {
	var all []SegmentInfo
	after := ""
	for {
		rep, _, err := c.roundTrip(ctx, &wire.Request{Op: wire.OpList, After: after})
		if err != nil {
			return nil, err
		}
		all = append(all, rep.Segments...)
		if rep.Next == "" {
			return all, nil
		}
		after = rep.Next
	}
}

// Evict moves a segment that nobody holds open to host memory now,
// freeing its device memory; the next open (or Load) brings it back.
// Owner or root; a segment open somewhere, pinned or a channel is refused
// with EBUSY.
func (c *Client) Evict(ctx context.Context, name string) (*SegmentInfo, error) {
	return c.tierOp(ctx, &wire.Request{Op: wire.OpEvict, Name: name})
}

// EvictTo moves a segment that nobody holds open to "host" memory (as
// Evict) or to "disk", the daemon's disk tier, freeing its memory; the
// next open (or Load) brings it back to its device.
func (c *Client) EvictTo(ctx context.Context, name, to string) (*SegmentInfo, error) {
	if to == "host" {
		to = "" // what every daemon takes
	}
	return c.tierOp(ctx, &wire.Request{Op: wire.OpEvict, Name: name, To: to})
}

// Sync writes a durable segment's bytes to disk now and returns once they
// are durable (docs/disk.md says when a write is). Owner or root.
func (c *Client) Sync(ctx context.Context, name string) (*SegmentInfo, error) {
	return c.tierOp(ctx, &wire.Request{Op: wire.OpSync, Name: name})
}

// Offer offers a segment to the daemon's peers on other nodes (on), or
// takes it back. Owner or root; nothing is offered unless its owner says
// so (docs/peers.md).
func (c *Client) Offer(ctx context.Context, name string, on bool) (*SegmentInfo, error) {
	return c.tierOp(ctx, &wire.Request{Op: wire.OpOffer, Name: name, Offer: on})
}

// Pull has the daemon copy a segment a peer on another node offers (from,
// when not empty; else any connected peer that offers it) into a new
// segment of the same name here, committed once every chunk checked
// (docs/peers.md). Root, or the user the segment belongs to here, may.
func (c *Client) Pull(ctx context.Context, name, from string) (*SegmentInfo, error) {
	return c.tierOp(ctx, &wire.Request{Op: wire.OpPull, Name: name, From: from})
}

// Peers reports the daemon's peers on other nodes and what each offers;
// nil when the daemon has none configured.
func (c *Client) Peers(ctx context.Context) (*wire.PeersReport, error) {
	return c.peers(ctx, "")
}

// PullProgress reports the pull of name in progress here, if any: the peer
// that lends it, its size and the bytes checked so far.
func (c *Client) PullProgress(ctx context.Context, name string) (*wire.PeerPull, error) {
	r, err := c.peers(ctx, name)
	if err != nil || r == nil {
		return nil, err
	}
	for i := range r.Pulls {
		if r.Pulls[i].Name == name {
			return &r.Pulls[i], nil
		}
	}
	return nil, nil
}

func (c *Client) peers(ctx context.Context, pull string) (*wire.PeersReport, error) {
	rep, _, err := c.roundTrip(ctx, &wire.Request{Op: wire.OpPeers, Name: pull})
	if err != nil {
		return nil, fmt.Errorf("gpushm: peers: %w", err)
	}
	return rep.Peers, nil
}

// Load brings a segment evicted to host memory back to its device ahead
// of an open, evicting others if the device's budget needs room. Read
// access is enough; a segment on its device already is left there.
func (c *Client) Load(ctx context.Context, name string) (*SegmentInfo, error) {
	return c.tierOp(ctx, &wire.Request{Op: wire.OpLoad, Name: name})
}

// Pin keeps a segment on its device (on: restoring it first if it was
// evicted) or lets it be evicted again (off). Owner or root.
func (c *Client) Pin(ctx context.Context, name string, on bool) (*SegmentInfo, error) {
	return c.tierOp(ctx, &wire.Request{Op: wire.OpPin, Name: name, Pin: on})
}

func (c *Client) tierOp(ctx context.Context, req *wire.Request) (*SegmentInfo, error) {
	rep, _, err := c.roundTrip(ctx, req)
	if err != nil {
		return nil, fmt.Errorf("gpushm: %s %q: %w", req.Op, req.Name, err)
	}
	return rep.Segment, nil
}

// Unlink removes a name. The memory is freed when the last lease ends.
func (c *Client) Unlink(ctx context.Context, name string) error {
	_, _, err := c.roundTrip(ctx, &wire.Request{Op: wire.OpUnlink, Name: name})
	return err
}

// Chmod sets a segment's permission bits (owner or root).
func (c *Client) Chmod(ctx context.Context, name string, mode uint32) error {
	_, _, err := c.roundTrip(ctx, &wire.Request{Op: wire.OpChmod, Name: name, Mode: &mode})
	return err
}

// Chown sets a segment's owner and group; -1 leaves one as it is. Only root
// may change the owner; the owner may change the group to its own.
func (c *Client) Chown(ctx context.Context, name string, uid, gid int64) error {
	req := &wire.Request{Op: wire.OpChown, Name: name}
	if uid >= 0 {
		req.UID = &uid
	}
	if gid >= 0 {
		req.GID = &gid
	}
	_, _, err := c.roundTrip(ctx, req)
	return err
}

// Rename gives a segment another name, replacing a segment of that name
// (owner or root, of both).
func (c *Client) Rename(ctx context.Context, from, to string) error {
	_, _, err := c.roundTrip(ctx, &wire.Request{Op: wire.OpRename, Name: from, To: to})
	return err
}

// RenameNoReplace is Rename, but fails with EEXIST when to exists, as
// renameat2's RENAME_NOREPLACE does: the check and the rename are one
// step. A daemon from before it fails with EPROTO.
func (c *Client) RenameNoReplace(ctx context.Context, from, to string) error {
	_, _, err := c.roundTrip(ctx, &wire.Request{Op: wire.OpRename, Name: from, To: to, NoReplace: true})
	return err
}

// Publish names memory this process allocated: fd is an exported CUDA VMM
// allocation (or a sealable memfd on a host daemon) of size bytes, which the
// daemon checks and keeps, so the name outlives this process. fd stays this
// caller's to close. Describe what lives where in Meta (for a tensor:
// dtype, shape, strides and the byte offset inside the allocation).
func (c *Client) Publish(ctx context.Context, name string, fd int, size int64, o *CreateOptions) (*SegmentInfo, error) {
	if o == nil {
		o = &CreateOptions{}
	}
	req := o.request(name, size, false)
	req.Op = wire.OpPublish
	rep, _, err := c.roundTripFD(ctx, req, fd)
	if err != nil {
		return nil, err
	}
	return rep.Segment, nil
}

// CreateOptions are the optional parts of a create.
type CreateOptions struct {
	// Device is the GPU ordinal; nil means the daemon's default device.
	Device *int
	// Mode is the permission bits; nil means 0600.
	Mode *uint32
	// Meta is user metadata (JSON), for example a tensor's dtype and shape.
	Meta json.RawMessage
	// ExistOK opens the segment if the name exists with the same size and
	// device, so that racing creators share one allocation.
	ExistOK bool
	// Temporary ends the segment when this client's connection closes,
	// whatever the reason (Close, exit, crash).
	Temporary bool
	// TTL ends the segment once it has been unopened for this long.
	TTL time.Duration
	// Uncommitted makes a segment that nobody else can open until this
	// client commits it (Segment.Commit): fill it, then commit it, and no
	// reader ever sees it half written. It takes its name at once (a
	// second create of the name fails with EEXIST), is listed as
	// uncommitted, and goes if this client closes it, or its connection
	// ends, before the commit. Not with ExistOK, nor with CreateOnly.
	Uncommitted bool
	// Pin keeps the segment on its device: the daemon never evicts it to
	// host memory to make room (Client.Pin changes it later).
	Pin bool
	// NextVersion makes the next version of an existing name (implies
	// Uncommitted): fill it, then Commit makes it the name's current
	// version in one step, replacing the one readers have, who move to
	// it with Segment.Refresh. Until the commit the name keeps meaning
	// the current version; a writer that goes without committing leaves
	// it so. It needs the right to remove the current version (its owner,
	// or root), at the create and again at the commit, which replaces only
	// what the name named at the create: a name that names another
	// segment by then fails the commit with EEXIST, one that names nothing
	// any more with ENOENT, and the version stays uncommitted. See
	// docs/protocol.md, "Versions".
	NextVersion bool
	// Offer offers the segment to the daemon's peers on other nodes
	// (docs/peers.md).
	Offer bool
	// Persist makes a durable segment (a daemon with a disk tier): its
	// bytes go to disk after its commit and at each Client.Sync, and it is
	// listed again after a reboot, its first open reading them back
	// (docs/disk.md).
	Persist bool
	// Trace, when set, asks the daemon to time the create's steps, and
	// receives them.
	Trace *Trace
}

func (o *CreateOptions) request(name string, size int64, open bool) *wire.Request {
	r := &wire.Request{Op: wire.OpCreate, Name: name, Size: size, Device: o.Device,
		Mode: o.Mode, Meta: o.Meta, ExistOK: o.ExistOK, Open: open, TTL: o.TTL.Seconds(),
		Uncommitted: o.Uncommitted || o.NextVersion, NextVersion: o.NextVersion, Pin: o.Pin, Persist: o.Persist, Offer: o.Offer, Trace: o.Trace != nil}
	if o.Temporary {
		r.Lifetime = wire.LifetimeConnection
	}
	return r
}

// Create makes a segment and opens it for reading and writing.
func (c *Client) Create(ctx context.Context, name string, size int64, o *CreateOptions) (*Segment, error) {
	if o == nil {
		o = &CreateOptions{}
	}
	key := cacheKey{name: name}
	if o.Uncommitted || o.NextVersion {
		// Not openable by name until committed: Commit caches it then.
		key.uncommitted = true
	}
	return c.openWith(ctx, o.request(name, size, true), key, nil, o.Trace)
}

// CreateOnly makes a segment without opening it; created is false when
// ExistOK found it already there. A size of 0 makes an empty segment: a
// name that holds no memory, as an empty file does, which can be listed,
// renamed and removed but not opened (a daemon from before empty
// segments fails with EPROTO).
func (c *Client) CreateOnly(ctx context.Context, name string, size int64, o *CreateOptions) (info *SegmentInfo, created bool, err error) {
	if o == nil {
		o = &CreateOptions{}
	}
	req := o.request(name, size, false)
	req.Empty = size == 0
	rep, _, err := c.roundTrip(ctx, req)
	if err != nil {
		return nil, false, err
	}
	keepTrace(o.Trace, rep)
	return rep.Segment, rep.Created != nil && *rep.Created, nil
}

// OpenOptions are the optional parts of an open.
type OpenOptions struct {
	// ReadOnly asks for read access only; cuda mappings are then made with
	// CU_MEM_ACCESS_FLAGS_PROT_READ.
	ReadOnly bool
	// Devices are the GPUs that will touch a cuda mapping; all get access in
	// one cuMemSetAccess call, reaching the segment's GPU over NVLink or PCIe
	// peer access. Empty means the segment's own GPU.
	Devices []int
	// Wait > 0 waits, at most this long (and at most an hour), for the name
	// to name a committed segment: one that does not exist yet, or that
	// its writer has not committed yet (CreateOptions.Uncommitted). The
	// open fails with ETIMEDOUT when the time is up, and with ENOENT when
	// the writer it waited for went without committing. Without Wait such
	// an open fails at once (ENOENT, or EAGAIN for an uncommitted one).
	// The wait ends sooner if ctx does; this client sends nothing else
	// meanwhile.
	Wait time.Duration
	// Trace, when set, asks the daemon to time the open's steps, and
	// receives them. An open this client answers from its own cache sends
	// nothing and leaves it untouched.
	Trace *Trace
}

// Open opens a segment by name. If this client already holds the same name
// open (with the same access) and the name still names that segment, the
// lease and mapping are shared and no message is sent.
func (c *Client) Open(ctx context.Context, name string, o *OpenOptions) (*Segment, error) {
	if o == nil {
		o = &OpenOptions{}
	}
	key := cacheKey{name: name, readOnly: o.ReadOnly, devices: devicesKey(o.Devices)}
	c.cmu.Lock()
	if c.closed {
		c.cmu.Unlock()
		return nil, errors.New("gpushm: client closed")
	}
	if sh := c.cache[key]; sh != nil && sh.epoch == c.epoch.Load().Load() {
		sh.refs++
		c.cmu.Unlock()
		return &Segment{sh: sh}, nil
	}
	c.cmu.Unlock()
	req := &wire.Request{Op: wire.OpOpen, Name: name, ReadOnly: o.ReadOnly, Trace: o.Trace != nil}
	if o.Wait != 0 {
		wait := o.Wait
		if dl, ok := ctx.Deadline(); ok {
			// Let the daemon answer before ctx ends: a cancelled request
			// leaves the connection unusable.
			wait = min(wait, time.Until(dl)-time.Until(dl)/10)
		}
		if wait <= 0 {
			return nil, fmt.Errorf("gpushm: open %q: wait %s: %w", name, o.Wait, syscall.EINVAL)
		}
		req.Wait = wait.Seconds()
	}
	return c.openWith(ctx, req, key, o.Devices, o.Trace)
}

// keepTrace copies a reply's trace into tr, if the caller asked for one.
func keepTrace(tr *Trace, rep *wire.Reply) {
	if tr != nil && rep.Trace != nil {
		*tr = *rep.Trace
	}
}

func (c *Client) openWith(ctx context.Context, req *wire.Request, key cacheKey, devices []int, tr *Trace) (*Segment, error) {
	// Read the epoch before asking: if the name changes after this, the
	// entry merely looks stale early, never fresh late.
	ep := c.epoch.Load().Load()
	rep, fd, err := c.roundTrip(ctx, req)
	if err != nil {
		return nil, err
	}
	keepTrace(tr, rep)
	closeFD(rep.CtlFD) // a channel opened to look at: its control block is not needed
	sh := &shared{c: c, info: *rep.Segment, key: key, epoch: ep, fd: fd, readOnly: key.readOnly, devices: devices, refs: 1}
	c.cmu.Lock()
	defer c.cmu.Unlock()
	if c.closed {
		closeFD(fd)
		return nil, errors.New("gpushm: client closed")
	}
	if !key.uncommitted {
		c.cache[key] = sh
	}
	c.holdLocked(sh)
	return &Segment{sh: sh}, nil
}

type cacheKey struct {
	name     string
	readOnly bool
	devices  string // the access list, as devicesKey writes it
	// uncommitted: a segment this client created uncommitted, kept out of
	// the cache until it commits it.
	uncommitted bool
}

func devicesKey(devs []int) string {
	if len(devs) == 0 {
		return ""
	}
	return fmt.Sprint(devs)
}

// shared is one daemon lease and its mapping, shared by every Segment this
// client opened on the same name while it named the same segment.
type shared struct {
	c        *Client
	info     SegmentInfo
	key      cacheKey
	epoch    uint64
	readOnly bool
	devices  []int
	refs     int // guarded by c.cmu

	// remap serializes Release's, Reacquire's and Refresh's changes
	// (remap.go), which may reconnect while running: never under mu.
	remap   sync.Mutex
	mu      sync.Mutex
	fd      int // the leased descriptor, -1 once mapped or closed
	mapping *Mapping
	// noLease: after a reconnection the daemon no longer knew the
	// segment, so there is no lease to end.
	noLease bool
	// released: the mapping's memory was given back with the lease
	// (remap.go); only its address range is kept.
	released bool
}

// reclaimLocked takes back sh's lease on c's new connection (holder). A
// released segment has none to take back (Reacquire takes a new one), but
// may leave one journaled: it names itself to settle.
func (sh *shared) reclaimLocked(ctx context.Context, c *Client) (settle string, err error) {
	sh.mu.Lock()
	released, name := sh.released, sh.info.Name
	sh.mu.Unlock()
	if released {
		return name, nil
	}
	c.nextID++
	_, fd, err := c.exchangeLocked(ctx, &wire.Request{ID: c.nextID, Op: wire.OpReclaim, Segment: sh.info.ID, Count: 1, ReadOnly: sh.readOnly}, -1)
	closeFD(fd)
	if errors.Is(err, errLost) {
		return "", err
	}
	if err != nil {
		// Gone (or no longer ours to open): the mapping still works,
		// but there is no lease to end.
		sh.mu.Lock()
		sh.noLease = true
		sh.mu.Unlock()
	}
	return "", nil
}

// end unmaps sh as its client closes (holder): the daemon ends the lease
// with the connection.
func (sh *shared) end() error { return sh.unmap() }

// unmap undoes the mapping and closes the descriptor; the lease is the
// caller's business.
func (sh *shared) unmap() error {
	sh.mu.Lock()
	defer sh.mu.Unlock()
	closeFD(sh.fd)
	sh.fd = -1
	if sh.mapping == nil {
		return nil
	}
	err := sh.mapping.unmap()
	sh.mapping = nil
	return err
}

// Segment is an open segment: a lease on it, and its mapping once Map is
// called. Close it when done.
type Segment struct {
	sh     *shared
	closed bool
}

// Info is the segment's state when it was opened.
func (s *Segment) Info() SegmentInfo { return s.sh.info }

// ID is the daemon's unique ID for the segment.
func (s *Segment) ID() uint64 { return s.sh.info.ID }

// Size is the size asked for at creation.
func (s *Segment) Size() int64 { return s.sh.info.Size }

// Commit makes a segment this client created uncommitted
// (CreateOptions.Uncommitted) openable by its name, for everyone its mode
// allows; opens waiting for it (OpenOptions.Wait) get it now. Finish the
// writes first: on a GPU, the copies of this package are done when they
// return, but work queued on a stream of your own must be synchronized
// before Commit. A second commit fails (EINVAL), as does one by any other
// client (EPERM), and one of a segment whose name was removed meanwhile
// (ENOENT, or EEXIST when the name names another segment now).
func (s *Segment) Commit(ctx context.Context) error {
	return s.commit(ctx, nil)
}

// CommitMeta is Commit, and replaces the segment's meta with meta (at most
// 32 KiB encoded, as a create's) in the same step: for what the writer
// learned while filling it, such as a checksum. Info still says the meta
// the segment had when it was opened. A daemon from before commits carried
// meta refuses it with EPROTO, and leaves the segment uncommitted.
func (s *Segment) CommitMeta(ctx context.Context, meta json.RawMessage) error {
	if len(meta) == 0 {
		return errors.New("gpushm: commit with empty meta (use Commit)")
	}
	return s.commit(ctx, meta)
}

func (s *Segment) commit(ctx context.Context, meta json.RawMessage) error {
	if s.closed {
		return errors.New("gpushm: commit of a closed segment")
	}
	sh, c := s.sh, s.sh.c
	ep := c.epoch.Load().Load()
	if _, _, err := c.roundTrip(ctx, &wire.Request{Op: wire.OpCommit, Segment: sh.info.ID, Meta: meta}); err != nil {
		return fmt.Errorf("gpushm: commit %q: %w", sh.info.Name, err)
	}
	c.cmu.Lock()
	defer c.cmu.Unlock()
	if sh.key.uncommitted && !c.closed {
		// The name names this segment from now on, as long as the epoch
		// read before the commit stays.
		sh.key.uncommitted = false
		sh.epoch = ep
		if c.cache[sh.key] == nil {
			c.cache[sh.key] = sh
		}
	}
	return nil
}

// Map maps the segment into this process, once; later calls, and Segments
// sharing the lease, get the same Mapping.
func (s *Segment) Map() (*Mapping, error) {
	if s.closed {
		return nil, errors.New("gpushm: map of a closed segment")
	}
	sh := s.sh
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if sh.mapping != nil {
		return sh.mapping, nil
	}
	if sh.fd < 0 {
		return nil, fmt.Errorf("gpushm: map %q: client closed", sh.info.Name)
	}
	m, err := mapSegment(sh.fd, &sh.info, sh.readOnly, sh.devices)
	if err != nil {
		return nil, fmt.Errorf("gpushm: map %q: %w", sh.info.Name, err)
	}
	// The mapping holds the memory now; the descriptor would only pin an
	// fd slot.
	closeFD(sh.fd)
	sh.fd = -1
	m.owner = sh
	sh.mapping = m
	return m, nil
}

// Close ends this Segment. When it was the last one sharing its lease, the
// memory is unmapped and the daemon is told; a segment this client created
// uncommitted and did not commit then goes. Using a Mapping after that is
// a use after free.
func (s *Segment) Close() error {
	if s.closed {
		return nil
	}
	s.closed = true
	sh, c := s.sh, s.sh.c
	c.cmu.Lock()
	sh.refs--
	last := sh.refs == 0
	if last {
		if c.cache[sh.key] == sh {
			delete(c.cache, sh.key)
		}
		delete(c.held, sh)
	}
	closed := c.closed
	c.cmu.Unlock()
	if !last || closed {
		return nil
	}
	sh.mu.Lock()
	noLease := sh.noLease || sh.released
	sh.mu.Unlock()
	err := sh.unmap()
	if noLease {
		return err
	}
	if _, _, cerr := c.roundTrip(context.Background(), &wire.Request{Op: wire.OpClose, Segment: sh.info.ID}); cerr != nil {
		err = errors.Join(err, fmt.Errorf("gpushm: close %q: %w", sh.info.Name, cerr))
	}
	return err
}

func closeFD(fd int) {
	if fd >= 0 {
		syscall.Close(fd)
	}
}
