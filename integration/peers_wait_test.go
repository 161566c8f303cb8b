package integration

import (
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpushm/gpushm/internal/testutil"
	"github.com/gpushm/gpushm/internal/wire"
)

// Opens that wait for a name a peer has (--pull-missing), and pulls
// across a crash of the receiving daemon's serving process (docs/peers.md,
// "Opens that wait for a peer's segment" and "Faults").

// logged counts the lines of d's log with the message msg about name.
func logged(d *Daemon, msg, name string) int {
	n := 0
	for _, line := range strings.Split(d.log.String(), "\n") {
		if strings.Contains(line, `msg="`+msg+`"`) && strings.Contains(line+" ", " name="+name+" ") {
			n++
		}
	}
	return n
}

// waitLogged waits until d's log has at least n lines of msg about name.
func waitLogged(t *testing.T, d *Daemon, msg, name string, n int) {
	t.Helper()
	for deadline := time.Now().Add(60 * time.Second); logged(d, msg, name) < n; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%q about %s logged %d times, want %d, within 60s", msg, name, logged(d, msg, name), n)
		}
	}
}

// The daemons' log messages the tests count.
const (
	msgLend    = "lending a segment to a peer"
	msgPulling = "pulling a name that opens wait for"
	msgGate    = "test gate: a pull waits before its commit"
	msgReplied = "test gate: a pull waits before its reply"
	msgWaits   = "open waits for a commit"
	msgDenied  = "not pulling a name for an open that could not open it"
	msgNoOffer = "an open waits for a name no connected peer offers"
)

// getter is a 'gpushm get --wait' in a process of its own.
type getter struct {
	cmd    *exec.Cmd
	out    string
	stderr bytes.Buffer
}

// startGet starts 'gpushm get --wait WAIT NAME FILE' on sock, as cred if
// not nil (then running bin, a copy others may run).
func startGet(t *testing.T, bin string, cred *syscall.Credential, sock, name, wait string) *getter {
	t.Helper()
	// Under /tmp, not the test's directory: others may not enter that.
	dir, err := os.MkdirTemp("", "gpushm-get-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	os.Chmod(dir, 0o777)
	g := &getter{out: filepath.Join(dir, name+".out")}
	g.cmd = exec.Command(bin, "--socket", sock, "get", "-q", "--wait", wait, name, g.out)
	g.cmd.Stderr = &g.stderr
	if cred != nil {
		g.cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	}
	if err := g.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { g.cmd.Process.Kill(); g.cmd.Wait() })
	return g
}

// got waits for g and checks it wrote want.
func (g *getter) got(t *testing.T, want []byte) {
	t.Helper()
	if err := g.cmd.Wait(); err != nil {
		t.Fatalf("%v: %v: %s", g.cmd.Args, err, g.stderr.String())
	}
	if b, err := os.ReadFile(g.out); err != nil || !bytes.Equal(b, want) {
		t.Fatalf("%v wrote %d bytes, want the %d offered, equal %v (%v)", g.cmd.Args, len(b), len(want), bytes.Equal(b, want), err)
	}
}

// failed waits for g and checks it failed saying want.
func (g *getter) failed(t *testing.T, want string) {
	t.Helper()
	if err := g.cmd.Wait(); err == nil || !testutil.ErrorSays(g.stderr.String(), want) {
		t.Fatalf("%v: %v, %q; want a failure saying %q", g.cmd.Args, err, g.stderr.String(), want)
	}
	if _, err := os.Stat(g.out); err == nil {
		t.Fatalf("%v failed and wrote its file", g.cmd.Args)
	}
}

// waitOffers waits until b sees a offering every one of names.
func waitOffers(t *testing.T, b *Daemon, a string, names ...string) {
	t.Helper()
	waitPeers(t, b.Socket(), "b sees "+a+" offer "+strings.Join(names, ","), func(r *wire.PeersReport) bool {
		have := offerNames(peerNamed(r, a))
		for _, n := range names {
			if !slices.Contains(have, n) {
				return false
			}
		}
		return true
	})
}

