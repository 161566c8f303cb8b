package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/testutil"
	"github.com/gpushm/gpushm/internal/wire"
)

// peersOf is what 'gpushm peers -o json' says of the daemon at sock.
func peersOf(t *testing.T, sock string) *wire.PeersReport {
	t.Helper()
	var r *wire.PeersReport
	if err := json.Unmarshal([]byte(mustRun(t, nil, "--socket", sock, "peers", "-o", "json")), &r); err != nil {
		t.Fatal(err)
	}
	return r
}

// waitPeers waits until ok takes the report of the daemon at sock.
func waitPeers(t *testing.T, sock, what string, ok func(*wire.PeersReport) bool) *wire.PeersReport {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); ; {
		r := peersOf(t, sock)
		if ok(r) {
			return r
		}
		if time.Now().After(deadline) {
			out, _ := json.Marshal(r)
			t.Fatalf("%s: not within 30s: %s", what, out)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func peerNamed(r *wire.PeersReport, name string) *wire.PeerNode {
	for i := range r.Peers {
		if r.Peers[i].Name == name {
			return &r.Peers[i]
		}
	}
	return nil
}

func offerNames(p *wire.PeerNode) []string {
	if p == nil {
		return nil
	}
	var names []string
	for _, o := range p.Offers {
		names = append(names, o.Name)
	}
	slices.Sort(names)
	return names
}

// writeSecret writes a peers' secret file of the daemon's user.
func writeSecret(t *testing.T, secret string) string {
	t.Helper()
	f := filepath.Join(t.TempDir(), "peer-secret")
	if err := os.WriteFile(f, []byte(secret), 0o600); err != nil {
		t.Fatal(err)
	}
	return f
}

// TestPeers: three daemons, each in a network namespace of its own on a
// network nothing else reaches: b dials a, and each sees what the other
// offers, only what its owner offered; c, with another secret, is refused
// by a, which says so in its log, and learns nothing.
func TestPeers(t *testing.T) {
	net := testutil.NetNamespaces(t, 3)
	good := writeSecret(t, strings.Repeat("s3cret-of-the-cluster-", 3))
	bad := writeSecret(t, strings.Repeat("not-the-cluster-secret-", 3))
	start := func(i int, node, secret string, args ...string) *Daemon {
		sock := filepath.Join(testutil.SocketDir(t), "gpushm.sock")
		args = append([]string{"--node", node, "--peer-secret", secret}, args...)
		return Start(t, Options{Socket: sock, Args: args, Wrap: func(name string, args ...string) *exec.Cmd {
			return net.Command(i, name, args...)
		}})
	}
	a := start(0, "a", good, "--listen-peers", net.IP(0)+":7946")
	b := start(1, "b", good, "--listen-peers", net.IP(1)+":7946", "--peers", net.IP(0)+":7946")
	c := start(2, "c", bad, "--peers", net.IP(0)+":7946")

	putFile(t, a.Socket(), "model", tierPattern(1, 1<<20), "--offer")
	putFile(t, a.Socket(), "private", tierPattern(2, 1<<20))
	mustRun(t, nil, "--socket", b.Socket(), "create", "--offer", "kv", "64K")

	r := waitPeers(t, b.Socket(), "b sees a offering model", func(r *wire.PeersReport) bool {
		return slices.Equal(offerNames(peerNamed(r, "a")), []string{"model"})
	})
	if o := peerNamed(r, "a").Offers[0]; o.Size != 1<<20 || o.Owner != "root" || o.Version != 1 {
		t.Fatalf("b's view of a's model: %+v", o)
	}
	waitPeers(t, a.Socket(), "a sees b (which dialed it) offering kv", func(r *wire.PeersReport) bool {
		p := peerNamed(r, "b")
		return p != nil && p.Connected && !p.Outbound && slices.Equal(offerNames(p), []string{"kv"})
	})
	if p := peerNamed(peersOf(t, a.Socket()), "c"); p != nil {
		t.Fatalf("a lists c, whose secret is another: %+v", p)
	}
	cr := waitPeers(t, c.Socket(), "c refused", func(r *wire.PeersReport) bool {
		return len(r.Peers) == 1 && !r.Peers[0].Connected && r.Peers[0].LastError != ""
	})
	if len(cr.Peers[0].Offers) != 0 {
		t.Fatalf("c, refused, learned of offers: %+v", cr.Peers[0])
	}
	for deadline := time.Now().Add(20 * time.Second); !strings.Contains(a.log.String(), "refused"); {
		if time.Now().After(deadline) {
			t.Fatal("a's log does not say it refused c")
		}
		time.Sleep(50 * time.Millisecond)
	}

	// Taken back, the name is no longer offered; the text output says so.
	mustRun(t, nil, "--socket", a.Socket(), "unoffer", "model")
	waitPeers(t, b.Socket(), "b sees a offer nothing", func(r *wire.PeersReport) bool {
		p := peerNamed(r, "a")
		return p != nil && p.Connected && len(p.Offers) == 0
	})
	if out := mustRun(t, nil, "--socket", b.Socket(), "peers"); !strings.Contains(out, "node b") || !strings.Contains(out, "(none)") {
		t.Fatalf("gpushm peers on b:\n%s", out)
	}
	// Cut off, a is reported as not connected, with why.
	net.Cut(0)
	waitPeers(t, b.Socket(), "b sees a gone after the link is cut", func(r *wire.PeersReport) bool {
		for _, p := range r.Peers {
			if p.Outbound && !p.Connected && p.LastError != "" {
				return true
			}
		}
		return false
	})
}

// TestPeersNeedASecret: peers without a secret, or with one others may
// read, stop the daemon at its start, saying what to do.
func TestPeersNeedASecret(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(testutil.SocketDir(t), "gpushm.sock")
	r := cli(t, nil, "daemon", "--socket", sock, "--backend", "host", "--listen-peers", "127.0.0.1:0")
	if r.code == 0 || !strings.Contains(r.stderr, "--peer-secret") {
		t.Fatalf("daemon --listen-peers without a secret: exit %d, %q", r.code, r.stderr)
	}
	open := filepath.Join(dir, "secret")
	os.WriteFile(open, []byte(strings.Repeat("x", 40)), 0o644)
	r = cli(t, nil, "daemon", "--socket", sock, "--backend", "host", "--listen-peers", "127.0.0.1:0", "--peer-secret", open)
	if r.code == 0 || !strings.Contains(r.stderr, "peer-secret") {
		t.Fatalf("daemon with a secret others may read: exit %d, %q", r.code, r.stderr)
	}

}

// TestPull: b pulls what a offers over UCX, between helper processes,
// every byte checked, 20 rounds; what nobody offers is not found; a peer
// that serves a wrong byte (c, told to by a test switch) is caught by the
// checksums and leaves nothing behind; with a gone, a pull without --from
// gets the name from a peer that still offers it and sends it whole (d),
// whatever c does.
func TestPull(t *testing.T) {
	testutil.RequireUCX(t)
	nodes := newPeerNodes(t, 4)
	a := nodes.start(t, 0, "a", nil)
	c := nodes.start(t, 2, "c", []string{"GPUSHM_TEST_LEND_CORRUPT=1"})
	d := nodes.start(t, 3, "d", nil)
	b := nodes.start(t, 1, "b", nil, "--peers", nodes.addr(0)+","+nodes.addr(2)+","+nodes.addr(3))
	m := tierPattern(7, 20<<20+12345) // two chunks and a bit
	for _, x := range []*Daemon{a, c, d} {
		putFile(t, x.Socket(), "m", m, "--offer", "--mode", "0640")
	}
	waitPeers(t, b.Socket(), "b connected to a, c and d", func(r *wire.PeersReport) bool {
		n := 0
		for _, p := range r.Peers {
			if p.Connected && slices.Equal(offerNames(&p), []string{"m"}) {
				n++
			}
		}
		return n == 3
	})
	for round := range 20 {
		mustRun(t, nil, "--socket", b.Socket(), "pull", "m", "--from", "a")
		checkBytes(t, b.Socket(), "m", m)
		if s := statOf(t, b.Socket(), "m"); s.Mode != "0640" {
			t.Fatalf("round %d: the pulled segment's mode %s, want a's 0640", round, s.Mode)
		}
		mustRun(t, nil, "--socket", b.Socket(), "rm", "m")
	}
	mustFail(t, "no connected peer offers it", "--socket", b.Socket(), "pull", "nothing")
	mustFail(t, "checksum", "--socket", b.Socket(), "pull", "m", "--from", "c")
	if got := tiersOf(t, b.Socket()); got["m"] != "" {
		t.Fatalf("a failed pull left %v", got)
	}
	// The lender killed mid-transfer: the pull goes on at the next peer
	// that offers the name (c lies, d does not), and nothing partial is
	// ever served.
	big := tierPattern(8, 256<<20)
	for _, x := range []*Daemon{a, c, d} {
		putFile(t, x.Socket(), "big", big, "--offer")
	}
	pulled := make(chan result, 1)
	go func() {
		cmd := exec.Command(gpushmBin, "--socket", b.Socket(), "pull", "big")
		out, err := cmd.CombinedOutput()
		code := 0
		if err != nil {
			code = 1
		}
		pulled <- result{stdout: string(out), code: code}
	}()
	killed := false
	for deadline := time.Now().Add(20 * time.Second); !killed && time.Now().Before(deadline); {
		for _, pid := range testutil.PidsNamed("gpushm-lend") {
			syscall.Kill(pid, syscall.SIGKILL)
			killed = true
		}
		time.Sleep(time.Millisecond)
	}
	r := <-pulled
	if !killed || r.code != 0 {
		t.Fatalf("pull with its first lender killed: killed %v, exit %d: %s", killed, r.code, r.stdout)
	}
	checkBytes(t, b.Socket(), "big", big)

	// a gone: a pull of m finds it at c, which lies, and at d.
	a.Kill()
	mustRun(t, nil, "--socket", b.Socket(), "pull", "m")
	checkBytes(t, b.Socket(), "m", m)
}

// pullNodes starts n daemons in namespaces of their own, each dialing all
// the others, with the args given to all.
func pullNodes(t *testing.T, n int, args ...string) ([]*Daemon, *testutil.Net) {
	t.Helper()
	nodes := newPeerNodes(t, n)
	var ds []*Daemon
	for i := range n {
		var others []string
		for j := range n {
			if j != i {
				others = append(others, nodes.addr(j))
			}
		}
		ds = append(ds, nodes.start(t, i, string(rune('a'+i)), nil, append([]string{"--peers", strings.Join(others, ",")}, args...)...))
	}
	for i, d := range ds {
		waitPeers(t, d.Socket(), fmt.Sprintf("node %d connected to all", i), func(r *wire.PeersReport) bool {
			n := 0
			for _, p := range r.Peers {
				if p.Connected {
					n++
				}
			}
			return n >= len(ds)-1
		})
	}
	return ds, nodes.net
}

// peerNodes are daemons in network namespaces of their own, sharing a
// secret; node i listens for peers on its namespace's address, port 7946.
type peerNodes struct {
	net    *testutil.Net
	secret string
}

func newPeerNodes(t *testing.T, n int) *peerNodes {
	t.Helper()
	return &peerNodes{net: testutil.NetNamespaces(t, n), secret: writeSecret(t, strings.Repeat("s3cret-of-the-cluster-", 3))}
}

// start starts node i, named node, with env added to its environment.
func (p *peerNodes) start(t *testing.T, i int, node string, env []string, args ...string) *Daemon {
	t.Helper()
	sock := filepath.Join(testutil.SocketDir(t), "gpushm.sock")
	os.Chmod(filepath.Dir(sock), 0o755) // other users are clients too
	args = append([]string{"--node", node, "--peer-secret", p.secret, "--listen-peers", p.addr(i)}, args...)
	return Start(t, Options{Socket: sock, Args: args, Wrap: func(name string, args ...string) *exec.Cmd {
		cmd := p.net.Command(i, name, args...)
		cmd.Env = append(os.Environ(), env...)
		return cmd
	}})
}

func (p *peerNodes) addr(i int) string { return p.net.IP(i) + ":7946" }

// pullAll has each of the daemons pull name at once, and says how long
// the last took.
func pullAll(t *testing.T, ds []*Daemon, name string) time.Duration {
	t.Helper()
	start := time.Now()
	errs := make(chan error, len(ds))
	for _, d := range ds {
		go func() {
			out, err := exec.Command(gpushmBin, "--socket", d.Socket(), "pull", name).CombinedOutput()
			if err != nil {
				err = fmt.Errorf("%v: %s", err, out)
			}
			errs <- err
		}()
	}
	for range ds {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	return time.Since(start)
}

// TestPullFanOut: three nodes pull the same name from one at once. The
// source lends it to the first to ask and sends the others along a
// chain, each lending the chunks it has checked to the next; every node
// ends with every byte, and at least one of them got it from another
// receiver. Then a chain whose middle node dies: the node after it
// finishes from the source.
func TestPullFanOut(t *testing.T) {
	testutil.RequireUCX(t)
	ds, _ := pullNodes(t, 4)
	w := tierPattern(11, 96<<20+777) // six chunks and a bit
	putFile(t, ds[0].Socket(), "w", w, "--offer", "--mode", "0644")
	for _, d := range ds[1:] {
		waitPeers(t, d.Socket(), "w offered", func(r *wire.PeersReport) bool { return slices.Contains(offerNames(peerNamed(r, "a")), "w") })
	}
	pullAll(t, ds[1:], "w")
	chained := 0
	for _, d := range ds[1:] {
		checkBytes(t, d.Socket(), "w", w)
		if strings.Contains(d.log.String(), "source=a") && !strings.Contains(d.log.String(), "from=a source=a") {
			chained++
		}
	}
	if chained == 0 {
		t.Errorf("no node pulled w along a chain; logs:\n%s\n%s\n%s", ds[1].log.String(), ds[2].log.String(), ds[3].log.String())
	}
	t.Logf("%d of 3 nodes pulled w from another receiver", chained)

	// A chain's middle node killed mid-transfer: the others still end
	// with every byte, from the source or another copy.
	big := tierPattern(12, 384<<20)
	putFile(t, ds[0].Socket(), "big", big, "--offer")
	for _, d := range ds[1:] {
		waitPeers(t, d.Socket(), "big offered", func(r *wire.PeersReport) bool { return slices.Contains(offerNames(peerNamed(r, "a")), "big") })
	}
	errs := make(chan error, 2)
	for _, d := range []*Daemon{ds[1], ds[3]} {
		go func() {
			out, err := exec.Command(gpushmBin, "--socket", d.Socket(), "pull", "big").CombinedOutput()
			if err != nil {
				err = fmt.Errorf("%v: %s", err, out)
			}
			errs <- err
		}()
	}
	// Node c joins once a pull is under way, and is killed while it
	// fetches.
	time.Sleep(100 * time.Millisecond)
	go exec.Command(gpushmBin, "--socket", ds[2].Socket(), "pull", "big").Run()
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		if strings.Contains(ds[2].log.String(), "big") || len(testutil.PidsNamed("gpushm-fetch")) >= 3 {
			break
		}
	}
	ds[2].Kill()
	for range 2 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	checkBytes(t, ds[1].Socket(), "big", big)
	checkBytes(t, ds[3].Socket(), "big", big)
}

// TestPullPartition: the link to the lending node is cut mid-transfer;
// the pull fails within the stall time with an error that names the peer
// and says it sent nothing, and nothing is left behind.
func TestPullPartition(t *testing.T) {
	testutil.RequireUCX(t)
	ds, net := pullNodes(t, 2, "--pull-stall", "3s")
	big := tierPattern(13, 512<<20)
	putFile(t, ds[0].Socket(), "big", big, "--offer")
	waitPeers(t, ds[1].Socket(), "big offered", func(r *wire.PeersReport) bool { return slices.Contains(offerNames(peerNamed(r, "a")), "big") })
	c, err := gpushm.Dial(context.Background(), ds[1].Socket())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	done := make(chan error, 1)
	go func() {
		out, err := exec.Command(gpushmBin, "--socket", ds[1].Socket(), "pull", "big").CombinedOutput()
		if err == nil {
			done <- nil
			return
		}
		done <- fmt.Errorf("%s", out)
	}()
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(time.Millisecond) {
		if p, _ := c.PullProgress(context.Background(), "big"); p != nil && p.Done > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the pull made no progress within 30s")
		}
	}
	net.Cut(0)
	start := time.Now()
	err = <-done
	if err == nil {
		t.Skip("the pull finished before the link was cut")
	}
	d := time.Since(start)
	if msg := err.Error(); !strings.Contains(msg, "from a") || !strings.Contains(msg, "3s") {
		t.Errorf("the pull's error names no peer or stall: %s", msg)
	}
	if d > 60*time.Second {
		t.Errorf("the pull failed %v after the cut, with a stall time of 3s", d)
	}
	t.Logf("%v after the cut: %v", d, err)
	if got := tiersOf(t, ds[1].Socket()); got["big"] != "" {
		t.Fatalf("a partitioned pull left %v", got)
	}
}

// TestPeerService: three daemons in network namespaces of their own, each
// given one name whose every address is a peer (--peer-service), as a
// Kubernetes headless Service's is: /etc/hosts in each namespace gives it
// the three addresses. The name does not resolve at first (a Service
// with no endpoints yet): the daemons start anyway and say why. Then each
// connects to the other two, not to itself, and lists each once though
// each also dials it; a node gone from the name is dropped by the others
// at their next resolution (it still dials them: they list it as a node
// that dialed in).
func TestPeerService(t *testing.T) {
	net := testutil.NetNamespaces(t, 3)
	secret := writeSecret(t, strings.Repeat("s3cret-of-the-cluster-", 3))
	names := []string{"a", "b", "c"}
	var lines []string
	for i := range names {
		lines = append(lines, net.IP(i)+" gpushm-peers.test")
		net.Hosts(i) // no such name yet
	}
	const service = "gpushm-peers.test:7946"
	var ds []*Daemon
	for i, node := range names {
		sock := filepath.Join(testutil.SocketDir(t), "gpushm.sock")
		args := []string{"--node", node, "--peer-secret", secret, "--listen-peers", ":7946",
			"--peer-service", service, "--peer-service-every", "100ms"}
		ds = append(ds, Start(t, Options{Socket: sock, Args: args, Wrap: func(name string, args ...string) *exec.Cmd {
			return net.Command(i, name, args...)
		}}))
	}
	r := waitPeers(t, ds[0].Socket(), "a says the service does not resolve", func(r *wire.PeersReport) bool {
		return r.ServiceError != ""
	})
	if r.Service != service || !strings.Contains(r.ServiceError, "no such host") || len(r.Peers) != 0 {
		t.Fatalf("a, its service not resolving: %+v", r)
	}
	if out := mustRun(t, nil, "--socket", ds[0].Socket(), "peers"); !strings.Contains(out, "every address of "+service+", not resolved") {
		t.Fatalf("gpushm peers on a:\n%s", out)
	}

	// dialing says what a node's report must be: its peers, by name, each
	// once, connected, and whether it dials them.
	want := func(what string, i int, dialing map[string]bool) {
		t.Helper()
		waitPeers(t, ds[i].Socket(), what, func(r *wire.PeersReport) bool {
			if len(r.Peers) != len(dialing) || r.ServiceError != "" {
				return false
			}
			for _, p := range r.Peers {
				if out, ok := dialing[p.Name]; !ok || !p.Connected || p.Outbound != out {
					return false
				}
			}
			return true
		})
	}
	for i := range names {
		net.Hosts(i, lines...)
	}
	want("a dials b and c", 0, map[string]bool{"b": true, "c": true})
	want("b dials a and c", 1, map[string]bool{"a": true, "c": true})
	want("c dials a and b", 2, map[string]bool{"a": true, "b": true})
	for i, d := range ds {
		if strings.Contains(d.log.String(), "this node's name") {
			t.Errorf("%s dialed itself:\n%s", names[i], d.log.String())
		}
	}

	// c leaves the name as a and b resolve it.
	net.Hosts(0, lines[:2]...)
	net.Hosts(1, lines[:2]...)
	want("a drops c, which still dials it", 0, map[string]bool{"b": true, "c": false})
	want("b drops c, which still dials it", 1, map[string]bool{"a": true, "c": false})
	want("c still dials a and b", 2, map[string]bool{"a": true, "b": true})
}
