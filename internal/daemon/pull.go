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
	"syscall"
	"time"

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

type pullRequest struct {
	Name string `json:"name"`
}

type pullReply struct {
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
	lender *pull.Lender
	seg    *segment.Segment
	timer  *time.Timer
}

// loans are the segments this daemon lends now, by token, and how many
// each peer holds, counted from before its lender starts.
type loans struct {
	mu     sync.Mutex
	m      map[string]*loan
	n      int
	byPeer map[string]int
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
// held by a lease of the daemon's own for as long as the loan lasts.
func (p *peers) lend(from string, req json.RawMessage) (any, error) {
	var r pullRequest
	if err := json.Unmarshal(req, &r); err != nil {
		return nil, peer.Errorf(peer.CodeBadRequest, "pull: %v", err)
	}
	reg := p.reg
	if inf, err := reg.Stat(r.Name); err != nil || !inf.Offer || inf.Uncommitted || inf.Slots > 0 || inf.Orphan != "" {
		return nil, peer.Errorf(peer.CodeNotFound, "pull: %q is not offered here", r.Name)
	}
	if err := p.loans.reserve(from); err != nil {
		return nil, err
	}
	s, err := reg.Acquire(root, r.Name, true)
	if err != nil {
		p.loans.unreserve(from)
		return nil, peer.Errorf(peer.CodeNotFound, "pull: %q: %v", r.Name, err)
	}
	inf := reg.Info(s)
	release := func() {
		reg.Release(s)
		p.loans.unreserve(from)
	}
	if !inf.Offer {
		release() // taken back meanwhile
		return nil, peer.Errorf(peer.CodeNotFound, "pull: %q is not offered here", r.Name)
	}
	if inf.HandleType != wire.HandleMemfd {
		release()
		return nil, peer.Errorf(peer.CodeFailed, "pull: %q is GPU memory; pulls of GPU segments are not built yet (host memory only)", r.Name)
	}
	fd, err := s.FD()
	var ro int
	if err == nil {
		ro, err = memfd.ReadOnly(fd)
	}
	if err != nil {
		release()
		return nil, peer.Errorf(peer.CodeFailed, "pull: %q: %v", r.Name, err)
	}
	l, err := pull.Lend(ro, inf.Size)
	syscall.Close(ro)
	if err != nil {
		release()
		return nil, peer.Errorf(peer.CodeFailed, "pull: %q: %v", r.Name, err)
	}
	tok := make([]byte, 16)
	rand.Read(tok)
	token := hex.EncodeToString(tok)
	p.loans.mu.Lock()
	if p.loans.m == nil {
		p.loans.m = map[string]*loan{}
	}
	ln := &loan{from: from, lender: l, seg: s}
	ln.timer = time.AfterFunc(loanTime, func() { p.endLoan(token, from) })
	p.loans.m[token] = ln
	p.loans.mu.Unlock()
	return pullReply{Token: token, Grant: l.Grant, Owner: owner.User(inf.UID), Group: owner.Group(inf.GID),
		Mode: inf.Mode, Version: inf.Version, Meta: inf.Meta}, nil
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
	p.loans.mu.Unlock()
	ln.timer.Stop()
	ln.lender.Close()
	p.reg.Release(ln.seg)
	p.loans.unreserve(from)
}

// endLoans ends every loan (the peers stop).
func (p *peers) endLoans() {
	p.loans.mu.Lock()
	lent := map[string]string{}
	for t, ln := range p.loans.m {
		lent[t] = ln.from
	}
	p.loans.mu.Unlock()
	for t, from := range lent {
		p.endLoan(t, from)
	}
}

// localOwner is who a pulled segment belongs to here: the user of the
// owner's name, with its mode, where that user exists; else root, 0600.
func localOwner(r *pullReply) (c segment.Cred, mode uint32) {
	u, err := user.Lookup(r.Owner)
	if r.Owner == "" || err != nil {
		return root, 0o600
	}
	uid, _ := strconv.ParseUint(u.Uid, 10, 32)
	gid, _ := strconv.ParseUint(u.Gid, 10, 32)
	if g, err := user.LookupGroup(r.Group); r.Group != "" && err == nil {
		gid, _ = strconv.ParseUint(g.Gid, 10, 32)
	}
	return segment.Cred{UID: uint32(uid), GID: uint32(gid)}, r.Mode & 0o777
}

// pull copies name from a peer that offers it (from, if given) into a new
// segment here, committed only once every chunk checked; on a failure it
// tries the next peer that offers it. c, who asks, must be root or the
// user the segment will belong to.
func (p *peers) pull(ctx context.Context, c segment.Cred, name, from string) (segment.Info, error) {
	n := p.current()
	if n == nil {
		return segment.Info{}, fmt.Errorf("pull %q: %w: the daemon has no peers (--listen-peers, --peers)", name, syscall.EOPNOTSUPP)
	}
	var errs []error
	for _, who := range p.offering(ctx, n, name, from) {
		inf, err := p.pullFrom(ctx, n, c, name, who)
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
// connected peer that lists it.
func (p *peers) offering(ctx context.Context, n *peer.Node, name, from string) []string {
	if from != "" {
		return []string{from}
	}
	var out []string
	for _, pi := range n.Peers() {
		if !pi.Connected {
			continue
		}
		who := pi.Name
		if who == "" {
			who = pi.Addr
		}
		offers, err := n.List(ctx, who, peer.ListRequest{Prefix: name})
		if err != nil {
			continue
		}
		for _, o := range offers {
			if o.Name == name && !slices.Contains(out, who) {
				out = append(out, who)
			}
		}
	}
	return out
}

// pullFrom pulls name from the peer who.
func (p *peers) pullFrom(ctx context.Context, n *peer.Node, c segment.Cred, name, who string) (segment.Info, error) {
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
	var r pullReply
	call, cancel := context.WithTimeout(ctx, pullCallTime)
	err := n.Call(call, who, opPull, pullRequest{Name: name}, &r)
	cancel()
	if err != nil {
		return segment.Info{}, err
	}
	defer func() {
		done, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		n.Call(done, who, opPullDone, struct {
			Token string `json:"token"`
		}{r.Token}, nil)
	}()
	owner, mode := localOwner(&r)
	if c.UID != 0 && c.UID != owner.UID {
		return segment.Info{}, fmt.Errorf("pull %q: %w: it would be uid %d's here (%q on %s), and only that user or root may pull it",
			name, syscall.EPERM, owner.UID, r.Owner, who)
	}
	// The meta is the peer's word: no more of it than a local client may
	// set, which is what the journal and the disk tier are built to hold.
	if len(r.Meta) > wire.MaxMeta {
		return segment.Info{}, fmt.Errorf("pull %q: %w: %s sent meta of %d bytes, limit %d", name, syscall.EINVAL, who, len(r.Meta), wire.MaxMeta)
	}
	// Made by this process: a serving process killed mid-pull leaves no
	// uncommitted segment to its successor, which ends it at its start.
	s, _, err := p.reg.Create(owner, segment.CreateOptions{Name: name, Size: r.Grant.Size, Open: true, Uncommitted: true,
		Mode: mode, UseMode: true, Meta: r.Meta, Creator: server.Self()})
	if err != nil {
		return segment.Info{}, err
	}
	fail := func(err error) (segment.Info, error) {
		p.reg.ReleaseBy(s, owner)
		p.reg.Discard(s)
		return segment.Info{}, err
	}
	fd, err := s.FD()
	if err != nil {
		return fail(err)
	}
	if err := pull.Fetch(ctx, fd, r.Grant.Size, r.Grant); err != nil {
		return fail(err)
	}
	if err := p.pullGate(ctx, name); err != nil {
		return fail(err)
	}
	if err := p.reg.Commit(owner, s, "", nil); err != nil {
		return fail(err)
	}
	inf := p.reg.Info(s)
	p.reg.ReleaseBy(s, owner)
	return inf, nil
}
