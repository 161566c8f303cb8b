package peer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"os"
	"slices"
	"strconv"
	"sync"
	"time"
)

// Config says who this node is, whom it trusts and whom it dials.
type Config struct {
	// Node is this node's name, as peers see it (default: the host name).
	Node string
	// Secret is the peers' shared secret (LoadSecret).
	Secret []byte
	// Listen is the address peers dial ('gpushm daemon --listen-peers'),
	// "" for none.
	Listen string
	// Peers are the addresses, HOST:PORT, this node dials and keeps
	// connections to ('gpushm daemon --peers').
	Peers []string
	// Service is HOST:PORT, a name whose every address is a peer, such as
	// a Kubernetes headless Service's ('gpushm daemon --peer-service'):
	// each address of its answer but this node's own is dialed as those
	// of Peers are (service.go). "" for none.
	Service string
	// ResolveEvery is how often Service is resolved again (default 30s).
	ResolveEvery time.Duration
	// Resolver resolves Service (default net.DefaultResolver).
	Resolver Resolver
	// Handler serves the peers' calls; from is the peer's node name, req
	// the call's JSON. Its result is sent as JSON; an *Error keeps its
	// code, any other error is sent as CodeFailed. ctx ends when the
	// caller gives up or the connection ends. Nil answers every call
	// CodeUnknownOp.
	Handler func(ctx context.Context, from, op string, req json.RawMessage) (any, error)
	// Log receives the refused peers, connections made and lost (default:
	// slog.Default()).
	Log *slog.Logger

	// CallTimeout bounds a Call whose ctx has no deadline (default 10s).
	CallTimeout time.Duration
	// HandshakeTimeout bounds a handshake: a peer that connects and says
	// nothing is dropped after it (default 5s).
	HandshakeTimeout time.Duration
	// KeepAlive is how often an idle connection is pinged; one silent for
	// three intervals is taken for dead (default 5s).
	KeepAlive time.Duration
	// MaxUnauthenticated bounds the accepted connections still in their
	// handshake; more are closed at once (default 32).
	MaxUnauthenticated int
}

// Defaults of Config.
const (
	DefaultCallTimeout        = 10 * time.Second
	DefaultHandshakeTimeout   = 5 * time.Second
	DefaultKeepAlive          = 5 * time.Second
	DefaultMaxUnauthenticated = 32
	DefaultResolveEvery       = 30 * time.Second
)

// Redial backoff, doubled from min to max, with jitter.
const (
	minBackoff = 100 * time.Millisecond
	maxBackoff = 5 * time.Second
)

// PeerInfo describes a configured peer address, or a connection a peer
// made to this node.
type PeerInfo struct {
	Name      string    `json:"name,omitempty"` // its node name, once a handshake told it
	Addr      string    `json:"addr"`
	Outbound  bool      `json:"outbound"` // an address of Config.Peers, or of Config.Service's answer
	Connected bool      `json:"connected"`
	LastError string    `json:"last_error,omitempty"`
	Since     time.Time `json:"since"` // of the state: connected, or failing
}

// ID is what Call and List take to reach the peer: its node name, or its
// address before a handshake told the name.
func (pi PeerInfo) ID() string {
	if pi.Name != "" {
		return pi.Name
	}
	return pi.Addr
}

// Node keeps this node's connections to its peers: it listens, dials,
// redials with backoff, and serves and makes calls. Its goroutines end
// with Close, or when Start's ctx is done.
type Node struct {
	cfg    Config
	log    *slog.Logger
	ln     net.Listener
	cancel context.CancelFunc
	wg     sync.WaitGroup
	unauth chan struct{} // a token per connection in its handshake

	mu     sync.Mutex
	conns  []*conn     // authenticated, oldest first
	dials  []*PeerInfo // one per Config.Peers, in order, then Config.Service's
	svcErr error       // why the last resolution of Config.Service failed
}

