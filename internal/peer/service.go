package peer

import (
	"context"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"time"
)

// A service is one DNS name whose every address is a peer, such as the
// A and AAAA records of a Kubernetes headless Service over the daemons'
// pods (Config.Service). Its answer says only where to dial: each
// connection is authenticated by the handshake as any other, so a forged
// answer can make this node dial an address, never trust what answers
// there.

// Resolver looks up a host's addresses; *net.Resolver is one.
type Resolver interface {
	LookupHost(ctx context.Context, host string) ([]string, error)
}

// resolveTimeout bounds one resolution of Config.Service.
const resolveTimeout = 10 * time.Second

// maxService bounds the addresses of an answer that are dialed (the
// first, sorted): more nodes than a mesh of daemons, each connected to
// every other, should have, and few enough that an answer (a forged one,
// say) cannot make this node hold a redialer and a connection for every
// address it could name.
const maxService = 1024

// watch resolves Config.Service now and every ResolveEvery until ctx is
// done, and keeps a redialer (dialer) for each address of the answer. An
// address gone from an answer is dropped, its connection closed. A
// failed resolution is logged and changes nothing: a service with no
// endpoints yet, or a DNS server down for a while, neither stops the
// daemon nor cuts it off from the peers it has.
func (n *Node) watch(ctx context.Context) {
	host, port, _ := net.SplitHostPort(n.cfg.Service)
	stops := map[string]func(){} // the addresses dialed, by address
	t := time.NewTicker(n.cfg.ResolveEvery)
	defer t.Stop()
	for {
		addrs, err := n.resolve(ctx, host, port)
		n.mu.Lock()
		last := n.svcErr
		n.svcErr = err
		n.mu.Unlock()
		switch {
		case ctx.Err() != nil:
			return
		case err != nil:
			if last == nil || last.Error() != err.Error() {
				n.log.Warn("peer service not resolved", "service", n.cfg.Service, "err", err)
			}
		default:
			changed := false
			for a, stop := range stops {
				if !slices.Contains(addrs, a) {
					stop()
					delete(stops, a)
					changed = true
				}
			}
			for _, a := range addrs {
				if stops[a] == nil {
					stops[a] = n.dialer(ctx, a)
					changed = true
				}
			}
			if changed || last != nil {
				n.log.Info("peer service", "service", n.cfg.Service, "peers", addrs)
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// resolve looks up host and returns the peers' addresses, sorted: each
// address of the answer at port, but this node's own listener.
func (n *Node) resolve(ctx context.Context, host, port string) ([]string, error) {
	ctx, cancel := context.WithTimeout(ctx, resolveTimeout)
	defer cancel()
	ips, err := n.cfg.Resolver.LookupHost(ctx, host)
	if err != nil {
		return nil, err
	}
	own := n.own(port)
	var addrs []string
	for _, s := range ips {
		ip, err := netip.ParseAddr(s)
		if err != nil || own(ip.Unmap().WithZone("")) {
			continue
		}
		addrs = append(addrs, net.JoinHostPort(s, port))
	}
	slices.Sort(addrs)
	addrs = slices.Compact(addrs)
	if len(addrs) > maxService {
		n.log.Warn("peer service: too many addresses", "service", n.cfg.Service, "addresses", len(addrs), "dialed", maxService)
		addrs = addrs[:maxService]
	}
	return addrs, nil
}

// own says whether an address at port is this node's listener: its
// address, or, where it listens on every address, any of the host's
// (every address of the network namespace: in Kubernetes, the pod's).
// Without it every node would dial itself too, and be refused by its
// own handshake, a peer named as itself; a dial that reaches this node
// by another road (a NAT) still is.
func (n *Node) own(port string) func(netip.Addr) bool {
	none := func(netip.Addr) bool { return false }
	la, ok := n.Addr().(*net.TCPAddr)
	if !ok || strconv.Itoa(la.Port) != port {
		return none
	}
	ip, _ := netip.AddrFromSlice(la.IP)
	if ip = ip.Unmap(); !ip.IsUnspecified() {
		return func(a netip.Addr) bool { return a == ip }
	}
	ifaddrs, err := net.InterfaceAddrs()
	if err != nil {
		n.log.Warn("peer service: this node's addresses", "err", err)
		return none
	}
	var mine []netip.Addr
	for _, a := range ifaddrs {
		if p, ok := a.(*net.IPNet); ok {
			if ip, ok := netip.AddrFromSlice(p.IP); ok {
				mine = append(mine, ip.Unmap())
			}
		}
	}
	return func(a netip.Addr) bool { return slices.Contains(mine, a) }
}

// ServiceErr is why the last resolution of Config.Service failed, nil if
// it did not (or there is none).
func (n *Node) ServiceErr() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.svcErr
}
