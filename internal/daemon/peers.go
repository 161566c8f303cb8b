package daemon

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/gpushm/gpushm/internal/owner"
	"github.com/gpushm/gpushm/internal/peer"
	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/server"
	"github.com/gpushm/gpushm/internal/wire"
)

// Peers (docs/peers.md): the daemon's connections to daemons on other
// nodes, authenticated by a shared secret (internal/peer). Today they
// tell each other what they offer; the data path (internal/ucx) is not
// wired yet.

// peerConfig reads --listen-peers, --peers, --peer-service, --peer-secret
// and --node (and checks that --pull-missing has peers); nil when no peer
// is configured.
func (o Options) peerConfig(log *slog.Logger) (*peer.Config, error) {
	var addrs []string
	for _, a := range strings.Split(o.Peers, ",") {
		if a = strings.TrimSpace(a); a != "" {
			addrs = append(addrs, a)
		}
	}
	if o.ListenPeers == "" && len(addrs) == 0 && o.PeerService == "" {
		switch {
		case o.PeerSecret != "":
			return nil, errors.New("--peer-secret needs --listen-peers, --peers or --peer-service")
		case o.PullMissing:
			return nil, errors.New("--pull-missing needs peers to pull from: --listen-peers, --peers or --peer-service")
		}
		return nil, nil
	}
	if o.PeerSecret == "" {
		return nil, errors.New("--listen-peers, --peers and --peer-service need --peer-secret FILE: the secret the node's daemons share (docs/peers.md)")
	}
	secret, err := peer.LoadSecret(o.PeerSecret)
	if err != nil {
		return nil, fmt.Errorf("--peer-secret: %w", err)
	}
	node := o.Node
	if node == "" {
		if node, err = os.Hostname(); err != nil {
			return nil, fmt.Errorf("--node: none given, and the host's name: %w", err)
		}
	}
	if o.PullStall > 0 {
		pullStall = o.PullStall // one daemon a process
	}
	return &peer.Config{Node: node, Secret: secret, Listen: o.ListenPeers, Peers: addrs,
		Service: o.PeerService, ResolveEvery: o.PeerServiceEvery, Log: log}, nil
}

// peers is the running peer node of a serving process.
type peers struct {
	cfg peer.Config
	reg *segment.Registry
	// pullMissing: opens that wait for a name missing here may have it
	// pulled from a peer (--pull-missing; pullmissing.go).
	pullMissing bool
	missing     missingPulls
	mu          sync.Mutex
	node        *peer.Node
	loans       loans
	// device is where a pulled segment is made: the backend's default;
	// cuda, whether the backend's memory is a GPU's.
	device int
	cuda   bool
	// pulling are the pulls in progress here, by name (pull.go).
	pulling map[string]*pulling
}

// start starts the node, waiting up to a second for a predecessor in an
// upgrade to let go of the port.
func (p *peers) start(srv *server.Server) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.node != nil {
		return nil
	}
	cfg := p.cfg
	cfg.Handler = p.serve
	var err error
	for i := 0; ; i++ {
		p.node, err = peer.Start(context.Background(), cfg)
		if err == nil || !errors.Is(err, syscall.EADDRINUSE) || i == 50 {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil {
		p.node = nil
		return fmt.Errorf("--listen-peers %s: %w", cfg.Listen, err)
	}
	srv.SetPeers(p.report)
	srv.SetPull(p.pullSettled)
	if p.pullMissing {
		p.missing.start()
		srv.SetPullMissing(p.wantMissing)
	}
	cfg.Log.Info("peers", "node", cfg.Node, "listen", cfg.Listen, "peers", cfg.Peers, "service", cfg.Service, "pull_missing", p.pullMissing)
	return nil
}

func (p *peers) stop() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.missing.stop()
	if p.node != nil {
		p.node.Close()
		p.node = nil
	}
	p.endLoans()
}

// serve answers a peer's call: list, the segments offered.
func (p *peers) serve(ctx context.Context, from, op string, req json.RawMessage) (any, error) {
	switch op {
	case opPull:
		v, err := p.lend(from, req)
		if err == nil {
			var r pullRequest
			json.Unmarshal(req, &r)
			p.log().Info("lending a segment to a peer", "name", r.Name, "peer", from)
		}
		return v, err
	case opPullDone:
		var r struct {
			Token string `json:"token"`
		}
		json.Unmarshal(req, &r)
		p.endLoan(r.Token, from)
		return struct{}{}, nil
	case peer.OpList:
	default:
		return nil, peer.Errorf(peer.CodeUnknownOp, "%s: no such operation", op)
	}
	var r peer.ListRequest
	if err := json.Unmarshal(req, &r); err != nil {
		return nil, peer.Errorf(peer.CodeBadRequest, "list: %v", err)
	}
	var out peer.ListReply
	for _, inf := range p.reg.Offers() {
		if !strings.HasPrefix(inf.Name, r.Prefix) {
			continue
		}
		out.Offers = append(out.Offers, peer.Offer{Name: inf.Name, Size: inf.Size, Owner: owner.User(inf.UID),
			Group: owner.Group(inf.GID), Mode: inf.Mode, Version: inf.Version, Meta: inf.Meta})
	}
	return out, nil
}

// report is the peers operation's answer: each peer, and what each
// connected one offers, asked of them all at once.
func (p *peers) report(ctx context.Context, pulling string) *wire.PeersReport {
	p.mu.Lock()
	n := p.node
	r := &wire.PeersReport{Node: p.cfg.Node, Listen: p.cfg.Listen, Service: p.cfg.Service, Peers: []wire.PeerNode{}}
	for name, pl := range p.pulling {
		if pulling != "" && name != pulling {
			continue
		}
		// Set once before ready closes; pl.mu is not taken: a chain's
		// lender may be starting under it, and every user may ask.
		select {
		case <-pl.ready:
		default:
			continue
		}
		if pl.seg != nil {
			r.Pulls = append(r.Pulls, wire.PeerPull{Name: name, From: pl.from, Size: pl.info.Size, Done: pl.done.Load()})
		}
	}
	p.mu.Unlock()
	if n == nil || pulling != "" {
		return r
	}
	if a := n.Addr(); a != nil {
		r.Listen = a.String()
	}
	if err := n.ServiceErr(); err != nil {
		r.ServiceError = err.Error()
	}
	infos := n.Peers()
	r.Peers = make([]wire.PeerNode, len(infos))
	var wg sync.WaitGroup
	for i, pi := range infos {
		w := &r.Peers[i]
		*w = wire.PeerNode{Name: pi.Name, Addr: pi.Addr, Outbound: pi.Outbound, Connected: pi.Connected, LastError: pi.LastError}
		if !pi.Since.IsZero() {
			w.Since = pi.Since.UnixNano()
		}
		if !pi.Connected {
			continue
		}
		who := pi.ID()
		wg.Go(func() {
			offers, err := n.List(ctx, who, peer.ListRequest{})
			if err != nil {
				w.Error = err.Error()
				return
			}
			w.Offers = []wire.PeerOffer{}
			for _, o := range offers {
				w.Offers = append(w.Offers, wire.PeerOffer{Name: o.Name, Size: o.Size, Owner: o.Owner, Group: o.Group, Mode: o.Mode, Version: o.Version})
			}
		})
	}
	wg.Wait()
	return r
}

// log is the peers' logger (none in tests that build a peers by hand).
func (p *peers) log() *slog.Logger {
	if p.cfg.Log != nil {
		return p.cfg.Log
	}
	return slog.New(slog.DiscardHandler)
}