// TestPullMissing: with --pull-missing, opens in four processes that wait
// for a name missing here, which a peer offers, all get it, every byte,
// from one pull: the lender lent it once, and the receiver started one
// pull, which all four waited for. The pulled segment is as 'gpushm pull'
// makes it (root's, the offer's mode). A name no peer offers is asked
// for once per missingRetry, however long its open waits.
func TestPullMissing(t *testing.T) {
	a, b, gate := gatedPeers(t, "GPUSHM_TEST_PULL_GATE", true, "--pull-missing")
	m := tierPattern(11, 20<<20+777) // two chunks and a bit
	putFile(t, a.Socket(), "m", m, "--offer", "--mode", "0644")
	waitOffers(t, b, "a", "m")

	const waiters = 4
	var gets []*getter
	for range waiters {
		gets = append(gets, startGet(t, gpushmBin, nil, b.Socket(), "m", "2m"))
	}
	// Every open waits, and the pull is held before its commit: however
	// many waiters asked, one pull runs, and the lender lent once.
	waitLogged(t, b, msgWaits, "m", waiters)
	waitLogged(t, b, msgGate, "m", 1)
	if n, l := logged(b, msgPulling, "m"), logged(a, msgLend, "m"); n != 1 || l != 1 {
		t.Fatalf("%d waiting opens: %d pulls started, %d loans; want one of each", waiters, n, l)
	}
	os.Remove(gate)
	for _, g := range gets {
		g.got(t, m)
	}
	if n, l := logged(b, msgPulling, "m"), logged(a, msgLend, "m"); n != 1 || l != 1 {
		t.Fatalf("after the waiters got m: %d pulls, %d loans; want one of each", n, l)
	}
	if s := statOf(t, b.Socket(), "m"); s.Mode != "0644" {
		t.Fatalf("the pulled segment's mode %s, want the offer's 0644", s.Mode)
	}

	// Nobody offers it: the open waits its time out, and the peers are
	// asked once per missingRetry (10 s) at most, not at each look.
	start := time.Now()
	startGet(t, gpushmBin, nil, b.Socket(), "nothing", "3s").failed(t, "committed within")
	if n, most := logged(b, msgNoOffer, "nothing"), 1+int(time.Since(start)/(10*time.Second)); n < 1 || n > most {
		t.Fatalf("a 3 s wait for a name nobody offers asked the peers %d times, want 1 to %d", n, most)
	}
}

// TestHostilePullMissing: a user's waits cannot make the daemon pull what
// that user could not open once pulled, nor more than two pulls at once,
// nor get a segment it may not read that another's wait pulled; a user's
// waits within the bounds get their segments, every byte.
func TestHostilePullMissing(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("running clients as other users needs root")
	}
	a, b, gate := gatedPeers(t, "GPUSHM_TEST_PULL_GATE", false, "--pull-missing")
	bin := binaryForOthers(t)
	nobody := &syscall.Credential{Uid: 65534, Gid: 65534}
	secret := tierPattern(21, 1<<20)
	putFile(t, a.Socket(), "secret", secret, "--offer", "--mode", "0600")
	names := []string{"s1", "s2", "s3", "s4"}
	data := map[string][]byte{}
	for i, n := range names {
		data[n] = tierPattern(uint64(30+i), 1<<20+int64(i))
		putFile(t, a.Socket(), n, data[n], "--offer", "--mode", "0644")
	}
	waitOffers(t, b, "a", append([]string{"secret"}, names...)...)

	// root's 0600 segment: nobody's wait does not have it pulled.
	startGet(t, bin, nobody, b.Socket(), "secret", "2s").failed(t, "committed within")
	if d, l := logged(b, msgDenied, "secret"), logged(a, msgLend, "secret"); d != 1 || l != 0 {
		t.Fatalf("nobody's wait for root's 0600 segment: refused %d times, lent %d times; want 1, 0", d, l)
	}

	// Four names at once: two pulls for nobody, the most one user's
	// waits start; the others wait for a place.
	os.WriteFile(gate, nil, 0o600)
	var gets []*getter
	for _, n := range names {
		gets = append(gets, startGet(t, bin, nobody, b.Socket(), n, "2m"))
	}
	for _, n := range names {
		waitLogged(t, b, msgWaits, n, 1)
	}
	held := func() (pulls, gated int) {
		for _, n := range names {
			pulls += logged(b, msgPulling, n)
			gated += logged(b, msgGate, n)
		}
		return
	}
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		if _, gated := held(); gated >= 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("two pulls for nobody's waits did not reach the gate within 60s")
		}
	}
	if pulls, _ := held(); pulls != 2 {
		t.Fatalf("nobody's four waits started %d pulls, want 2", pulls)
	}
	// root is not held back by nobody's pulls.
	rootGet := startGet(t, gpushmBin, nil, b.Socket(), "secret", "2m")
	waitLogged(t, b, msgGate, "secret", 1)
	os.Remove(gate)
	for i, g := range gets {
		g.got(t, data[names[i]])
	}
	rootGet.got(t, secret)
	lent := 0
	for _, n := range names {
		lent += logged(a, msgLend, n)
	}
	if pulls, _ := held(); pulls != len(names) || lent != len(names) {
		t.Fatalf("nobody's four waits: %d pulls, %d loans; want one each", pulls, lent)
	}

	// Pulled by root's wait, root's 0600 segment is not nobody's to read.
	startGet(t, bin, nobody, b.Socket(), "secret", "2s").failed(t, "permission denied")
	if l := logged(a, msgLend, "secret"); l != 1 {
		t.Fatalf("secret lent %d times, want once (root's wait)", l)
	}
}

