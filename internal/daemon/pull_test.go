package daemon

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"os/user"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/gpushm/gpushm/internal/backend"
	"github.com/gpushm/gpushm/internal/memfd"
	"github.com/gpushm/gpushm/internal/peer"
	"github.com/gpushm/gpushm/internal/pull"
	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/testutil"
	"github.com/gpushm/gpushm/internal/wire"
)

// TestMain runs the pull helpers when the test binary is started as one
// (pull starts os.Executable as 'gpushm __pull VERB').
func TestMain(m *testing.M) {
	pull.RunIfHelper()
	os.Exit(m.Run())
}

var testSecret = []byte("0123456789abcdef0123456789abcdef-test")

func newRegistry(t *testing.T) *segment.Registry {
	t.Helper()
	host, err := backend.NewHost()
	if err != nil {
		t.Fatal(err)
	}
	reg := segment.New(host, nil)
	t.Cleanup(func() { reg.Close() })
	return reg
}

// TestLoanCaps: a peer that asks for pulls and never says it is done gets
// at most maxLoansPerPeer lenders, all peers together maxLoans, each
// refused as busy before a lender starts; another peer's pull-done, even
// with the right token, ends no loan; each lender holds the segment as
// its descriptor 3, read-only, and no other memory of the daemon's; all
// end with the peers, leases and processes.
func TestLoanCaps(t *testing.T) {
	testutil.RequireUCX(t)
	defer func(a, b int) { maxLoansPerPeer, maxLoans = a, b }(maxLoansPerPeer, maxLoans)
	maxLoansPerPeer, maxLoans = 2, 3

	reg := newRegistry(t)
	// A peer borrows a name once at a time (TestLoanOfANameAgain): its
	// loans here are of three names.
	for _, name := range []string{"m", "m2", "m3"} {
		if _, _, err := reg.Create(segment.Root, segment.CreateOptions{Name: name, Size: 64 << 10, Offer: true}); err != nil {
			t.Fatal(err)
		}
	}
	// A decoy the lenders must not hold: another segment of the daemon's.
	if _, _, err := reg.Create(segment.Root, segment.CreateOptions{Name: "private", Size: 64 << 10}); err != nil {
		t.Fatal(err)
	}
	p := &peers{reg: reg}
	defer p.endLoans()
	ctx := context.Background()
	lend := func(from, name string) (pullReply, error) {
		v, err := p.serve(ctx, from, opPull, json.RawMessage(fmt.Sprintf(`{"name":%q,"direct":true}`, name)))
		if err != nil {
			return pullReply{}, err
		}
		return v.(pullReply), nil
	}
	busy := &peer.Error{Code: peer.CodeBusy}
	x1, err := lend("x", "m")
	if err != nil {
		t.Fatal(err)
	}
	// While x borrows m, others asking are sent along a chain: y to x,
	// z to y; a redirect holds nothing here.
	for _, c := range [][2]string{{"y", "x"}, {"z", "y"}} {
		v, err := p.serve(ctx, c[0], opPull, json.RawMessage(`{"name":"m"}`))
		if r, _ := v.(pullReply); err != nil || r.Via != c[1] || r.Token != "" {
			t.Fatalf("%s's pull while x borrows: %+v, %v; want a redirect to %s", c[0], v, err, c[1])
		}
	}
	if _, err := lend("x", "m2"); err != nil {
		t.Fatal(err)
	}
	if _, err := lend("x", "m3"); !errors.Is(err, busy) {
		t.Fatalf("a third loan to x, over maxLoansPerPeer 2: %v", err)
	}
	if _, err := lend("y", "m"); err != nil {
		t.Fatal(err)
	}
	if _, err := lend("z", "m"); !errors.Is(err, busy) {
		t.Fatalf("a fourth loan, over maxLoans 3: %v", err)
	}
	if _, err := p.serve(ctx, "x", opPull, json.RawMessage(`{"name":"private"}`)); !errors.Is(err, &peer.Error{Code: peer.CodeNotFound}) {
		t.Fatalf("pull of a segment not offered: %v", err)
	}
	lenders := testutil.ChildrenNamed("gpushm-lend")
	if len(lenders) != 3 {
		t.Fatalf("%d lenders, want 3", len(lenders))
	}
	for _, pid := range lenders {
		checkLenderFDs(t, pid)
	}

	// y's word ends none of x's loans, even with x's token.
	p.serve(ctx, "y", opPullDone, json.RawMessage(fmt.Sprintf(`{"token":%q}`, x1.Token)))
	if _, err := lend("x", "m3"); !errors.Is(err, busy) {
		t.Fatalf("after y ended x's loan: %v", err)
	}
	p.serve(ctx, "x", opPullDone, json.RawMessage(fmt.Sprintf(`{"token":%q}`, x1.Token)))
	if _, err := lend("x", "m3"); err != nil {
		t.Fatalf("after x ended its loan: %v", err)
	}

	p.endLoans()
	for deadline := time.Now().Add(10 * time.Second); len(testutil.ChildrenNamed("gpushm-lend")) > 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("lenders left after the loans ended: %v", testutil.ChildrenNamed("gpushm-lend"))
		}
	}
	for _, name := range []string{"m", "m2", "m3"} {
		if inf, _ := reg.Stat(name); inf.Opens != 0 {
			t.Fatalf("leases of %s left after the loans ended: %d", name, inf.Opens)
		}
	}
	if p.loans.n != 0 || len(p.loans.byPeer) != 0 {
		t.Fatalf("loans counted after they ended: %d, %v", p.loans.n, p.loans.byPeer)
	}
}