// Start checks c, listens on c.Listen and dials c.Peers and the addresses
// of c.Service. It returns once listening; connections to peers come up in
// the background (Peers says which are up).
func Start(ctx context.Context, c Config) (*Node, error) {
	if err := c.fill(); err != nil {
		return nil, err
	}
	n := &Node{cfg: c, log: c.Log, unauth: make(chan struct{}, c.MaxUnauthenticated)}
	if c.Listen != "" {
		ln, err := net.Listen("tcp", c.Listen)
		if err != nil {
			return nil, fmt.Errorf("peers: listen: %w", err)
		}
		n.ln = ln
	}
	ctx, n.cancel = context.WithCancel(ctx)
	if n.ln != nil {
		n.wg.Add(1)
		go func() {
			defer n.wg.Done()
			n.accept(ctx)
		}()
		context.AfterFunc(ctx, func() { n.ln.Close() })
	}
	for _, addr := range c.Peers {
		n.dialer(ctx, addr)
	}
	if c.Service != "" {
		n.wg.Add(1)
		go func() {
			defer n.wg.Done()
			n.watch(ctx)
		}()
	}
	return n, nil
}

// dialer lists addr among the dialed peers and keeps a connection to it
// until ctx is done or stop is called, which also takes it off the list
// and closes its connection.
func (n *Node) dialer(ctx context.Context, addr string) (stop func()) {
	ctx, cancel := context.WithCancel(ctx)
	d := &PeerInfo{Addr: addr, Outbound: true, Since: time.Now()}
	n.mu.Lock()
	n.dials = append(n.dials, d)
	n.mu.Unlock()
	n.wg.Add(1)
	go func() {
		defer n.wg.Done()
		n.redial(ctx, d)
	}()
	return func() {
		cancel()
		n.mu.Lock()
		n.dials = slices.DeleteFunc(n.dials, func(x *PeerInfo) bool { return x == d })
		n.mu.Unlock()
	}
}

// fill checks the configuration and fills in its defaults.
func (c *Config) fill() error {
	if len(c.Secret) < MinSecret {
		return fmt.Errorf("peers: secret of %d bytes, at least %d needed", len(c.Secret), MinSecret)
	}
	if c.Node == "" {
		h, err := os.Hostname()
		if err != nil {
			return fmt.Errorf("peers: node name: %w", err)
		}
		c.Node = h
	}
	if !validNode(c.Node) {
		return fmt.Errorf("peers: bad node name %q (printable, no spaces, at most %d bytes)", c.Node, maxNode)
	}
	for _, a := range c.Peers {
		if _, _, err := net.SplitHostPort(a); err != nil {
			return fmt.Errorf("peers: %q: want HOST:PORT: %w", a, err)
		}
	}
	if c.Service != "" {
		// The port is a number: this node's own listener is told from
		// the other addresses of the answer by it (service.go).
		host, port, err := net.SplitHostPort(c.Service)
		if n, perr := strconv.ParseUint(port, 10, 16); err != nil || perr != nil || host == "" || n == 0 {
			return fmt.Errorf("peers: service %q: want HOST:PORT, PORT a number", c.Service)
		}
	}
	if c.Log == nil {
		c.Log = slog.Default()
	}
	if c.Resolver == nil {
		c.Resolver = net.DefaultResolver
	}
	c.Log = c.Log.With("node", c.Node)
	c.CallTimeout = cmp(c.CallTimeout, DefaultCallTimeout)
	c.HandshakeTimeout = cmp(c.HandshakeTimeout, DefaultHandshakeTimeout)
	c.KeepAlive = cmp(c.KeepAlive, DefaultKeepAlive)
	c.MaxUnauthenticated = cmp(c.MaxUnauthenticated, DefaultMaxUnauthenticated)
	c.ResolveEvery = cmp(c.ResolveEvery, DefaultResolveEvery)
	return nil
}

// cmp is v, or def where v is not positive.
func cmp[T int | time.Duration](v, def T) T {
	if v <= 0 {
		return def
	}
	return v
}

// Addr is the address this node listens on, nil if it does not.
func (n *Node) Addr() net.Addr {
	if n.ln == nil {
		return nil
	}
	return n.ln.Addr()
}

