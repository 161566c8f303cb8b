package daemon

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os/user"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/gpushm/gpushm/internal/memfd"
	"github.com/gpushm/gpushm/internal/peer"
	"github.com/gpushm/gpushm/internal/pull"
	"github.com/gpushm/gpushm/internal/segment"
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
	lender *pull.Lender
	seg    *segment.Segment
	timer  *time.Timer
}

// loans are the segments this daemon lends now, by token.
type loans struct {
	mu sync.Mutex
	m  map[string]*loan
}

var root = segment.Cred{}

// lend answers a peer's pull of name: only a segment its owner offered,
// held by a lease of the daemon's own for as long as the loan lasts.
func (p *peers) lend(req json.RawMessage) (any, error) {
	var r pullRequest
	if err := json.Unmarshal(req, &r); err != nil {
		return nil, peer.Errorf(peer.CodeBadRequest, "pull: %v", err)
	}
	reg := p.reg
	if inf, err := reg.Stat(r.Name); err != nil || !inf.Offer || inf.Uncommitted || inf.Slots > 0 || inf.Orphan != "" {
		return nil, peer.Errorf(peer.CodeNotFound, "pull: %q is not offered here", r.Name)
	}
	s, err := reg.Acquire(root, r.Name, true)
	if err != nil {
		return nil, peer.Errorf(peer.CodeNotFound, "pull: %q: %v", r.Name, err)
	}
	inf := reg.Info(s)
	release := func() { reg.Release(s) }
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
	ln := &loan{lender: l, seg: s}
	ln.timer = time.AfterFunc(loanTime, func() { p.endLoan(token) })
	p.loans.m[token] = ln
	p.loans.mu.Unlock()
	return pullReply{Token: token, Grant: l.Grant, Owner: ownerName(inf.UID), Group: groupName(inf.GID),
		Mode: inf.Mode, Version: inf.Version, Meta: inf.Meta}, nil
}

// endLoan ends the loan token: its lender exits, its lease goes.
func (p *peers) endLoan(token string) {
	p.loans.mu.Lock()
	ln := p.loans.m[token]
	delete(p.loans.m, token)
	p.loans.mu.Unlock()
	if ln == nil {
		return
	}
	ln.timer.Stop()
	ln.lender.Close()
	p.reg.Release(ln.seg)
}

// endLoans ends every loan (the peers stop).
func (p *peers) endLoans() {
	p.loans.mu.Lock()
	var tokens []string
	for t := range p.loans.m {
		tokens = append(tokens, t)
	}
	p.loans.mu.Unlock()
	for _, t := range tokens {
		p.endLoan(t)
	}
}

func ownerName(uid uint32) string {
	if u, err := user.LookupId(strconv.FormatUint(uint64(uid), 10)); err == nil {
		return u.Username
	}
	return ""
}

func groupName(gid uint32) string {
	if g, err := user.LookupGroupId(strconv.FormatUint(uint64(gid), 10)); err == nil {
		return g.Name
	}
	return ""
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
			if o.Name == name && !contains(out, who) {
				out = append(out, who)
			}
		}
	}
	return out
}

func contains(l []string, s string) bool {
	for _, x := range l {
		if x == s {
			return true
		}
	}
	return false
}

// pullFrom pulls name from the peer who.
func (p *peers) pullFrom(ctx context.Context, n *peer.Node, c segment.Cred, name, who string) (segment.Info, error) {
	var r pullReply
	if err := n.Call(ctx, who, opPull, pullRequest{Name: name}, &r); err != nil {
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
	s, _, err := p.reg.Create(owner, segment.CreateOptions{Name: name, Size: r.Grant.Size, Open: true, Uncommitted: true,
		Mode: mode, UseMode: true, Meta: r.Meta})
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
	if err := p.reg.Commit(owner, s, "", nil); err != nil {
		return fail(err)
	}
	inf := p.reg.Info(s)
	p.reg.ReleaseBy(s, owner)
	return inf, nil
}