// TestLoanOfANameAgain: a peer that asks again for a name it borrows
// (its serving process was killed mid-pull, and its successor pulls the
// name anew) ends its older loan of it at once, lender and lease, rather
// than after loanTime: a node pulls a name once at a time. Another peer's
// loan of the name, and the peer's loans of other names, stay.
func TestLoanOfANameAgain(t *testing.T) {
	testutil.RequireUCX(t)
	reg := newRegistry(t)
	for _, name := range []string{"m", "n"} {
		if _, _, err := reg.Create(segment.Root, segment.CreateOptions{Name: name, Size: 64 << 10, Offer: true}); err != nil {
			t.Fatal(err)
		}
	}
	p := &peers{reg: reg}
	defer p.endLoans()
	ctx := context.Background()
	lend := func(from, name string) pullReply {
		t.Helper()
		v, err := p.serve(ctx, from, opPull, json.RawMessage(fmt.Sprintf(`{"name":%q,"direct":true}`, name)))
		if err != nil {
			t.Fatal(err)
		}
		return v.(pullReply)
	}
	first, yours, other := lend("x", "m"), lend("y", "m"), lend("x", "n")
	again := lend("x", "m")
	p.loans.mu.Lock()
	_, stale := p.loans.m[first.Token]
	var tokens []string
	for tok := range p.loans.m {
		tokens = append(tokens, tok)
	}
	byX := p.loans.byPeer["x"]
	p.loans.mu.Unlock()
	if stale || len(tokens) != 3 || byX != 2 {
		t.Fatalf("after x asked for m again: the first loan left %v, loans %d (want 3), x's %d (want 2)", stale, len(tokens), byX)
	}
	for _, tok := range []string{yours.Token, other.Token, again.Token} {
		if !slices.Contains(tokens, tok) {
			t.Fatalf("loan %s ended; only x's first loan of m was to", tok)
		}
	}
	if inf, _ := reg.Stat("m"); inf.Opens != 2 {
		t.Fatalf("m held by %d leases, want 2 (y's loan and x's new one)", inf.Opens)
	}
	for deadline := time.Now().Add(10 * time.Second); len(testutil.ChildrenNamed("gpushm-lend")) != 3; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d lenders, want 3: the first loan's lender was not ended", len(testutil.ChildrenNamed("gpushm-lend")))
		}
	}
}