// Close closes the listener and every connection, and waits for the
// node's goroutines and the handlers they run.
func (n *Node) Close() error {
	n.cancel()
	n.mu.Lock()
	for _, c := range n.conns {
		c.close(ErrClosed)
	}
	n.mu.Unlock()
	n.wg.Wait()
	return nil
}

// Peers lists the dialed peers, then the connections other nodes made to
// this one, but those of a node this one is connected to by a dialed
// address too: where nodes dial each other, as through a service, each
// is listed once.
func (n *Node) Peers() []PeerInfo {
	n.mu.Lock()
	defer n.mu.Unlock()
	var ps []PeerInfo
	dialed := map[string]bool{}
	for _, d := range n.dials {
		ps = append(ps, *d)
		if d.Connected {
			dialed[d.Name] = true
		}
	}
	for _, c := range n.conns {
		if !c.outbound && !dialed[c.s.peer] {
			ps = append(ps, PeerInfo{Name: c.s.peer, Addr: c.addr, Connected: true, Since: c.since})
		}
	}
	return ps
}

// Call calls op on peer (a node name, or an address of Config.Peers) with
// req as JSON and decodes the answer into resp (unless nil). Without a
// deadline in ctx it waits CallTimeout. Its errors name the peer and op:
// an *Error the peer's handler returned, or one wrapping
// ErrNotConnected, ErrTimeout or ErrClosed.
func (n *Node) Call(ctx context.Context, peer, op string, req, resp any) error {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, n.cfg.CallTimeout)
		defer cancel()
	}
	c, err := n.find(peer)
	if err != nil {
		return err
	}
	who := fmt.Sprintf("%s (%s)", c.s.peer, c.addr)
	body, err := json.Marshal(req)
	if err != nil {
		return fmt.Errorf("peer %s: %s: request: %w", who, op, err)
	}
	start := time.Now()
	r, err := c.call(ctx, op, body)
	switch {
	case errors.Is(err, context.DeadlineExceeded) || (err == nil && r.Err != nil && errors.Is(ctx.Err(), context.DeadlineExceeded)):
		return fmt.Errorf("peer %s: %s: %w within %v", who, op, ErrTimeout, time.Since(start).Round(time.Millisecond))
	case err != nil:
		return fmt.Errorf("peer %s: %s: %w", who, op, err)
	case r.Err != nil:
		r.Err.Peer, r.Err.Op = who, op
		return r.Err
	case resp != nil:
		if err := json.Unmarshal(r.Body, resp); err != nil {
			return fmt.Errorf("peer %s: %s: reply: %w", who, op, err)
		}
	}
	return nil
}

// find picks the newest authenticated connection to peer.
func (n *Node) find(peer string) (*conn, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	for _, c := range slices.Backward(n.conns) {
		if c.s.peer == peer || (c.outbound && c.addr == peer) {
			return c, nil
		}
	}
	for _, d := range n.dials {
		if d.Addr == peer || d.Name == peer {
			return nil, fmt.Errorf("peer %s: %w (last error: %s)", peer, ErrNotConnected, d.LastError)
		}
	}
	return nil, fmt.Errorf("peer %s: %w", peer, ErrNotConnected)
}

// handle serves a peer's call through the Handler.
func (n *Node) handle(ctx context.Context, from, op string, req json.RawMessage) (any, error) {
	if n.cfg.Handler == nil {
		return nil, Errorf(CodeUnknownOp, "no operation %q on node %s", op, n.cfg.Node)
	}
	return n.cfg.Handler(ctx, from, op, req)
}

// accept takes connections until ctx is done; each is authenticated in
// its own goroutine, while fewer than MaxUnauthenticated are.
func (n *Node) accept(ctx context.Context) {
	for {
		c, err := n.ln.Accept()
		if err != nil {
			if ctx.Err() == nil {
				n.log.Error("peers: accept", "err", err)
			}
			return
		}
		select {
		case n.unauth <- struct{}{}:
		default:
			n.log.Warn("peer refused", "addr", c.RemoteAddr().String(),
				"err", fmt.Sprintf("%d connections already in their handshake", n.cfg.MaxUnauthenticated))
			c.Close()
			continue
		}
		n.wg.Add(1)
		go func() {
			defer n.wg.Done()
			n.serveInbound(ctx, c)
		}()
	}
}

