package daemon

import (
	"context"
	"os"
	"time"

	"github.com/gpushm/gpushm/internal/peer"
	"github.com/gpushm/gpushm/internal/segment"
)

// Pulls across a restart of the serving process (docs/peers.md, "Faults"):
// the uncommitted segment of a pull cut short goes with the process that
// made it (pullFrom names it as the creator), the client sends its pull
// again on its new connection, as any request, and opens that wait ask
// again; the new process pulls anew. What it needs for that is its peers,
// which it dials only as it starts: settle waits for them.

// settleTime bounds how long a pull waits for the peers this daemon dials
// to be dialed once: the handshake's own bound.
const settleTime = 5 * time.Second

// settle waits until every peer this daemon dials (--peers) is connected
// or has failed at least once, for settleTime at most: a pull sent again
// right after a restart would otherwise find no peer connected yet, and
// fail. Peers that dial this node are not waited for: they are found as
// they dial again.
func (p *peers) settle(ctx context.Context, n *peer.Node) {
	ctx, cancel := context.WithTimeout(ctx, settleTime)
	defer cancel()
	for {
		settled := true
		for _, pi := range n.Peers() {
			if pi.Outbound && !pi.Connected && pi.LastError == "" {
				settled = false
			}
		}
		if settled {
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// pullSettled is pull once the peers settled: the pull operation's.
func (p *peers) pullSettled(ctx context.Context, c segment.Cred, name, from, origin string) (segment.Info, error) {
	// A pull sent again after a crash that its first attempt committed
	// (the serving process killed between its commit and its reply) has
	// that attempt's outcome, as other requests sent again do.
	if inf, ok := p.reg.MadeBy(c, name, origin); ok {
		return inf, nil
	}
	if n := p.current(); n != nil {
		p.settle(ctx, n)
	}
	return p.pull(ctx, c, name, from, origin)
}

// pullGateEnv, for tests, names a file: while it exists, a pull whose
// bytes all checked waits before its commit, so that a test can kill the
// serving process with a pull under way, or have opens wait for one, and
// know it did (integration/peers_wait_test.go). pullReplyGateEnv does the
// same after the commit, before the reply. The daemon's environment is
// its starter's: no client sets them.
const (
	pullGateEnv      = "GPUSHM_TEST_PULL_GATE"
	pullReplyGateEnv = "GPUSHM_TEST_PULL_REPLY_GATE"
)

// pullGate waits while the file $env exists, saying so once in the log
// (what: before what the pull waits); without the variable it returns at
// once.
func (p *peers) pullGate(ctx context.Context, env, what, name string) error {
	gate := os.Getenv(env)
	if gate == "" {
		return nil
	}
	for logged := false; ; logged = true {
		if _, err := os.Stat(gate); err != nil {
			return nil
		}
		if !logged {
			p.log().Info("test gate: a pull waits before its "+what, "name", name)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
}
