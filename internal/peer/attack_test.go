package peer

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/gpushm/gpushm/internal/testutil"
)

// The handshake's and the first authenticated message's places in each
// direction, as the proxy counts frames.
const firstMessage = 2

// TestTamper plays a man in the middle on an authenticated connection: a
// message changed, replayed, dropped or sent back to its sender ends the
// connection, and the node that read it logs why; the dialer then
// connects again, past the attacker's one-time edit.
func TestTamper(t *testing.T) {
	flip := func(b []byte) []byte {
		b = bytes.Clone(b)
		b[len(b)-2] ^= 0x20
		return b
	}
	tests := []struct {
		name string
		up   bool // edit the call (else its reply)
		edit func(f []byte) (fwd, back [][]byte)
		who  string // the node that sees it: a (the listener) or b
		log  string
	}{
		{"flip a byte of a call", true, func(f []byte) ([][]byte, [][]byte) { return [][]byte{flip(f)}, nil }, "a", "MAC does not match"},
		{"flip a byte of a reply", false, func(f []byte) ([][]byte, [][]byte) { return [][]byte{flip(f)}, nil }, "b", "MAC does not match"},
		{"change a sequence number", true, func(f []byte) ([][]byte, [][]byte) {
			f = bytes.Clone(f)
			binary.BigEndian.PutUint64(f, 1)
			return [][]byte{f}, nil
		}, "a", "MAC does not match"},
		{"replay a call", true, func(f []byte) ([][]byte, [][]byte) { return [][]byte{f, f}, nil }, "a", "message 0 where 1 was due"},
		{"drop a call", true, func(f []byte) ([][]byte, [][]byte) { return nil, nil }, "a", "message 1 where 0 was due"},
		{"reflect a call", true, func(f []byte) ([][]byte, [][]byte) { return nil, [][]byte{f} }, "b", "MAC does not match"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			// Long keepalives: the first message either way is the call
			// and its reply, never a ping.
			a, la := start(t, Config{Node: "a", Listen: "127.0.0.1:0", KeepAlive: time.Minute})
			p := newProxy(t, a.Addr().String())
			p.edit = func(conn int, up bool, i int, f []byte) ([][]byte, [][]byte) {
				if conn == 0 && up == tc.up && i == firstMessage {
					return tc.edit(f)
				}
				return [][]byte{f}, nil
			}
			b, lb := start(t, Config{Node: "b", Peers: []string{p.addr()}, KeepAlive: time.Minute})
			waitConnected(t, b, "a")
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			defer cancel()
			// A replayed call's first copy is the genuine call, which a may
			// answer before it reads the copy and ends the connection: the
			// call may succeed, the replay never does (the log below).
			if err := b.Call(ctx, "a", "echo", nil, nil); err == nil && tc.name != "replay a call" {
				t.Fatalf("Call through the attacker = nil, want an error")
			}
			// A dropped message shows at the next one.
			b.Call(context.Background(), "a", "echo", nil, nil)
			l := map[string]*logBuf{"a": la, "b": lb}[tc.who]
			waitLog(t, l, "peer lost", tc.log)
			waitLogs(t, lb, 2, "peer connected")
			callEcho(t, b, "a", "a")
		})
	}
}

// TestPartition: a peer that stops answering (a partition: nothing comes
// back, nothing is closed) fails a Call at its deadline, naming the peer;
// keepalives then find the connection dead, and the dialer connects again
// once the partition heals.
func TestPartition(t *testing.T) {
	a, la := start(t, Config{Node: "a", Listen: "127.0.0.1:0", KeepAlive: 500 * time.Millisecond})
	p := newProxy(t, a.Addr().String())
	b, lb := start(t, Config{Node: "b", Peers: []string{p.addr()}, KeepAlive: 500 * time.Millisecond,
		CallTimeout: time.Second, HandshakeTimeout: time.Second})
	waitConnected(t, b, "a")
	callEcho(t, b, "a", "a")
	p.frozen.Store(true)
	t0 := time.Now()
	err := b.Call(context.Background(), "a", "echo", nil, nil)
	if !errors.Is(err, ErrTimeout) || !strings.Contains(err.Error(), "peer a (") {
		t.Fatalf("Call to a partitioned peer = %v, want ErrTimeout naming a", err)
	}
	if d := time.Since(t0); d > 10*time.Second {
		t.Errorf("Call to a partitioned peer took %v, CallTimeout is 1s", d)
	}
	// Whichever side's keepalive fires first closes the connection; the
	// proxy passes the close on to the other.
	testutil.WaitFor(t, "a keepalive to find the connection dead", func() bool {
		return la.has("peer lost", "taken for dead") || lb.has("peer lost", "taken for dead")
	})
	waitLog(t, lb, "peer lost")
	p.frozen.Store(false)
	waitConnected(t, b, "a")
	callEcho(t, b, "a", "a")
}

