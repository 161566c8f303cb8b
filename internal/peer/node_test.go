package peer

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"
)

func TestHandshake(t *testing.T) {
	a, _ := start(t, Config{Node: "a", Listen: "127.0.0.1:0"})
	b, _ := start(t, Config{Node: "b", Peers: []string{a.Addr().String()}})
	waitConnected(t, b, "a")
	callEcho(t, b, "a", "a")
	callEcho(t, b, a.Addr().String(), "a")
	// The listener calls back over the connection the dialer made.
	waitConnected(t, a, "b")
	callEcho(t, a, "b", "b")

	err := b.Call(context.Background(), "a", "missing", nil, nil)
	if !errors.Is(err, &Error{Code: CodeNotFound}) || !strings.Contains(err.Error(), "peer a") {
		t.Errorf("Call(missing) = %v, want %s naming peer a", err, CodeNotFound)
	}
	err = b.Call(context.Background(), "a", "nosuch", nil, nil)
	if !errors.Is(err, &Error{Code: CodeUnknownOp}) {
		t.Errorf("Call(nosuch) = %v, want %s", err, CodeUnknownOp)
	}
	err = b.Call(context.Background(), "c", "echo", nil, nil)
	if !errors.Is(err, ErrNotConnected) || !strings.Contains(err.Error(), "peer c") {
		t.Errorf("Call to an unknown peer = %v, want ErrNotConnected naming it", err)
	}
}

func TestList(t *testing.T) {
	offers := []Offer{{Name: "w0", Size: 4096, Owner: "alice", Mode: 0o644, Version: 3,
		Meta: []byte(`{"k":"v"}`), ChunkSize: 2048, CRCs: []uint32{1, 2}}}
	a, _ := start(t, Config{Node: "a", Listen: "127.0.0.1:0",
		Handler: func(ctx context.Context, from, op string, req json.RawMessage) (any, error) {
			var r ListRequest
			if op != OpList || strictJSON(req, &r) != nil {
				return nil, Errorf(CodeBadRequest, "want list")
			}
			return ListReply{Offers: offers}, nil
		}})
	b, _ := start(t, Config{Node: "b", Peers: []string{a.Addr().String()}})
	waitConnected(t, b, "a")
	got, err := b.List(context.Background(), "a", ListRequest{})
	if err != nil {
		t.Fatalf("List = %v", err)
	}
	if len(got) != 1 || got[0].Name != "w0" || got[0].Owner != "alice" || string(got[0].Meta) != `{"k":"v"}` || len(got[0].CRCs) != 2 {
		t.Fatalf("List = %+v, want %+v", got, offers)
	}
}

// TestWrongSecret: a node with another secret is refused, and both sides
// log it.
func TestWrongSecret(t *testing.T) {
	a, la := start(t, Config{Node: "a", Listen: "127.0.0.1:0"})
	m, lm := start(t, Config{Node: "mallory", Secret: secretB, Peers: []string{a.Addr().String()}})
	waitLog(t, la, "peer refused", "mallory", "proof does not match")
	waitLog(t, lm, "peer refused", "refused by the peer", "proof does not match")
	if connected(m, "a") || connected(a, "mallory") {
		t.Fatalf("a node with the wrong secret connected: a: %+v, mallory: %+v", a.Peers(), m.Peers())
	}
	if err := m.Call(context.Background(), "a", "echo", nil, nil); !errors.Is(err, ErrNotConnected) {
		t.Errorf("Call from a refused node = %v, want ErrNotConnected", err)
	}
	// The other way round: the listener's secret is the wrong one.
	m2, lm2 := start(t, Config{Node: "mallory2", Secret: secretB, Listen: "127.0.0.1:0"})
	_, lb := start(t, Config{Node: "b", Peers: []string{m2.Addr().String()}})
	waitLog(t, lm2, "peer refused", `node \"b\"`, "proof does not match")
	waitLog(t, lb, "peer refused", "refused by the peer")
}

// TestReconnect: a dialer comes back to a peer that restarts, at the same
// address.
func TestReconnect(t *testing.T) {
	a, _ := start(t, Config{Node: "a", Listen: "127.0.0.1:0"})
	addr := a.Addr().String()
	b, lb := start(t, Config{Node: "b", Peers: []string{addr}})
	waitConnected(t, b, "a")
	callEcho(t, b, "a", "a")
	a.Close()
	waitLog(t, lb, "peer lost", "peer=a")
	a2, _ := start(t, Config{Node: "a", Listen: addr})
	waitConnected(t, b, "a")
	callEcho(t, b, "a", "a")
	waitConnected(t, a2, "b")
	callEcho(t, a2, "b", "b")
}

// TestCallDeadline: a call the handler never answers ends at the ctx's
// deadline, or at CallTimeout, naming the peer; the handler's ctx ends
// with it.
func TestCallDeadline(t *testing.T) {
	a, _ := start(t, Config{Node: "a", Listen: "127.0.0.1:0"})
	b, _ := start(t, Config{Node: "b", Peers: []string{a.Addr().String()}, CallTimeout: 300 * time.Millisecond})
	waitConnected(t, b, "a")
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	for _, ctx := range []context.Context{ctx, context.Background()} {
		t0 := time.Now()
		err := b.Call(ctx, "a", "hang", nil, nil)
		if !errors.Is(err, ErrTimeout) || !strings.Contains(err.Error(), "peer a (") {
			t.Errorf("Call(hang) = %v, want ErrTimeout naming a", err)
		}
		if d := time.Since(t0); d > 5*time.Second {
			t.Errorf("Call(hang) took %v", d)
		}
	}
	callEcho(t, b, "a", "a")
}

func TestConfig(t *testing.T) {
	for _, c := range []Config{
		{Node: "a", Secret: []byte("short")},
		{Node: "a b", Secret: secretA},
		{Node: "a", Secret: secretA, Peers: []string{"nohostport"}},
	} {
		if n, err := Start(context.Background(), c); err == nil {
			n.Close()
			t.Errorf("Start(%+v) = nil, want an error", c)
		}
	}
}