// checkLenderFDs: every memory descriptor of the lender is of the segment
// it lends, and read-only.
func checkLenderFDs(t *testing.T, pid int) {
	t.Helper()
	// UCX may open the memory it registers again (read-only, through
	// /proc): the same segment is fine, any other memory is not.
	var seg syscall.Stat_t
	if err := syscall.Stat(fmt.Sprintf("/proc/%d/fd/3", pid), &seg); err != nil {
		t.Fatal(err)
	}
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		path := fmt.Sprintf("/proc/%d/fd/%s", pid, e.Name())
		target, _ := os.Readlink(path)
		var st syscall.Stat_t
		if !strings.HasPrefix(target, "/memfd:") || syscall.Stat(path, &st) != nil {
			continue
		}
		if st.Ino != seg.Ino || st.Dev != seg.Dev {
			t.Errorf("lender %d: descriptor %s is memory other than the segment it lends: %s", pid, e.Name(), target)
		}
		info, _ := os.ReadFile(fmt.Sprintf("/proc/%d/fdinfo/%s", pid, e.Name()))
		if !strings.Contains(string(info), "flags:") || !readOnly(string(info)) {
			t.Errorf("lender %d: descriptor %s of the segment is not read-only: %s", pid, e.Name(), info)
		}
	}
}

// readOnly says whether an fdinfo's flags open the file read-only.
func readOnly(fdinfo string) bool {
	for line := range strings.Lines(fdinfo) {
		if f, ok := strings.CutPrefix(line, "flags:"); ok {
			flags, err := strconv.ParseUint(strings.TrimSpace(f), 8, 64)
			return err == nil && flags&syscall.O_ACCMODE == syscall.O_RDONLY
		}
	}
	return false
}

// hostile is a peer that holds the secret and answers pull as a test
// says.
type hostile struct {
	mu     sync.Mutex
	pulls  int
	done   []string
	offers []peer.Offer
	reply  func(ctx context.Context) (any, error)
}

func (h *hostile) serve(ctx context.Context, from, op string, req json.RawMessage) (any, error) {
	switch op {
	case opPull:
		h.mu.Lock()
		h.pulls++
		reply := h.reply
		h.mu.Unlock()
		return reply(ctx)
	case opPullDone:
		var r struct {
			Token string `json:"token"`
		}
		json.Unmarshal(req, &r)
		h.mu.Lock()
		h.done = append(h.done, r.Token)
		h.mu.Unlock()
		return struct{}{}, nil
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	return peer.ListReply{Offers: h.offers}, nil
}

// nobodyCred is the credential of the user nobody, a user who is not
// root; the test skips where there is none.
func nobodyCred(t *testing.T) segment.Cred { return userCred(t, "nobody") }

// userCred is the credential of the user name (its own group); the test
// skips where there is none.
func userCred(t *testing.T, name string) segment.Cred {
	t.Helper()
	u, err := user.Lookup(name)
	if err != nil {
		t.Skipf("no user %s", name)
	}
	uid, _ := strconv.ParseUint(u.Uid, 10, 32)
	gid, _ := strconv.ParseUint(u.Gid, 10, 32)
	return segment.Cred{UID: uint32(uid), GID: uint32(gid)}
}

// hostilePeer starts a peer node whose answers h gives, and peers of a
// registry of this test's connected to it.
func hostilePeer(t *testing.T) (*hostile, *peers) {
	t.Helper()
	log := slog.New(slog.DiscardHandler)
	h := &hostile{}
	evil, err := peer.Start(context.Background(), peer.Config{Node: "evil", Secret: testSecret, Listen: "127.0.0.1:0", Handler: h.serve, Log: log})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { evil.Close() })
	n, err := peer.Start(context.Background(), peer.Config{Node: "here", Secret: testSecret, Peers: []string{evil.Addr().String()}, Log: log})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { n.Close() })
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if ps := n.Peers(); len(ps) == 1 && ps[0].Connected {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("not connected to the hostile peer within 10s")
		}
	}
	return h, &peers{reg: newRegistry(t), node: n}
}