// dialRaw connects to n's listener, for a test that speaks for itself.
func dialRaw(t *testing.T, n *Node) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", n.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(20 * time.Second))
	return c
}

// recorder keeps what is written to a connection.
type recorder struct {
	net.Conn
	sent bytes.Buffer
}

func (r *recorder) Write(b []byte) (int, error) {
	r.sent.Write(b)
	return r.Conn.Write(b)
}

// TestReplayedHandshake: what a genuine dialer sent, replayed on a new
// connection, is refused: the listener's nonce is new.
func TestReplayedHandshake(t *testing.T) {
	a, la := start(t, Config{Node: "a", Listen: "127.0.0.1:0"})
	r := &recorder{Conn: dialRaw(t, a)}
	if _, err := dialHandshake(r, secretA, "b", newNonce()); err != nil {
		t.Fatalf("genuine handshake = %v", err)
	}
	r.Close()
	c := dialRaw(t, a)
	if _, err := c.Write(r.sent.Bytes()); err != nil {
		t.Fatal(err)
	}
	if _, err := readHS(c, typeChallenge); err != nil {
		t.Fatalf("challenge = %v", err)
	}
	_, err := readHS(c, typeWelcome)
	var re *RefusedError
	if !errors.As(err, &re) || !re.ByPeer {
		t.Fatalf("welcome after a replayed proof = %v, want a refusal", err)
	}
	waitLog(t, la, "peer refused", "proof does not match")
}

// TestReflectedChallenge: the listener proves nothing before the dialer
// has, so its challenge is of no use sent back to it: not as a hello, not
// as a proof; and a node that dials itself is refused.
func TestReflectedChallenge(t *testing.T) {
	a, la := start(t, Config{Node: "a", Listen: "127.0.0.1:0"})
	c1 := dialRaw(t, a)
	writeHS(c1, hsMsg{Type: typeHello, Proto: Version, Node: "mallory", Nonce: newNonce()})
	ch, err := readHS(c1, typeChallenge)
	if err != nil || ch.Proof != nil {
		t.Fatalf("challenge = %+v, %v; want one without a proof", ch, err)
	}
	// The challenge sent back as a hello: a's own name.
	c2 := dialRaw(t, a)
	writeHS(c2, hsMsg{Type: typeHello, Proto: Version, Node: ch.Node, Nonce: ch.Nonce})
	if _, err := readHS(c2, typeChallenge); err == nil {
		t.Fatal("a hello reflecting a's challenge was answered")
	}
	waitLog(t, la, "peer refused", "this node's name")
	// Under another name, the second challenge carries no proof either.
	c3 := dialRaw(t, a)
	writeHS(c3, hsMsg{Type: typeHello, Proto: Version, Node: "mallory", Nonce: ch.Nonce})
	ch3, err := readHS(c3, typeChallenge)
	if err != nil || ch3.Proof != nil {
		t.Fatalf("second challenge = %+v, %v; want one without a proof", ch3, err)
	}
	// The challenge, or anything from it, as the proof.
	b, _ := json.Marshal(ch)
	c1.Write(appendFrame(nil, b))
	if _, err := readHS(c1, typeWelcome); err == nil {
		t.Fatal("a's challenge sent back as a proof was welcomed")
	}
	writeHS(c3, hsMsg{Type: typeProof, Proof: ch.Nonce})
	if _, err := readHS(c3, typeWelcome); err == nil {
		t.Fatal("a nonce as a proof was welcomed")
	}
	waitLog(t, la, "peer refused", "proof does not match")

	// A node whose peer address leads back to itself.
	self, lself := start(t, Config{Node: "self", Listen: "127.0.0.1:0"})
	p := newProxy(t, self.Addr().String())
	_, lself2 := start(t, Config{Node: "self", Peers: []string{p.addr()}})
	waitLog(t, lself, "peer refused", "this node's name")
	waitLog(t, lself2, "peer refused", "this node's name")
}

