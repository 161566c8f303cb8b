package daemon

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"syscall"
	"time"

	"github.com/gpushm/gpushm/internal/peer"
	"github.com/gpushm/gpushm/internal/segment"
)

// Opens that wait for a name missing here (--pull-missing, docs/peers.md,
// "Opens that wait for a peer's segment"): the first such open of a name
// starts one pull of it from the peers that offer it, which every open
// waiting for the name shares: they wait for its commit as for any
// writer's, and each is checked then against the segment's mode as any
// open is. The pull is the daemon's (root's), so that one waiter's
// credentials decide nothing for the others; whose the segment is here is
// decided as for 'gpushm pull' (localOwner), and it counts against that
// owner's quota.
//
// What waiters can make the daemon do is bounded: one pull a name at a
// time; maxMissingPulls at once, maxMissingPullsPerUser of them started by
// one user's opens; none of a segment the waiting user could not open once
// pulled, as the peers list it (so a user cannot have the daemon fetch
// what is of no use to it); and a name that no peer offers, or whose pull
// failed, is not asked for again for missingRetry (for the user who could
// not open it, when that was why).

// The bounds; variables for tests.
var (
	maxMissingPulls        = 4
	maxMissingPullsPerUser = 2
	missingRetry           = 10 * time.Second
	// missingPullTime bounds one pull for waiting opens, every peer tried.
	missingPullTime = 30 * time.Minute
)

// anyone marks a retry time that holds for every user: no uid is ^0.
const anyone = ^uint32(0)

type missingKey struct {
	name string
	uid  uint32 // anyone, or the user who may not open what the peers offer
}

// missingPulls are the pulls that waiting opens started, running now, and
// when a name may be asked for again.
type missingPulls struct {
	mu        sync.Mutex
	ctx       context.Context // nil while the peers are stopped
	cancel    context.CancelFunc
	running   map[string]bool
	n         int
	byUID     map[uint32]int
	notBefore map[missingKey]time.Time
}

// start lets waiting opens start pulls until stop.
func (m *missingPulls) start() {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.ctx == nil {
		m.ctx, m.cancel = context.WithCancel(context.Background())
	}
}

// stop cancels the pulls running (each discards what it made) and starts
// no more.
func (m *missingPulls) stop() {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.cancel != nil {
		m.cancel()
	}
	m.ctx, m.cancel = nil, nil
}

// reserve counts a pull of name started by uid's open, or says false: one
// runs already, the bounds are reached, or the name is not to be asked
// for yet.
func (m *missingPulls) reserve(name string, uid uint32) (context.Context, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	now := time.Now()
	switch {
	case m.ctx == nil, m.running[name], m.n >= maxMissingPulls, m.byUID[uid] >= maxMissingPullsPerUser,
		now.Before(m.notBefore[missingKey{name, anyone}]), now.Before(m.notBefore[missingKey{name, uid}]):
		return nil, false
	}
	if m.running == nil {
		m.running, m.byUID = map[string]bool{}, map[uint32]int{}
	}
	m.running[name] = true
	m.n++
	m.byUID[uid]++
	return m.ctx, true
}

// done ends the count of a pull reserve counted; retry, if not zero, is
// when the name may be asked for again by who (anyone, or one user).
func (m *missingPulls) done(name string, uid uint32, who uint32, retry time.Time) {
	m.mu.Lock()
	defer m.mu.Unlock()
	delete(m.running, name)
	m.n--
	if m.byUID[uid]--; m.byUID[uid] == 0 {
		delete(m.byUID, uid)
	}
	if retry.IsZero() {
		return
	}
	if m.notBefore == nil {
		m.notBefore = map[missingKey]time.Time{}
	}
	// Expired entries go as new ones come: the map holds what the last
	// missingRetry asked for, no more.
	now := time.Now()
	for k, t := range m.notBefore {
		if !now.Before(t) {
			delete(m.notBefore, k)
		}
	}
	m.notBefore[missingKey{name, who}] = retry
}

// wantMissing is the server's hook for an open that waits for name, which
// is missing here (server.SetPullMissing): it starts a pull of it within
// the bounds above, and returns at once.
func (p *peers) wantMissing(c segment.Cred, name string, readOnly bool) {
	if _, err := p.reg.Stat(name); err == nil {
		return // here now, or being written
	}
	ctx, ok := p.missing.reserve(name, c.UID)
	if !ok {
		return
	}
	go func() {
		who, err := p.pullForWaiters(ctx, c, name, readOnly)
		var retry time.Time
		if err != nil {
			retry = time.Now().Add(missingRetry)
		}
		p.missing.done(name, c.UID, who, retry)
	}()
}

// errNotOffered: no connected peer offers the name.
var errNotOffered = errors.New("no connected peer offers it")

// pullForWaiters pulls name for opens that wait for it, one of them c's: from
// the peers that offer it as a segment c could open (read-only or not),
// in turn. On a failure it says whom it holds for: anyone, or c's user
// alone when none of the offers is one c could open.
func (p *peers) pullForWaiters(ctx context.Context, c segment.Cred, name string, readOnly bool) (uint32, error) {
	ctx, cancel := context.WithTimeout(ctx, missingPullTime)
	defer cancel()
	log := p.log()
	n := p.current()
	if n == nil {
		return anyone, errors.New("no peers")
	}
	p.settle(ctx, n)
	offers := p.offers(ctx, n, name)
	if len(offers) == 0 {
		log.Debug("an open waits for a name no connected peer offers", "name", name, "uid", c.UID, "again_in", missingRetry)
		return anyone, errNotOffered
	}
	want := uint32(segment.Read | segment.Write)
	if readOnly {
		want = segment.Read
	}
	var from []string
	for who, o := range offers {
		owner, mode := localOwner(&pullReply{Owner: o.Owner, Group: o.Group, Mode: o.Mode})
		if inf := (segment.Info{UID: owner.UID, GID: owner.GID, Mode: mode}); inf.Allows(c, want) {
			from = append(from, who)
		}
	}
	if len(from) == 0 {
		log.Info("not pulling a name for an open that could not open it", "name", name, "uid", c.UID, "again_in", missingRetry)
		return c.UID, fmt.Errorf("pull %q: %w: uid %d could not open it", name, syscall.EPERM, c.UID)
	}
	slices.Sort(from)
	log.Info("pulling a name that opens wait for", "name", name, "uid", c.UID, "from", from)
	var errs []error
	for _, who := range from {
		inf, err := p.pullFrom(ctx, n, root, name, who, "")
		switch {
		case err == nil:
			log.Info("pulled a name that opens wait for", "name", name, "from", who, "bytes", inf.Size)
			return anyone, nil
		case errors.Is(err, syscall.EEXIST):
			return anyone, nil // made here meanwhile: the waiters have it
		}
		errs = append(errs, fmt.Errorf("from %s: %w", who, err))
	}
	err := fmt.Errorf("pull %q: %w", name, errors.Join(errs...))
	log.Warn("the pull of a name that opens wait for failed", "name", name, "again_in", missingRetry, "err", err)
	return anyone, err
}

// offers are what each connected peer offers under name, by peer.
func (p *peers) offers(ctx context.Context, n *peer.Node, name string) map[string]peer.Offer {
	out := map[string]peer.Offer{}
	for _, pi := range n.Peers() {
		if !pi.Connected {
			continue
		}
		who := pi.ID()
		list, err := n.List(ctx, who, peer.ListRequest{Prefix: name})
		if err != nil {
			continue
		}
		for _, o := range list {
			if o.Name == name {
				out[who] = o
			}
		}
	}
	return out
}
