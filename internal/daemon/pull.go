package daemon

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os/user"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm/internal/memfd"
	"github.com/gpushm/gpushm/internal/owner"
	"github.com/gpushm/gpushm/internal/peer"
	"github.com/gpushm/gpushm/internal/pull"
	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/server"
	"github.com/gpushm/gpushm/internal/wire"
)

// Pulls between daemons (docs/peers.md): a peer asks for an offered
// segment ("pull"), this daemon lends it through a helper process
// (internal/pull) and answers with the helper's grant; the peer's fetcher
// gets it and says it is done ("pull-done"), or the loan ends on its own.

// Peer operations this daemon serves beside list.
const (
	opPull     = "pull"
	opPullDone = "pull-done"
)

// loanTime bounds a loan a peer never says it is done with.
const loanTime = 10 * time.Minute

// Each loan is a lender process that maps the whole segment and a lease
// that keeps it, for as long as loanTime when the peer never says it is
// done: what a peer, or a local user who asks the peer to pull, can make
// this daemon hold is bounded by these caps, a peer's own below the
// daemon's, so that one peer cannot take every loan from the others. They
// are variables for tests.
var (
	maxLoansPerPeer = 8
	maxLoans        = 64
)

// pullCallTime bounds the wait for a peer's answer to a pull (its lender
// started and checksummed the segment), so that a peer that never answers
// does not hold the request for the whole pull's time. A variable for
// tests.
var pullCallTime = 2 * time.Minute

// pullRequest asks a peer to lend Name. Chain asks a peer that is itself
// pulling Name to lend what it has so far (the source redirected the
// asker there); Direct asks the source not to redirect.
type pullRequest struct {
	Name   string `json:"name"`
	Chain  bool   `json:"chain,omitempty"`
	Direct bool   `json:"direct,omitempty"`
}

// pullReply is a loan (a token to end it, the lender's grant, and what the
// segment is), or a redirect: Via is the peer to ask instead, the last
// one this node lent Name to, which lends it on as it arrives.
type pullReply struct {
	Via     string          `json:"via,omitempty"`
	Token   string          `json:"token"`
	Grant   pull.Grant      `json:"grant"`
	Owner   string          `json:"owner"`
	Group   string          `json:"group"`
	Mode    uint32          `json:"mode"`
	Version uint64          `json:"version"`
	Meta    json.RawMessage `json:"meta,omitempty"`
}

type loan struct {
	from   string // the peer it was lent to: only it may end it
	name   string
	lender *pull.Lender
	seg    *segment.Segment // nil for a chain's loan of a pull in progress
	timer  *time.Timer
}

// loans are the segments this daemon lends now, by token, and how many
// each peer holds, counted from before its lender starts; and, by name,
// the last peer a segment was lent or redirected to while loans of it
// last: the tail of its chain.
type loans struct {
	mu     sync.Mutex
	m      map[string]*loan
	n      int
	byPeer map[string]int
	tails  map[string]string
}

// redirect says which peer from should pull name from instead of this
// node, and makes from the chain's tail: the last peer that asked for
// name while loans of it last, unless that is from itself. "" lends here.
// The tail is taken at the ask, not once the loan is made, so that asks
// that come together form a chain too.
func (ls *loans) redirect(name, from string) string {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if ls.tails == nil {
		ls.tails = map[string]string{}
	}
	tail := ls.tails[name]
	ls.tails[name] = from
	if tail == from {
		return ""
	}
	return tail
}

// untail drops from as name's tail: its loan failed before it was made.
func (ls *loans) untail(name, from string) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if ls.tails[name] == from {
		delete(ls.tails, name)
	}
}

// lent records a loan of name to from, under ls.mu.
func (ls *loans) lent(name, from string) {
	if ls.tails == nil {
		ls.tails = map[string]string{}
	}
	ls.tails[name] = from
}

// forget drops name's chain once no loan of it is left, under ls.mu.
func (ls *loans) forget(name string) {
	for _, ln := range ls.m {
		if ln.name == name {
			return
		}
	}
	delete(ls.tails, name)
}

