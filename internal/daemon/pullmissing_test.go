package daemon

import (
	"context"
	"encoding/json"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/gpushm/gpushm/internal/peer"
	"github.com/gpushm/gpushm/internal/segment"
)

// lister is a peer that offers what a test says and counts what it is
// asked: lists and pulls, by name. Its answers to pull wait until the
// test lets them go, then refuse.
type lister struct {
	mu      sync.Mutex
	offers  []peer.Offer
	lists   map[string]int
	pulls   map[string]int
	release chan struct{}
}

func (l *lister) serve(ctx context.Context, from, op string, req json.RawMessage) (any, error) {
	var r struct {
		Name   string `json:"name"`
		Prefix string `json:"prefix"`
	}
	json.Unmarshal(req, &r)
	l.mu.Lock()
	switch op {
	case opPull:
		l.pulls[r.Name]++
		l.mu.Unlock()
		select {
		case <-l.release:
		case <-ctx.Done():
		}
		return nil, peer.Errorf(peer.CodeBusy, "not today")
	case peer.OpList:
		l.lists[r.Prefix]++
		defer l.mu.Unlock()
		var out peer.ListReply
		for _, o := range l.offers {
			if o.Name == r.Prefix {
				out.Offers = append(out.Offers, o)
			}
		}
		return out, nil
	}
	l.mu.Unlock()
	return struct{}{}, nil
}

func (l *lister) counts(name string) (lists, pulls int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.lists[name], l.pulls[name]
}

// running is how many pulls for waiting opens are counted now.
func (m *missingPulls) inFlight() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.n
}

func waitUntil(t *testing.T, what string, ok func() bool) {
	t.Helper()
	for deadline := time.Now().Add(20 * time.Second); !ok(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("not within 20s: %s", what)
		}
	}
}

// TestPullMissingBounds: a user's opens that wait for names missing here,
// asking again and again, as a waiting open does at each look: they start
// at most maxMissingPullsPerUser pulls at once, and the daemon at most
// maxMissingPulls, so that root still gets one; a name the peer lists as
// a segment the user could not open is never asked of it to lend, and not
// listed again within missingRetry, though root's wait for it pulls it; a
// name nobody offers is listed once within missingRetry; a name here is
// never asked for.
func TestPullMissingBounds(t *testing.T) {
	asNobody := nobodyCred(t)
	defer func(a, b int, d time.Duration) { maxMissingPulls, maxMissingPullsPerUser, missingRetry = a, b, d }(maxMissingPulls, maxMissingPullsPerUser, missingRetry)
	maxMissingPulls, maxMissingPullsPerUser, missingRetry = 3, 2, time.Hour

	l := &lister{lists: map[string]int{}, pulls: map[string]int{}, release: make(chan struct{})}
	for _, n := range []string{"n0", "n1", "n2", "n3", "n4"} {
		l.offers = append(l.offers, peer.Offer{Name: n, Size: 4096, Owner: "nobody", Mode: 0o600})
	}
	l.offers = append(l.offers, peer.Offer{Name: "roots", Size: 4096, Owner: "root", Group: "root", Mode: 0o600},
		peer.Offer{Name: "here", Size: 4096, Owner: "root", Mode: 0o644})
	log := slog.New(slog.DiscardHandler)
	evil, err := peer.Start(context.Background(), peer.Config{Node: "evil", Secret: testSecret, Listen: "127.0.0.1:0", Handler: l.serve, Log: log})
	if err != nil {
		t.Fatal(err)
	}
	defer evil.Close()
	n, err := peer.Start(context.Background(), peer.Config{Node: "here", Secret: testSecret, Peers: []string{evil.Addr().String()}, Log: log})
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	waitUntil(t, "connected to the peer", func() bool { ps := n.Peers(); return len(ps) == 1 && ps[0].Connected })
	reg := newRegistry(t)
	p := &peers{reg: reg, node: n, pullMissing: true}
	p.missing.start()
	defer p.missing.stop()

	// A name the peer lists as root's 0600: nobody's wait lists it once,
	// and never has it lent.
	for range 5 {
		p.wantMissing(asNobody, "roots", true)
		waitUntil(t, "nobody's look at roots ends", func() bool { return p.missing.inFlight() == 0 })
	}
	if lists, pulls := l.counts("roots"); lists != 1 || pulls != 0 {
		t.Fatalf("nobody's waits for root's 0600 segment: listed %d times, lent %d times; want 1, 0", lists, pulls)
	}
	// A name nobody offers: listed once within missingRetry.
	for range 5 {
		p.wantMissing(asNobody, "ghost", true)
		waitUntil(t, "nobody's look at ghost ends", func() bool { return p.missing.inFlight() == 0 })
	}
	if lists, _ := l.counts("ghost"); lists != 1 {
		t.Fatalf("waits for a name nobody offers listed it %d times, want 1", lists)
	}
	// A name here is nobody's business to pull.
	if _, _, err := reg.Create(segment.Root, segment.CreateOptions{Name: "here", Size: 4096, Mode: 0o644, UseMode: true}); err != nil {
		t.Fatal(err)
	}
	p.wantMissing(asNobody, "here", true)
	if lists, _ := l.counts("here"); lists != 0 || p.missing.inFlight() != 0 {
		t.Fatalf("a wait for a name here listed it %d times, %d pulls", lists, p.missing.inFlight())
	}

	// Five names, each asked for ten times: two pulls.
	for range 10 {
		for _, name := range []string{"n0", "n1", "n2", "n3", "n4"} {
			p.wantMissing(asNobody, name, false)
		}
	}
	if r := p.missing.inFlight(); r != 2 {
		t.Fatalf("nobody's waits for five names started %d pulls, want 2", r)
	}
	lent := func(names ...string) int {
		sum := 0
		for _, name := range names {
			_, pulls := l.counts(name)
			sum += pulls
		}
		return sum
	}
	waitUntil(t, "two loans asked for", func() bool { return lent("n0", "n1", "n2", "n3", "n4") == 2 })
	// root's wait for roots gets the third place, the last: another
	// user's wait starts nothing.
	p.wantMissing(segment.Root, "roots", true)
	p.wantMissing(segment.Cred{UID: 4242, GID: 4242}, "n4", true)
	if r := p.missing.inFlight(); r != 3 {
		t.Fatalf("pulls running: %d, want 3", r)
	}
	waitUntil(t, "root's wait has roots lent", func() bool { return lent("roots") == 1 })
	if got := lent("n0", "n1", "n2", "n3", "n4"); got != 2 {
		t.Fatalf("%d loans of nobody's names asked for, want 2", got)
	}

	// Refused, the pulls end; the names are not asked for again within
	// missingRetry, whoever waits.
	var failed []string
	for _, name := range []string{"n0", "n1", "n2", "n3", "n4", "roots"} {
		if lent(name) == 1 {
			failed = append(failed, name)
		}
	}
	close(l.release)
	waitUntil(t, "the pulls end", func() bool { return p.missing.inFlight() == 0 })
	for _, name := range failed {
		p.wantMissing(segment.Root, name, true)
		if r := p.missing.inFlight(); r != 0 {
			t.Fatalf("%s, whose pull failed, asked for again at once", name)
		}
		if _, err := reg.Stat(name); err == nil {
			t.Fatalf("%s was left behind by a failed pull", name)
		}
	}
	if got := lent(failed...); got != 3 {
		t.Fatalf("loans asked for: %d, want 3", got)
	}
}