// serveInbound authenticates an accepted connection and serves it.
func (n *Node) serveInbound(ctx context.Context, nc net.Conn) {
	addr := nc.RemoteAddr().String()
	stop := context.AfterFunc(ctx, func() { nc.Close() })
	defer stop()
	nc.SetDeadline(time.Now().Add(n.cfg.HandshakeTimeout))
	s, err := acceptHandshake(nc, n.cfg.Secret, n.cfg.Node)
	<-n.unauth
	if err != nil {
		n.log.Warn("peer refused", "addr", addr, "err", err)
		nc.Close()
		return
	}
	nc.SetDeadline(time.Time{})
	n.log.Info("peer connected", "peer", s.peer, "addr", addr, "dir", "in")
	c := newConn(n, nc, s, addr, false)
	err = n.serve(ctx, c, nil)
	n.log.Info("peer lost", "peer", s.peer, "addr", addr, "err", err)
}

// serve keeps c among the node's connections while it runs.
func (n *Node) serve(ctx context.Context, c *conn, d *PeerInfo) error {
	n.mu.Lock()
	n.conns = append(n.conns, c)
	if d != nil {
		*d = PeerInfo{Name: c.s.peer, Addr: d.Addr, Outbound: true, Connected: true, Since: c.since}
	}
	n.mu.Unlock()
	err := c.run(ctx)
	n.mu.Lock()
	n.conns = slices.DeleteFunc(n.conns, func(x *conn) bool { return x == c })
	if d != nil {
		d.Connected, d.LastError, d.Since = false, err.Error(), time.Now()
	}
	n.mu.Unlock()
	return err
}

// redial keeps a connection to d.Addr until ctx is done, dialing again
// after each failure with a growing backoff. A refusal is logged; other
// failures are logged when they change.
func (n *Node) redial(ctx context.Context, d *PeerInfo) {
	backoff := minBackoff
	var last string
	for ctx.Err() == nil {
		c, err := n.dial(ctx, d.Addr)
		if err == nil {
			backoff = minBackoff
			n.log.Info("peer connected", "peer", c.s.peer, "addr", d.Addr, "dir", "out")
			err = n.serve(ctx, c, d)
			n.log.Info("peer lost", "peer", c.s.peer, "addr", d.Addr, "err", err)
			last = ""
		} else {
			n.mu.Lock()
			d.Connected, d.LastError, d.Since = false, err.Error(), time.Now()
			n.mu.Unlock()
			var r *RefusedError
			if errors.As(err, &r) {
				n.log.Warn("peer refused", "addr", d.Addr, "err", err)
			} else if err.Error() != last && ctx.Err() == nil {
				n.log.Info("peer unreachable", "addr", d.Addr, "err", err)
			}
			last = err.Error()
		}
		wait := backoff/2 + rand.N(backoff/2+1)
		backoff = min(2*backoff, maxBackoff)
		select {
		case <-ctx.Done():
		case <-time.After(wait):
		}
	}
}

// dial connects to addr and authenticates, within HandshakeTimeout.
func (n *Node) dial(ctx context.Context, addr string) (*conn, error) {
	ctx, cancel := context.WithTimeout(ctx, n.cfg.HandshakeTimeout)
	defer cancel()
	var d net.Dialer
	nc, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	stop := context.AfterFunc(ctx, func() { nc.Close() })
	dl, _ := ctx.Deadline()
	nc.SetDeadline(dl)
	s, err := dialHandshake(nc, n.cfg.Secret, n.cfg.Node, newNonce())
	if !stop() || err != nil {
		nc.Close()
		if err == nil {
			err = ctx.Err()
		}
		return nil, err
	}
	nc.SetDeadline(time.Time{})
	return newConn(n, nc, s, addr, true), nil
}