// idState is a segment's id, and whether it is uncommitted.
type idState struct {
	ID          uint64 `json:"id"`
	Uncommitted bool   `json:"uncommitted"`
}

// segmentNamed is what 'gpushm stat -o json' says of a segment, or nil
// when there is no such segment.
func segmentNamed(t *testing.T, sock, name string) *idState {
	t.Helper()
	r := cli(t, nil, "--socket", sock, "stat", "-o", "json", name)
	if r.code != 0 {
		if !strings.Contains(r.stderr, `"ENOENT"`) {
			t.Fatalf("stat %s: exit %d: %s", name, r.code, r.stderr)
		}
		return nil
	}
	var s idState
	if err := json.Unmarshal([]byte(r.stdout), &s); err != nil {
		t.Fatal(err)
	}
	return &s
}

// TestPullAcrossCrash: the receiving daemon's serving process is killed
// while a 'gpushm pull' and a pull for three waiting opens are under way
// (held before their commits). The next serving process serves neither
// uncommitted segment: each name is absent, or being pulled again under a
// new segment; no open gets either before its pull commits. The pull
// client sends its request again, the waiting opens theirs, and the new
// serving process pulls each name once more; all get every byte.
func TestPullAcrossCrash(t *testing.T) {
	a, b, gate := gatedPeers(t, "GPUSHM_TEST_PULL_GATE", true, "--pull-missing")
	big, w := tierPattern(41, 40<<20+4321), tierPattern(42, 20<<20+99)
	putFile(t, a.Socket(), "big", big, "--offer")
	putFile(t, a.Socket(), "w", w, "--offer")
	waitOffers(t, b, "a", "big", "w")

	puller, pullOut := startPull(t, b.Socket(), "big")
	var gets []*getter
	for range 3 {
		gets = append(gets, startGet(t, gpushmBin, nil, b.Socket(), "w", "2m"))
	}
	waitLogged(t, b, msgWaits, "w", 3)
	waitLogged(t, b, msgGate, "big", 1)
	waitLogged(t, b, msgGate, "w", 1)
	before := map[string]uint64{}
	for _, n := range []string{"big", "w"} {
		s := segmentNamed(t, b.Socket(), n)
		if s == nil || !s.Uncommitted {
			t.Fatalf("%s while its pull is held: %+v, want an uncommitted segment", n, s)
		}
		before[n] = s.ID
		mustFail(t, "still being written", "--socket", b.Socket(), "get", n, filepath.Join(t.TempDir(), "out"))
	}

	b.Crash(t)
	for _, n := range []string{"big", "w"} {
		if s := segmentNamed(t, b.Socket(), n); s != nil && (s.ID == before[n] || !s.Uncommitted) {
			t.Fatalf("%s after the crash: %+v; want no segment, or a new pull's uncommitted one (not %d)", n, s, before[n])
		}
		r := cli(t, nil, "--socket", b.Socket(), "get", n, filepath.Join(t.TempDir(), "out"))
		if r.code == 0 || !(testutil.ErrorSays(r.stderr, "still being written") || testutil.ErrorSays(r.stderr, "no such segment")) {
			t.Fatalf("get %s after the crash, before its pull commits: exit %d, %q", n, r.code, r.stderr)
		}
	}
	// Each pulled again, by the new serving process.
	waitLogged(t, b, msgGate, "big", 2)
	waitLogged(t, b, msgGate, "w", 2)
	os.Remove(gate)
	if err := puller.Wait(); err != nil {
		t.Fatalf("gpushm pull across the crash: %v: %s", err, pullOut.String())
	}
	checkBytes(t, b.Socket(), "big", big)
	for _, g := range gets {
		g.got(t, w)
	}
	for _, n := range []string{"big", "w"} {
		if l, g := logged(a, msgLend, n), logged(b, msgGate, n); l != 2 || g != 2 {
			t.Fatalf("%s: lent %d times, held %d times; want twice each (before and after the crash)", n, l, g)
		}
	}
	if s := segmentNamed(t, b.Socket(), "big"); s == nil || s.Uncommitted || s.ID == before["big"] {
		t.Fatalf("big after its pull: %+v", s)
	}
}