// reserve counts a loan to from, or says why not.
func (ls *loans) reserve(from string) error {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	switch {
	case ls.byPeer[from] >= maxLoansPerPeer:
		return peer.Errorf(peer.CodeBusy, "pull: %s holds %d loans, the most a peer may; end one (pull-done) first", from, maxLoansPerPeer)
	case ls.n >= maxLoans:
		return peer.Errorf(peer.CodeBusy, "pull: this node lends %d segments, the most it lends at once; try later", maxLoans)
	}
	if ls.byPeer == nil {
		ls.byPeer = map[string]int{}
	}
	ls.n++
	ls.byPeer[from]++
	return nil
}

// unreserve gives back a loan to from that reserve counted.
func (ls *loans) unreserve(from string) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	ls.n--
	if ls.byPeer[from]--; ls.byPeer[from] == 0 {
		delete(ls.byPeer, from)
	}
}

var root = segment.Cred{}

// lend answers a peer's pull of name: only a segment its owner offered,
// held by a lease of the daemon's own for as long as the loan lasts; or,
// while another peer borrows it, a redirect to that peer (a chain); or,
// asked as part of a chain, what this node is pulling of it so far.
func (p *peers) lend(from string, req json.RawMessage) (any, error) {
	var r pullRequest
	if err := json.Unmarshal(req, &r); err != nil {
		return nil, peer.Errorf(peer.CodeBadRequest, "pull: %v", err)
	}
	reg := p.reg
	if inf, err := reg.Stat(r.Name); err != nil || !inf.Offer || inf.Uncommitted || inf.Slots > 0 || inf.Orphan != "" {
		if r.Chain {
			return p.lendPulling(from, r.Name)
		}
		return nil, peer.Errorf(peer.CodeNotFound, "pull: %q is not offered here", r.Name)
	}
	if !r.Chain {
		if via := p.loans.redirect(r.Name, from); via != "" && !r.Direct {
			return pullReply{Via: via}, nil
		}
	}
	p.endStale(from, r.Name)
	if err := p.loans.reserve(from); err != nil {
		p.loans.untail(r.Name, from)
		return nil, err
	}
	s, err := reg.Acquire(root, r.Name, true)
	if err != nil {
		p.loans.unreserve(from)
		p.loans.untail(r.Name, from)
		return nil, peer.Errorf(peer.CodeNotFound, "pull: %q: %v", r.Name, err)
	}
	inf := reg.Info(s)
	release := func() {
		reg.Release(s)
		p.loans.unreserve(from)
		p.loans.untail(r.Name, from)
	}
	if !inf.Offer {
		release() // taken back meanwhile
		return nil, peer.Errorf(peer.CodeNotFound, "pull: %q is not offered here", r.Name)
	}
	l, err := lendMemory(s, inf, -1)
	if err != nil {
		release()
		return nil, peer.Errorf(peer.CodeFailed, "pull: %q: %v", r.Name, err)
	}
	return p.loanOut(from, r.Name, l, s, pullReply{Owner: owner.User(inf.UID), Group: owner.Group(inf.GID),
		Mode: inf.Mode, Version: inf.Version, Meta: inf.Meta}), nil
}

// memoryOf says what a segment's descriptor is, for the helpers.
func memoryOf(inf segment.Info) (pull.Memory, error) {
	switch inf.HandleType {
	case wire.HandleMemfd:
		return pull.Host, nil
	case wire.HandleCUDA:
		return pull.Memory{CUDA: true, Device: inf.Device, Alloc: inf.AllocSize}, nil
	}
	return pull.Memory{}, fmt.Errorf("memory of kind %q cannot be lent", inf.HandleType)
}

// lendMemory starts a lender of s: a read-only descriptor of a memfd (a
// CUDA descriptor cannot be made read-only: the lender maps it so), and
// the board of the fetch still filling it, if any.
func lendMemory(s *segment.Segment, inf segment.Info, board int) (*pull.Lender, error) {
	m, err := memoryOf(inf)
	if err != nil {
		return nil, err
	}
	fd, err := s.FD()
	if err != nil {
		return nil, err
	}
	if !m.CUDA {
		if fd, err = memfd.ReadOnly(fd); err != nil {
			return nil, err
		}
		defer syscall.Close(fd)
	}
	return pull.Lend(fd, inf.Size, m, board)
}