// TestHostileRedirect: a peer that redirects a pull to itself, again and
// again, even when asked directly: the redirect is followed once, then
// the source asked directly, then the pull given up, leaving nothing.
func TestHostileRedirect(t *testing.T) {
	h, p := hostilePeer(t)
	h.mu.Lock()
	h.reply = func(context.Context) (any, error) { return pullReply{Via: "evil"}, nil }
	h.mu.Unlock()
	if _, err := p.pull(context.Background(), segment.Root, "x", "evil", ""); err == nil {
		t.Error("a peer that only redirects: the pull succeeded")
	}
	if _, err := p.reg.Stat("x"); err == nil {
		t.Error("a peer that only redirects: the segment was left behind")
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.pulls > 3 {
		t.Errorf("a peer that only redirects was asked %d times, want at most 3", h.pulls)
	}
}

// TestHostilePeer: a peer that holds the secret and lies in its answer
// to a pull: a segment that would be root's, pulled by a user; meta
// beyond what a client may set; a size beyond the owner's quota; no
// answer at all; and a name already taken here. Each is refused before a
// fetcher starts, leaves nothing behind, and ends the peer's loan; a pull
// by a user of what the peer lists as another's is refused before the
// peer is asked to lend.
func TestHostilePeer(t *testing.T) {
	h, p := hostilePeer(t)
	reg := p.reg
	asNobody := nobodyCred(t)

	grant := func(size int64) pull.Grant {
		return pull.Grant{Worker: []byte("w"), RKey: []byte("k"), BoardKey: []byte("b"), Addr: 4096, Size: size, Chunk: pull.Chunk}
	}
	meta := json.RawMessage(`{"pad":"` + strings.Repeat("x", 40<<10) + `"}`)
	reg.SetLimits(segment.Limits{UserBytes: 1 << 20})

	for _, tc := range []struct {
		what  string
		cred  segment.Cred
		reply pullReply
		want  error
	}{
		{"root's, mode 07777, pulled by nobody", asNobody, pullReply{Token: "t1", Grant: grant(4096), Owner: "root", Group: "root", Mode: 0o7777}, syscall.EPERM},
		{"another user's, pulled by nobody", asNobody, pullReply{Token: "t2", Grant: grant(4096), Owner: "daemon", Mode: 0o666}, syscall.EPERM},
		{"an owner unknown here, pulled by nobody", asNobody, pullReply{Token: "t3", Grant: grant(4096), Owner: "no-such-user-here", Mode: 0o666}, syscall.EPERM},
		{"meta of 40 KiB", segment.Root, pullReply{Token: "t4", Grant: grant(4096), Owner: "nobody", Mode: 0o600, Meta: meta}, syscall.EINVAL},
		{"64 MiB for an owner allowed 1 MiB", asNobody, pullReply{Token: "t5", Grant: grant(64 << 20), Owner: "nobody", Mode: 0o600}, syscall.ENOSPC},
	} {
		h.mu.Lock()
		h.reply = func(context.Context) (any, error) { return tc.reply, nil }
		h.done = nil
		h.mu.Unlock()
		_, err := p.pull(context.Background(), tc.cred, "x", "evil", "")
		if !errors.Is(err, tc.want) {
			t.Errorf("%s: %v, want %v", tc.what, err, tc.want)
		}
		if _, err := reg.Stat("x"); err == nil {
			t.Errorf("%s: the segment was left behind", tc.what)
		}
		// The loan is ended in the background.
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
			h.mu.Lock()
			done := slices.Clone(h.done)
			h.mu.Unlock()
			if len(done) == 1 && done[0] == tc.reply.Token {
				break
			}
			if len(done) > 1 || time.Now().After(deadline) {
				t.Errorf("%s: pull-done with %q, want the loan's %q", tc.what, done, tc.reply.Token)
				break
			}
		}
	}

	// Listed as root's: nobody's pull is refused without asking the peer
	// to lend.
	h.mu.Lock()
	h.offers, h.pulls = []peer.Offer{{Name: "x", Size: 4096, Owner: "root", Mode: 0o666}}, 0
	h.mu.Unlock()
	if _, err := p.pull(context.Background(), asNobody, "x", "evil", ""); !errors.Is(err, syscall.EPERM) {
		t.Errorf("nobody's pull of what the peer lists as root's: %v", err)
	}
	h.mu.Lock()
	if h.pulls != 0 {
		t.Errorf("nobody's pull of what the peer lists as root's asked it to lend %d times", h.pulls)
	}
	h.offers = nil
	h.mu.Unlock()

	// No answer: the pull is given up within pullCallTime.
	defer func(d time.Duration) { pullCallTime = d }(pullCallTime)
	pullCallTime = 300 * time.Millisecond
	h.mu.Lock()
	h.reply = func(ctx context.Context) (any, error) { <-ctx.Done(); return nil, ctx.Err() }
	h.mu.Unlock()
	start := time.Now()
	if _, err := p.pull(context.Background(), segment.Root, "x", "evil", ""); !errors.Is(err, peer.ErrTimeout) {
		t.Errorf("a peer that never answers: %v", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("a peer that never answers held the pull %v", d)
	}

	// A name taken here: the peer is not asked to lend.
	if _, _, err := reg.Create(segment.Root, segment.CreateOptions{Name: "taken", Size: 4096}); err != nil {
		t.Fatal(err)
	}
	h.mu.Lock()
	h.pulls = 0
	h.mu.Unlock()
	if _, err := p.pull(context.Background(), segment.Root, "taken", "evil", ""); !errors.Is(err, syscall.EEXIST) {
		t.Errorf("pull over a name taken here: %v", err)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.pulls != 0 {
		t.Errorf("pull over a name taken here asked the peer to lend %d times", h.pulls)
	}
}

// TestChainBoardOthersCannotWrite: a chain's lender holds a read-only
// descriptor of the board of the fetch it lends from, as lendPulling gives
// it. Taken over through UCX (it runs as the helpers' user), it must not
// be able to open the board again for writing through /proc/self/fd: the
// chain's other lenders would trust what it wrote there (chunks counted
// ready before they are fetched, and their checksums).
func TestChainBoardOthersCannotWrite(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: the attacker runs as the helpers' user")
	}
	helper := userCred(t, pull.HelperUser)
	board, err := newBoard("m", 4*pull.Chunk)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Close(board)
	ro, err := memfd.ReadOnly(board)
	if err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(ro), "board")
	defer f.Close()
	// The attacker: the lender's descriptor 3, opened again read-write,
	// and the board's count of chunks ready made 255.
	cmd := exec.Command("/bin/sh", "-c", `printf '\377' 1<>/proc/self/fd/3`)
	cmd.ExtraFiles = []*os.File{f}
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: helper.UID, Gid: helper.GID}}
	out, err := cmd.CombinedOutput()
	b := make([]byte, 8)
	if _, err := syscall.Pread(board, b, 0); err != nil {
		t.Fatal(err)
	}
	if err == nil || b[0] != 0 {
		t.Fatalf("uid %d, holding the board read-only, wrote it (%v, %s): its first byte is %#x", helper.UID, err, out, b[0])
	}
}