// TestOversized: a message over the bounds ends the connection before any
// of it is read; a call or reply too long for them fails alone.
func TestOversized(t *testing.T) {
	big := strings.Repeat("x", MaxMessage)
	a, la := start(t, Config{Node: "a", Listen: "127.0.0.1:0",
		Handler: func(ctx context.Context, from, op string, req json.RawMessage) (any, error) {
			if op == "big" {
				return big, nil
			}
			return "ok", nil
		}})
	t.Run("handshake", func(t *testing.T) {
		c := dialRaw(t, a)
		c.Write(binary.BigEndian.AppendUint32(nil, maxHandshake+1))
		waitLog(t, la, "peer refused", "message too long")
	})
	t.Run("authenticated", func(t *testing.T) {
		c := dialRaw(t, a)
		if _, err := dialHandshake(c, secretA, "b", newNonce()); err != nil {
			t.Fatal(err)
		}
		c.Write(binary.BigEndian.AppendUint32(nil, MaxMessage+1))
		c.Write(make([]byte, 64<<10))
		waitLog(t, la, "peer lost", "peer=b", "message too long")
		c.SetReadDeadline(time.Now().Add(20 * time.Second))
		if _, err := c.Read(make([]byte, 1)); err == nil {
			t.Fatal("connection still open after an oversized message")
		}
	})
	t.Run("call and reply", func(t *testing.T) {
		b, _ := start(t, Config{Node: "b", Peers: []string{a.Addr().String()}})
		waitConnected(t, b, "a")
		if err := b.Call(context.Background(), "a", "x", big, nil); !errors.Is(err, errTooLong) {
			t.Errorf("Call with %d bytes = %v, want too long", len(big), err)
		}
		if err := b.Call(context.Background(), "a", "big", nil, nil); !errors.Is(err, &Error{Code: CodeFailed}) || !strings.Contains(err.Error(), "too long") {
			t.Errorf("Call answered with %d bytes = %v, want %s, too long", len(big), err, CodeFailed)
		}
		var s string
		if err := b.Call(context.Background(), "a", "x", nil, &s); err != nil || s != "ok" {
			t.Errorf("Call after them = %q, %v; want ok", s, err)
		}
	})
}

// TestSilent: a connection that says nothing is dropped at the handshake's
// deadline; past MaxUnauthenticated such connections, more are closed at
// once.
func TestSilent(t *testing.T) {
	a, la := start(t, Config{Node: "a", Listen: "127.0.0.1:0", HandshakeTimeout: 300 * time.Millisecond})
	c := dialRaw(t, a)
	t0 := time.Now()
	if _, err := c.Read(make([]byte, 1)); err == nil {
		t.Fatal("a silent connection was sent something")
	}
	if d := time.Since(t0); d > 10*time.Second {
		t.Errorf("silent connection dropped after %v, want about 300ms", d)
	}
	waitLog(t, la, "peer refused", "i/o timeout")

	a2, la2 := start(t, Config{Node: "a2", Listen: "127.0.0.1:0", HandshakeTimeout: 10 * time.Second, MaxUnauthenticated: 2})
	dialRaw(t, a2)
	dialRaw(t, a2)
	c3 := dialRaw(t, a2)
	waitLog(t, la2, "peer refused", "2 connections already in their handshake")
	c3.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := c3.Read(make([]byte, 1)); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Errorf("third silent connection: %v, want it closed", err)
	}
}