// loanOut records a loan of name to from, ended by from's pull-done or
// after loanTime, and answers with its token and grant.
func (p *peers) loanOut(from, name string, l *pull.Lender, s *segment.Segment, r pullReply) pullReply {
	tok := make([]byte, 16)
	rand.Read(tok)
	token := hex.EncodeToString(tok)
	p.loans.mu.Lock()
	if p.loans.m == nil {
		p.loans.m = map[string]*loan{}
	}
	ln := &loan{from: from, name: name, lender: l, seg: s}
	ln.timer = time.AfterFunc(loanTime, func() { p.endLoan(token, from) })
	p.loans.m[token] = ln
	p.loans.lent(name, from)
	p.loans.mu.Unlock()
	r.Token, r.Grant = token, l.Grant
	return r
}

// lendPulling answers a chain's ask for name, which this node is pulling:
// a lender of the segment as it fills, which serves each chunk once this
// node's fetch has checked it. The answer says what the source said of
// the segment, not what this node made of it.
func (p *peers) lendPulling(from, name string) (any, error) {
	p.mu.Lock()
	pl := p.pulling[name]
	p.mu.Unlock()
	if pl == nil {
		return nil, peer.Errorf(peer.CodeNotFound, "pull: %q is neither offered nor being pulled here", name)
	}
	// Asked of this node right after it asked its own peer: wait for
	// that peer's grant.
	select {
	case <-pl.ready:
	case <-time.After(pullCallTime):
	}
	pl.mu.Lock()
	defer pl.mu.Unlock()
	if pl.gone || pl.seg == nil {
		return nil, peer.Errorf(peer.CodeNotFound, "pull: %q is not being pulled here any more", name)
	}
	p.endStale(from, name)
	if err := p.loans.reserve(from); err != nil {
		return nil, err
	}
	board, err := memfd.ReadOnly(pl.board)
	if err != nil {
		p.loans.unreserve(from)
		return nil, peer.Errorf(peer.CodeFailed, "pull: %q: %v", name, err)
	}
	defer syscall.Close(board)
	l, err := lendMemory(pl.seg, pl.info, board)
	if err != nil {
		p.loans.unreserve(from)
		return nil, peer.Errorf(peer.CodeFailed, "pull: %q: %v", name, err)
	}
	r := pl.reply
	r.Meta = append(json.RawMessage(nil), r.Meta...)
	return p.loanOut(from, name, l, nil, r), nil
}

// endLoan ends the loan token to the peer from: its lender exits, its
// lease goes. A token is secret to its peer, but another peer's word is
// not taken even so: a loan is ended only by the peer it was lent to.
func (p *peers) endLoan(token, from string) {
	p.loans.mu.Lock()
	ln := p.loans.m[token]
	if ln == nil || ln.from != from {
		p.loans.mu.Unlock()
		return
	}
	delete(p.loans.m, token)
	p.loans.forget(ln.name)
	p.loans.mu.Unlock()
	ln.timer.Stop()
	ln.lender.Close()
	if ln.seg != nil {
		p.reg.Release(ln.seg)
	}
	p.loans.unreserve(from)
}

// endStale ends from's loans of name: a node pulls a name once at a time,
// so a peer that asks for a name it borrows has given up its older loan
// without ending it (its serving process was killed mid-pull, and its
// successor pulls the name anew), and that loan's lender and lease would
// otherwise stay until loanTime.
func (p *peers) endStale(from, name string) {
	p.endLoansWhere(func(ln *loan) bool { return ln.from == from && ln.name == name })
}

// endChainLoans ends the chain's loans of name, made while this node
// pulled it: the pull failed, and the peers that borrow from it must fail
// now, not after their stall time.
func (p *peers) endChainLoans(name string) {
	p.endLoansWhere(func(ln *loan) bool { return ln.name == name && ln.seg == nil })
}

// endLoans ends every loan (the peers stop).
func (p *peers) endLoans() {
	p.endLoansWhere(func(*loan) bool { return true })
}

// endLoansWhere ends the loans that match, each as its peer's pull-done
// would.
func (p *peers) endLoansWhere(match func(*loan) bool) {
	p.loans.mu.Lock()
	lent := map[string]string{}
	for t, ln := range p.loans.m {
		if match(ln) {
			lent[t] = ln.from
		}
	}
	p.loans.mu.Unlock()
	for t, from := range lent {
		p.endLoan(t, from)
	}
}