// TestPullCommittedBeforeACrash kills the receiving serving process after a
// pull's commit and before its reply: the client sends the pull again on
// its new connection, and it has its first attempt's outcome (the segment,
// whole) and not EEXIST, as other requests sent again do; the peer lends
// the segment once.
func TestPullCommittedBeforeACrash(t *testing.T) {
	a, b, gate := gatedPeers(t, "GPUSHM_TEST_PULL_REPLY_GATE", true)
	big := tierPattern(43, 30<<20+777)
	putFile(t, a.Socket(), "big", big, "--offer")
	waitOffers(t, b, "a", "big")

	puller, pullOut := startPull(t, b.Socket(), "big")
	waitLogged(t, b, msgReplied, "big", 1)
	if s := segmentNamed(t, b.Socket(), "big"); s == nil || s.Uncommitted {
		t.Fatalf("big while its pull's reply is held: %+v, want it committed", s)
	}

	b.Crash(t)
	os.Remove(gate)
	if err := puller.Wait(); err != nil {
		t.Fatalf("gpushm pull across a crash after its commit: %v: %s", err, pullOut.String())
	}
	if !strings.Contains(pullOut.String(), "pulled big") {
		t.Fatalf("gpushm pull said %q, want what it pulled", pullOut.String())
	}
	checkBytes(t, b.Socket(), "big", big)
	if l := logged(a, msgLend, "big"); l != 1 {
		t.Fatalf("big lent %d times; want once (the pull sent again is answered, not made again)", l)
	}
}

// startPull starts 'gpushm pull name' against socket in a process of its
// own, its output gathered; it is killed at the test's end if still there.
func startPull(t *testing.T, socket, name string) (*exec.Cmd, *bytes.Buffer) {
	t.Helper()
	out := new(bytes.Buffer)
	puller := exec.Command(gpushmBin, "--socket", socket, "pull", name)
	puller.Stdout, puller.Stderr = out, out
	if err := puller.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { puller.Process.Kill(); puller.Wait() })
	return puller, out
}

// gatedPeers starts two peer nodes, a and b (which dials a, with flags and
// --log-level debug), b's pulls held by the test gate env names (a file:
// GPUSHM_TEST_PULL_GATE before their commits, GPUSHM_TEST_PULL_REPLY_GATE
// before their replies) while the file gate exists; held makes it now.
func gatedPeers(t *testing.T, env string, held bool, flags ...string) (a, b *Daemon, gate string) {
	t.Helper()
	testutil.RequireUCX(t)
	nodes := newPeerNodes(t, 2)
	gate = filepath.Join(t.TempDir(), "gate")
	if held {
		if err := os.WriteFile(gate, nil, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	a = nodes.start(t, 0, "a", nil)
	b = nodes.start(t, 1, "b", []string{env + "=" + gate}, append([]string{"--peers", nodes.addr(0), "--log-level", "debug"}, flags...)...)
	return a, b, gate
}
