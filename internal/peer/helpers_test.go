package peer

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gpushm/gpushm/internal/testutil"
)

var (
	secretA = []byte("0123456789abcdef0123456789abcdef-a")
	secretB = []byte("0123456789abcdef0123456789abcdef-b")
)

// logBuf is a node's log, for tests to read what it said.
type logBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuf) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logBuf) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// count says how many lines of the log hold every one of parts.
func (l *logBuf) count(parts ...string) int {
	n := 0
	for line := range strings.Lines(l.String()) {
		all := true
		for _, p := range parts {
			all = all && strings.Contains(line, p)
		}
		if all {
			n++
		}
	}
	return n
}

func (l *logBuf) has(parts ...string) bool { return l.count(parts...) > 0 }

// waitLog waits until the log has a line holding every one of parts.
func waitLog(t *testing.T, l *logBuf, parts ...string) {
	t.Helper()
	waitLogs(t, l, 1, parts...)
}

// waitLogs waits until the log has n lines holding every one of parts.
func waitLogs(t *testing.T, l *logBuf, n int, parts ...string) {
	t.Helper()
	for deadline := time.Now().Add(20 * time.Second); l.count(parts...) < n; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("not %d log lines with %q within 20s; the log:\n%s", n, parts, l)
		}
	}
}

// echo serves "echo" (the request back, with who served it and for
// whom), "missing" (a CodeNotFound error) and "hang" (until the caller
// gives up).
func echo(node string) func(context.Context, string, string, json.RawMessage) (any, error) {
	return func(ctx context.Context, from, op string, req json.RawMessage) (any, error) {
		switch op {
		case "echo":
			return map[string]any{"node": node, "from": from, "req": req}, nil
		case "missing":
			return nil, Errorf(CodeNotFound, "no segment %q", "w0")
		case "hang":
			<-ctx.Done()
			return nil, ctx.Err()
		}
		return nil, Errorf(CodeUnknownOp, "no operation %q", op)
	}
}

// start starts a node named name for the test, logging into its logBuf,
// closed at the test's end.
func start(t *testing.T, c Config) (*Node, *logBuf) {
	t.Helper()
	l := &logBuf{}
	c.Log = slog.New(slog.NewTextHandler(l, &slog.HandlerOptions{Level: slog.LevelDebug}))
	if c.Secret == nil {
		c.Secret = secretA
	}
	if c.Handler == nil {
		c.Handler = echo(c.Node)
	}
	if c.KeepAlive == 0 {
		c.KeepAlive = time.Second
	}
	n, err := Start(context.Background(), c)
	if err != nil {
		t.Fatalf("Start(%s) = %v", c.Node, err)
	}
	t.Cleanup(func() {
		n.Close()
		if t.Failed() {
			t.Logf("log of %s:\n%s", c.Node, l)
		}
	})
	return n, l
}

// connected says whether n has an authenticated connection to peer.
func connected(n *Node, peer string) bool {
	for _, p := range n.Peers() {
		if p.Connected && (p.Name == peer || p.Addr == peer) {
			return true
		}
	}
	return false
}

func waitConnected(t *testing.T, n *Node, peer string) {
	t.Helper()
	testutil.WaitFor(t, "connection to "+peer, func() bool { return connected(n, peer) })
}

// callEcho calls echo on peer and checks who answered.
func callEcho(t *testing.T, n *Node, peer, want string) {
	t.Helper()
	var r struct{ Node, From string }
	if err := n.Call(context.Background(), peer, "echo", map[string]int{"x": 1}, &r); err != nil {
		t.Fatalf("Call(%s, echo) = %v", peer, err)
	}
	if r.Node != want || r.From != n.cfg.Node {
		t.Fatalf("Call(%s, echo) answered by %q for %q, want %q for %q", peer, r.Node, r.From, want, n.cfg.Node)
	}
}