// localOwner is who a pulled segment belongs to here: the user of the
// owner's name, with its mode, where that user exists; else root, 0600.
// Its group is the group of the group's name where that group exists;
// else the user's own, with no group bits: the owner gave them to a group
// that is not here, not to whoever shares the user's group here.
func localOwner(r *pullReply) (c segment.Cred, mode uint32) {
	u, err := user.Lookup(r.Owner)
	if r.Owner == "" || err != nil {
		return root, 0o600
	}
	uid, _ := strconv.ParseUint(u.Uid, 10, 32)
	gid, _ := strconv.ParseUint(u.Gid, 10, 32)
	mode = r.Mode & 0o777
	if g, err := user.LookupGroup(r.Group); r.Group != "" && err == nil {
		gid, _ = strconv.ParseUint(g.Gid, 10, 32)
	} else {
		mode &^= 0o070
	}
	return segment.Cred{UID: uint32(uid), GID: uint32(gid)}, mode
}

// pull copies name from a peer that offers it (from, if given) into a new
// segment here, committed only once every chunk checked; on a failure it
// tries the next peer that offers it. c, who asks, must be root or the
// user the segment will belong to. origin, the asking request's
// (session/id, or none), is recorded with c's uid as the segment's
// pulled_by (segment.PullOrigin): the request sent again after a crash
// finds it (pullSettled).
func (p *peers) pull(ctx context.Context, c segment.Cred, name, from, origin string) (segment.Info, error) {
	n := p.current()
	if n == nil {
		return segment.Info{}, fmt.Errorf("pull %q: %w: the daemon has no peers (--listen-peers, --peers)", name, syscall.EOPNOTSUPP)
	}
	var errs []error
	for _, who := range p.offering(ctx, n, name, from) {
		inf, err := p.pullFrom(ctx, n, c, name, who, origin)
		if err == nil {
			return inf, nil
		}
		if errors.Is(err, syscall.EPERM) || errors.Is(err, syscall.EEXIST) {
			return segment.Info{}, err
		}
		errs = append(errs, fmt.Errorf("from %s: %w", who, err))
	}
	if len(errs) == 0 {
		return segment.Info{}, fmt.Errorf("pull %q: %w: no connected peer offers it", name, syscall.ENOENT)
	}
	return segment.Info{}, fmt.Errorf("pull %q: %w", name, errors.Join(errs...))
}

func (p *peers) current() *peer.Node {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.node
}

// offering are the peers to pull name from: from alone, or every
// connected peer that lists it, in the order the node lists its peers.
func (p *peers) offering(ctx context.Context, n *peer.Node, name, from string) []string {
	if from != "" {
		return []string{from}
	}
	have := p.offers(ctx, n, name)
	var out []string
	for _, pi := range n.Peers() {
		if _, ok := have[pi.ID()]; ok && !slices.Contains(out, pi.ID()) {
			out = append(out, pi.ID())
		}
	}
	return out
}

// pullStall is how long a fetch waits for a lender that sends nothing
// before it fails, naming the peer (a partition). A variable for tests.
var pullStall = pull.DefaultStall

// A pulling is a pull in progress here: its segment, uncommitted, the
// board its fetch publishes (for a chain's next node), what the peer said
// of the segment, and the bytes checked so far.
type pulling struct {
	ready   chan struct{} // closed once the fields below are set, or the pull ended
	mu      sync.Mutex    // held while a chain's lender starts, and while the pull ends
	started bool          // ready is closed
	gone    bool
	seg     *segment.Segment
	info    segment.Info
	board   int
	reply   pullReply
	from    string
	done    atomic.Int64
}

// pullFrom pulls name from the peer who: from the peer who redirects it
// to the tail of a chain, if any, and from who itself when that fails.
func (p *peers) pullFrom(ctx context.Context, n *peer.Node, c segment.Cred, name, who, origin string) (segment.Info, error) {
	// A name taken here fails the create below whatever the peer says:
	// the peer is not asked to start a lender for nothing.
	if _, err := p.reg.Stat(name); err == nil {
		return segment.Info{}, fmt.Errorf("pull %q: %w: the name is taken here", name, syscall.EEXIST)
	}
	// A user's pull of what would not be theirs is refused on the peer's
	// list, before the peer starts a lender and checksums the segment
	// for nothing; its answer to the pull is checked again below.
	if c.UID != 0 {
		offers, err := n.List(ctx, who, peer.ListRequest{Prefix: name})
		if err != nil {
			return segment.Info{}, err
		}
		for _, o := range offers {
			if owner, _ := localOwner(&pullReply{Owner: o.Owner, Group: o.Group}); o.Name == name && owner.UID != c.UID {
				return segment.Info{}, fmt.Errorf("pull %q: %w: it would be uid %d's here (%q on %s), and only that user or root may pull it",
					name, syscall.EPERM, owner.UID, o.Owner, who)
			}
		}
	}
	inf, via, err := p.pullOnce(ctx, n, c, name, who, origin, false)
	if err != nil && via != "" && !errors.Is(err, syscall.EPERM) && !errors.Is(err, syscall.EEXIST) {
		p.log().Info("pull through a chain failed; pulling from the source", "name", name, "via", via, "source", who, "err", err)
		inf, _, err = p.pullOnce(ctx, n, c, name, who, origin, true)
	}
	return inf, err
}