// TestStoppedChainLender: the helpers run as the helpers' user, whose
// other processes (any process of that user, a helper taken over through
// UCX among them) may stop them. One that stops a chain's lender before
// it answers holds neither the peer's call, nor its loan, nor every local
// user's 'peers' for longer than pull.StartTime: the lender is killed and
// the loan given back.
func TestStoppedChainLender(t *testing.T) {
	testutil.RequireUCX(t)
	if os.Geteuid() != 0 {
		t.Skip("needs root: the helpers drop to their user only from root")
	}
	helper := userCred(t, pull.HelperUser)
	defer func(d time.Duration) { pull.StartTime = d }(pull.StartTime)
	pull.StartTime = 2 * time.Second

	// A pull of m in progress here, as pullOnce lists it once it has its
	// peer's grant.
	const size = 64 << 10
	reg := newRegistry(t)
	s, _, err := reg.Create(segment.Root, segment.CreateOptions{Name: "m", Size: size, Open: true, Uncommitted: true, Offer: true})
	if err != nil {
		t.Fatal(err)
	}
	board, err := newBoard("m", size)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Close(board)
	pl := &pulling{ready: make(chan struct{}), seg: s, info: reg.Info(s), board: board, reply: pullReply{Owner: "root", Mode: 0o600}, from: "source"}
	close(pl.ready)
	p := &peers{reg: reg, pulling: map[string]*pulling{"m": pl}}
	defer p.endLoans()

	// stop is the attacker: a process of the helpers' user that stops
	// the lender as soon as it may (once the helper has dropped to that
	// user), until the call ends.
	stop := func(done <-chan error) (int, error, bool) {
		for {
			for _, pid := range testutil.ChildrenNamed("gpushm-lend") {
				kill := exec.Command("/bin/kill", "-STOP", strconv.Itoa(pid))
				kill.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: helper.UID, Gid: helper.GID}}
				if kill.Run() == nil {
					return pid, nil, false
				}
			}
			select {
			case err := <-done:
				return 0, err, true
			case <-time.After(100 * time.Microsecond):
			}
		}
	}
	for try := 1; ; try++ {
		done := make(chan error, 1)
		go func() {
			_, err := p.serve(context.Background(), "y", opPull, json.RawMessage(`{"name":"m","chain":true}`))
			done <- err
		}()
		pid, err, ended := stop(done)
		if !ended {
			select {
			case err, ended = <-done:
			case <-time.After(300 * time.Millisecond):
			}
		}
		if ended {
			// The lender answered before it was stopped: again.
			if err != nil {
				t.Fatalf("a chain's loan: %v", err)
			}
			if pid > 0 {
				syscall.Kill(pid, syscall.SIGCONT)
			}
			p.endLoans()
			if try == 20 {
				t.Skip("the lender answered before it could be stopped, 20 times")
			}
			continue
		}
		t.Logf("try %d: lender %d stopped before it answered", try, pid)
		// Whatever happens below, the stopped helper goes at the end.
		defer func() {
			if slices.Contains(testutil.ChildrenNamed("gpushm-lend"), pid) {
				syscall.Kill(pid, syscall.SIGKILL)
			}
		}()

		reported := make(chan *wire.PeersReport, 1)
		go func() { reported <- p.report(context.Background(), "") }()
		select {
		case r := <-reported:
			if len(r.Pulls) != 1 || r.Pulls[0].Name != "m" {
				t.Errorf("peers while a chain's lender is stopped: pulls %+v, want m's", r.Pulls)
			}
		case <-time.After(time.Second):
			t.Errorf("peers, asked by any local user, still waits 1s after a chain's lender was stopped")
		}
		select {
		case err := <-done:
			if err == nil {
				t.Fatal("a chain's loan through a stopped lender succeeded")
			}
			t.Logf("the chain's loan: %v", err)
		case <-time.After(pull.StartTime + 10*time.Second):
			t.Fatalf("a peer's call still waits for a stopped lender %v after pull.StartTime", 10*time.Second)
		}
		break
	}
	for deadline := time.Now().Add(10 * time.Second); len(testutil.ChildrenNamed("gpushm-lend")) > 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("lenders left after a stopped one was given up: %v", testutil.ChildrenNamed("gpushm-lend"))
		}
	}
	if p.loans.n != 0 || len(p.loans.byPeer) != 0 {
		t.Fatalf("loans counted after a stopped lender was given up: %d, %v", p.loans.n, p.loans.byPeer)
	}
}

