package peer

import (
	"context"
	"fmt"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gpushm/gpushm/internal/testutil"
)

// dns answers for one name with the addresses a test sets, or, with none,
// as a DNS server does for a headless Service with no endpoints yet.
type dns struct {
	mu    sync.Mutex
	name  string
	addrs []string
}

func (d *dns) set(addrs ...string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.addrs = addrs
}

func (d *dns) LookupHost(ctx context.Context, host string) ([]string, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if host != d.name || len(d.addrs) == 0 {
		return nil, &net.DNSError{Err: "no such host", Name: host, IsNotFound: true}
	}
	return slices.Clone(d.addrs), nil
}

// peerSet describes n's peers as "name>" (dialed) or "name<" (dialed by
// it), connected ones only, sorted, and says how many entries n lists.
func peerSet(n *Node) (string, int) {
	var s []string
	ps := n.Peers()
	for _, p := range ps {
		if p.Connected {
			s = append(s, p.Name+map[bool]string{true: ">", false: "<"}[p.Outbound])
		}
	}
	slices.Sort(s)
	return strings.Join(s, " "), len(ps)
}

// TestService: three nodes find each other through one name whose every
// address is a peer. At first it does not resolve (no endpoints yet),
// which is logged and waited out; then each node dials the other two,
// not itself, and lists each once though each is also dialed by it; an
// address gone from the answer is dropped, its connection closed (the
// node it was is listed as dialing in, as it still does), and one back
// in the answer is dialed again.
func TestService(t *testing.T) {
	// One port on three loopback addresses: a service's port is every
	// peer's. 127.0.0.2 to .4 are lo's, as all of 127/8 is, and unused.
	ln, err := net.Listen("tcp", "127.0.0.2:0")
	if err != nil {
		t.Fatal(err)
	}
	port := strconv.Itoa(ln.Addr().(*net.TCPAddr).Port)
	ln.Close()
	ips := []string{"127.0.0.2", "127.0.0.3", "127.0.0.4"}
	d := &dns{name: "peers.test"}
	var nodes []*Node
	var logs []*logBuf
	for i, name := range []string{"a", "b", "c"} {
		n, l := start(t, Config{Node: name, Listen: net.JoinHostPort(ips[i], port), Service: "peers.test:" + port,
			Resolver: d, ResolveEvery: 20 * time.Millisecond})
		nodes, logs = append(nodes, n), append(logs, l)
	}
	waitLog(t, logs[0], "peer service not resolved", "peers.test", "no such host")

	want := func(what string, sets ...string) {
		t.Helper()
		testutil.WaitFor(t, what, func() bool {
			for i, n := range nodes {
				if s, _ := peerSet(n); s != sets[i] {
					return false
				}
			}
			return true
		})
	}
	d.set(ips...)
	want("each node dialing the other two", "b> c>", "a> c>", "a> b>")
	for i, n := range nodes {
		if s, all := peerSet(n); all != 2 {
			t.Errorf("node %d lists %d peers (%s), want the other two once each: %+v", i, all, s, n.Peers())
		}
		if logs[i].has("this node's name") {
			t.Errorf("node %d dialed itself:\n%s", i, logs[i])
		}
	}

	// c leaves the answer: a and b drop it; c, whose own answer is the
	// same, still dials them.
	d.set(ips[0], ips[1])
	want("c dropped by a and b", "b> c<", "a> c<", "a> b>")
	for _, n := range nodes[:2] {
		for _, p := range n.Peers() {
			if p.Outbound && p.Addr == net.JoinHostPort(ips[2], port) {
				t.Errorf("c's address, gone from the answer, still dialed: %+v", p)
			}
		}
	}
	d.set(ips...)
	want("c dialed again", "b> c>", "a> c>", "a> b>")
	callEcho(t, nodes[0], "c", "c")
}

// TestServiceConfig: a service needs a host and a port by number.
func TestServiceConfig(t *testing.T) {
	for _, s := range []string{"peers.test", "peers.test:http", ":7946", "peers.test:0", "peers.test:70000"} {
		n, err := Start(context.Background(), Config{Node: "a", Secret: secretA, Service: s})
		if err == nil {
			n.Close()
			t.Errorf("Start with service %q: no error", s)
		}
	}
}

// TestServiceForged: a forged answer naming mallory, who holds another
// secret, and 5000 other addresses (loopback ones where nothing listens)
// makes a node dial 1024 of them, saying so, and trust none: mallory is
// refused, as a peer configured by address would be.
func TestServiceForged(t *testing.T) {
	m, lm := start(t, Config{Node: "mallory", Secret: secretB, Listen: "127.0.0.5:0"})
	port := strconv.Itoa(m.Addr().(*net.TCPAddr).Port)
	d := &dns{name: "peers.test"}
	many := []string{"127.0.0.5"}
	for i := range 5000 {
		many = append(many, fmt.Sprintf("127.1.%d.%d", i/250, 1+i%250))
	}
	d.set(many...)
	n, l := start(t, Config{Node: "a", Service: "peers.test:" + port, Resolver: d, ResolveEvery: time.Hour})
	waitLog(t, l, "too many addresses", "addresses=5001", "dialed=1024")
	waitLog(t, l, "peer refused", m.Addr().String())
	waitLog(t, lm, "peer refused", "proof does not match")
	testutil.WaitFor(t, "1024 dialed", func() bool { return len(n.Peers()) == 1024 })
	for _, p := range n.Peers() {
		if p.Connected || p.Name != "" {
			t.Fatalf("a peer of a forged answer: %+v", p)
		}
	}
	if connected(m, "a") {
		t.Fatal("mallory connected to a")
	}
}