// borrow asks who to lend name (direct: with no redirect), following a
// redirect to the tail of a chain once; it says which peer lends.
func (p *peers) borrow(ctx context.Context, n *peer.Node, name, who string, direct bool) (pullReply, string, error) {
	call := func(who string, req pullRequest) (pullReply, error) {
		var r pullReply
		call, cancel := context.WithTimeout(ctx, pullCallTime)
		defer cancel()
		err := n.Call(call, who, opPull, req, &r)
		return r, err
	}
	r, err := call(who, pullRequest{Name: name, Direct: direct})
	if err != nil || r.Via == "" {
		return r, who, err
	}
	via := r.Via
	if r, err = call(via, pullRequest{Name: name, Chain: true}); err == nil && r.Via == "" {
		return r, via, nil
	}
	p.log().Info("a chain's peer would not lend; pulling from the source", "name", name, "via", via, "source", who, "err", err)
	r, err = call(who, pullRequest{Name: name, Direct: true})
	return r, who, err
}

// pullOnce borrows name from who (or the chain it redirects to) and
// fetches it into a new segment; via is the chain's peer it came from,
// if not who. The pull is listed here from the ask on, so that a chain's
// next node that asks before this one has its grant waits for it.
func (p *peers) pullOnce(ctx context.Context, n *peer.Node, c segment.Cred, name, who, origin string, direct bool) (_ segment.Info, via string, _ error) {
	pl, err := p.listPull(name)
	if err != nil {
		return segment.Info{}, "", err
	}
	end := func(s *segment.Segment, owner segment.Cred, ok bool) { p.endPull(name, pl, s, owner, ok) }

	// The fetcher starts while the peer starts its lender: each makes a
	// device's context and UCX's worker, which would take their time in
	// turn.
	start := time.Now()
	fr, err := pull.StartFetcher(pull.Memory{CUDA: p.cuda, Device: p.device}, pullStall)
	if err != nil {
		end(nil, root, false)
		return segment.Info{}, "", err
	}
	defer fr.Close()
	r, lender, err := p.borrow(ctx, n, name, who, direct)
	if err != nil {
		end(nil, root, false)
		return segment.Info{}, "", err
	}
	if lender != who {
		via = lender
	}
	// The loan ends in the background: a peer cut off must not hold the
	// answer for the call's time.
	defer func() {
		go func() {
			done, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			n.Call(done, lender, opPullDone, struct {
				Token string `json:"token"`
			}{r.Token}, nil)
		}()
	}()
	owner, mode := localOwner(&r)
	if c.UID != 0 && c.UID != owner.UID {
		end(nil, root, false)
		return segment.Info{}, via, fmt.Errorf("pull %q: %w: it would be uid %d's here (%q on %s), and only that user or root may pull it",
			name, syscall.EPERM, owner.UID, r.Owner, lender)
	}
	// The meta is the peer's word: no more of it than a local client may
	// set, which is what the journal and the disk tier are built to hold.
	if len(r.Meta) > wire.MaxMeta {
		end(nil, root, false)
		return segment.Info{}, via, fmt.Errorf("pull %q: %w: %s sent meta of %d bytes, limit %d", name, syscall.EINVAL, lender, len(r.Meta), wire.MaxMeta)
	}
	// Offered here too: its owner offered it to the cluster, and the
	// next node pulls it from the nearest copy. Made by this process: a
	// serving process killed mid-pull leaves no uncommitted segment to
	// its successor, which ends it at its start.
	s, _, err := p.reg.Create(owner, segment.CreateOptions{Name: name, Size: r.Grant.Size, Device: p.device, Open: true,
		Uncommitted: true, Mode: mode, UseMode: true, Meta: r.Meta, Offer: true, Creator: server.Self(), PulledBy: segment.PullOrigin(c, origin)})
	if err != nil {
		end(nil, root, false)
		return segment.Info{}, via, err
	}
	fail := func(err error) (segment.Info, string, error) {
		end(s, owner, false)
		return segment.Info{}, via, err
	}
	info := p.reg.Info(s)
	m, err := memoryOf(info)
	if err == nil && (m.CUDA != p.cuda || m.CUDA && m.Device != p.device) {
		err = fmt.Errorf("pull: the segment was made on device %d of kind %q, not where its fetcher started", info.Device, info.HandleType)
	}
	if err != nil {
		return fail(err)
	}
	fd, err := s.FD()
	if err != nil {
		return fail(err)
	}
	board, err := newBoard(name, r.Grant.Size)
	if err != nil {
		return fail(err)
	}
	lent := time.Now()
	pl.mu.Lock()
	pl.seg, pl.info, pl.board, pl.reply, pl.from = s, info, board, r, lender
	pl.started = true
	close(pl.ready)
	pl.mu.Unlock()
	err = fr.Fetch(ctx, fd, r.Grant.Size, r.Grant, pull.FetchOptions{Memory: m, Board: board, Stall: pullStall,
		Progress: func(d int64) { pl.done.Store(d) }})
	if err != nil {
		if via != "" {
			err = fmt.Errorf("via %s: %w", via, err)
		}
		return fail(err)
	}
	if err := p.pullGate(ctx, pullGateEnv, "commit", name); err != nil {
		return fail(err)
	}
	fetched := time.Now()
	if err := p.reg.Commit(owner, s, "", nil); err != nil {
		return fail(err)
	}
	end(s, owner, true)
	inf := p.reg.Info(s)
	p.reg.ReleaseBy(s, owner)
	p.pullGate(ctx, pullReplyGateEnv, "reply", name)
	p.log().Info("pulled", "name", name, "bytes", inf.Size, "from", lender, "source", who,
		"lent_after", lent.Sub(start), "fetched_in", fetched.Sub(lent), "committed_in", time.Since(fetched))
	return inf, via, nil
}