// TestPulledGroupNotHere: a peer's segment whose group has no such name
// here. Its group bits were given to that group: they must not go to the
// group of the owner's name here (users, say), whose members the owner
// never chose; a group of that name here keeps them, and an owner unknown
// here makes it root's, 0600.
func TestPulledGroupNotHere(t *testing.T) {
	nobody := nobodyCred(t)
	uid, own := nobody.UID, nobody.GID
	group, err := user.LookupGroupId(strconv.FormatUint(uint64(own), 10))
	if err != nil {
		t.Skipf("nobody's group %d has no name", own)
	}
	for _, tc := range []struct {
		group      string
		mode, want uint32
	}{
		{"no-such-group-here", 0o664, 0o604},
		{"", 0o660, 0o600},
		{group.Name, 0o660, 0o660},
	} {
		c, mode := localOwner(&pullReply{Owner: "nobody", Group: tc.group, Mode: tc.mode})
		if c.UID != uid || c.GID != own || mode != tc.want {
			t.Errorf("nobody's, group %q, mode %#o: uid %d, gid %d, mode %#o; want uid %d, gid %d, mode %#o",
				tc.group, tc.mode, c.UID, c.GID, mode, uid, own, tc.want)
		}
	}
	if c, mode := localOwner(&pullReply{Owner: "no-such-user-here", Group: group.Name, Mode: 0o666}); c != root || mode != 0o600 {
		t.Errorf("an owner unknown here: %+v, %#o; want root's, 0600", c, mode)
	}
}