// listPull lists a pull of name here, from its ask on, or says why not.
func (p *peers) listPull(name string) (*pulling, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.pulling[name] != nil {
		return nil, fmt.Errorf("pull %q: %w: it is being pulled here already", name, syscall.EEXIST)
	}
	if p.pulling == nil {
		p.pulling = map[string]*pulling{}
	}
	pl := &pulling{board: -1, ready: make(chan struct{})}
	p.pulling[name] = pl
	return pl, nil
}

// endPull takes the pull of name off the list, and its segment s away
// unless it succeeded (ok); the chain's loans of it go on only if it
// did. pl.mu keeps a chain's lender from starting on a segment discarded
// or a board closed meanwhile.
func (p *peers) endPull(name string, pl *pulling, s *segment.Segment, owner segment.Cred, ok bool) {
	p.mu.Lock()
	delete(p.pulling, name)
	p.mu.Unlock()
	pl.mu.Lock()
	pl.gone = true
	if !pl.started {
		close(pl.ready)
	}
	if pl.board >= 0 {
		syscall.Close(pl.board)
	}
	if s != nil && !ok {
		p.reg.ReleaseBy(s, owner)
		p.reg.Discard(s)
	}
	pl.mu.Unlock()
	if !ok {
		p.endChainLoans(name)
	}
}

// newBoard makes the memfd a fetch publishes its progress on. A chain's
// lenders get a read-only descriptor of it; a memfd is made with mode
// 0777, and whoever holds any descriptor of it may open it again through
// /proc/self/fd/N with the access those bits allow, so the board is made
// the daemon's alone (0600), as segments are: a lender taken over through
// UCX, as the helpers' user, could otherwise write the board that the
// chain's other lenders trust, and have them serve chunks not yet fetched
// with checksums of its choosing.
func newBoard(name string, size int64) (int, error) {
	fd, err := unix.MemfdCreate("gpushm-board:"+name, unix.MFD_CLOEXEC)
	if err != nil {
		return -1, fmt.Errorf("pull: a board: %w", err)
	}
	err = unix.Fchmod(fd, 0o600)
	if err == nil {
		err = unix.Ftruncate(fd, pull.BoardSize(size))
	}
	if err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("pull: a board: %w", err)
	}
	return fd, nil
}
