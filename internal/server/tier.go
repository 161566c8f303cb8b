package server

import (
	"context"
	"fmt"
	"syscall"
	"time"

	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/wire"
)

// tier answers evict, load and pin (segment/tier.go). Each may copy a
// segment's bytes between its device and host memory, which takes a
// worker's time for as long as the copy: the request leaves the workers
// first.
func (c *conn) tier(cred segment.Cred, req *wire.Request) (*wire.Reply, int) {
	c.s.setAside(c.w)
	var (
		inf segment.Info
		err error
	)
	switch req.Op {
	case wire.OpEvict:
		switch req.To {
		case "", "host":
			inf, err = c.s.reg.Evict(cred, req.Name)
		case "disk":
			inf, err = c.s.reg.EvictTo(cred, req.Name, segment.OnDisk)
		default:
			return fail(fmt.Errorf("evict: to %q: want host or disk: %w", req.To, syscall.EINVAL))
		}
	case wire.OpSync:
		inf, err = c.s.reg.SyncDisk(cred, req.Name)
	case wire.OpOffer:
		inf, err = c.s.reg.SetOffer(cred, req.Name, req.Offer)
	case wire.OpLoad:
		inf, err = c.s.reg.Load(cred, req.Name)
	case wire.OpPin:
		inf, err = c.s.reg.SetResident(cred, req.Name, req.Pin)
	}
	if err != nil {
		return fail(fmt.Errorf("%s: %w", req.Op, err))
	}
	return &wire.Reply{Segment: c.toWire(inf)}, -1
}

// wireTiers is info's account of budgets and moves.
func wireTiers(st segment.TierStats) *wire.Tiers {
	w := &wire.Tiers{
		Devices:    make([]wire.DeviceTier, len(st.Devices)),
		HostBudget: st.HostBudget, HostBytes: st.HostBytes, CleanBytes: st.CleanBytes,
		Spare: st.Spare, SpareBytes: st.SpareBytes,
		ReserveTarget: st.Reserve.Target, ReserveBytes: st.Reserve.Bytes, ReserveMemfds: st.Reserve.Memfds, ReserveTakes: st.Reserve.Takes,
		Evictions: st.Evictions, Restores: st.Restores,
		EvictedBytes: st.EvictedBytes, RestoredBytes: st.RestoredBytes,
	}
	for i, d := range st.Devices {
		w.Devices[i] = wire.DeviceTier{Device: d.Device, Budget: d.Budget, Bytes: d.Bytes, Peak: d.Peak}
	}
	if st.Disk {
		w.Disk = &wire.DiskTier{Bytes: st.DiskBytes, Budget: st.DiskBudget, Segments: st.DiskSegments, Durable: st.Durable,
			Writes: st.DiskWrites, Reads: st.DiskReads, WrittenBytes: st.DiskWrittenBytes, ReadBytes: st.DiskReadBytes}
	}
	return w
}

// wireUsers is info's account of what each uid holds.
func wireUsers(us []segment.UserUse) []wire.UserUse {
	out := make([]wire.UserUse, len(us))
	for i, u := range us {
		out[i] = wire.UserUse{UID: u.UID, Device: u.Device, Bytes: u.Bytes, Segments: u.Segments}
	}
	return out
}

// wireQuotas is info's account of the limits in force.
func wireQuotas(qs []segment.QuotaUse) []wire.Quota {
	out := make([]wire.Quota, len(qs))
	for i, q := range qs {
		out[i] = wire.Quota{Kind: q.Kind, Scope: q.Scope, Used: q.Used, Limit: q.Limit}
	}
	return out
}

// MoveObserver is told of every move between tiers (the metrics).
type MoveObserver interface {
	ObserveMove(kind string, bytes int64, d time.Duration)
}

// ObserveMove logs a move between a device and host memory, and counts it
// when the observer takes moves; the registry calls it (segment.Tiers).
func (s *Server) ObserveMove(kind, name string, bytes int64, d time.Duration) {
	s.log.Info(kind, "name", name, "bytes", bytes, "seconds", d.Seconds(),
		"GB/s", float64(bytes)/max(d.Seconds(), 1e-9)/1e9)
	if m, ok := s.obs.(MoveObserver); ok {
		m.ObserveMove(kind, bytes, d)
	}
}

// opPeers answers peers: what the peers' node reports, asking connected
// peers what they offer, which takes a round trip to each, so the request
// leaves the workers first; or, for a name, only its pull in progress
// here (a pull's progress bar asks several times a second).
func (c *conn) opPeers(pull string) (*wire.Reply, int) {
	if c.s.peers == nil {
		return &wire.Reply{}, -1
	}
	if pull != "" {
		return &wire.Reply{Peers: c.s.peers(context.Background(), pull)}, -1
	}
	c.s.setAside(c.w)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return &wire.Reply{Peers: c.s.peers(ctx, "")}, -1
}

// opPull answers pull: the daemon's peers copy the segment here, which
// takes the transfer's time; the request leaves the workers first.
func (c *conn) opPull(cred segment.Cred, req *wire.Request) (*wire.Reply, int) {
	if err := segment.ValidName(req.Name); err != nil {
		return fail(fmt.Errorf("pull: %w", err))
	}
	if c.s.pull == nil {
		return fail(fmt.Errorf("pull: %w: the daemon has no peers (--listen-peers, --peers)", syscall.EOPNOTSUPP))
	}
	c.s.setAside(c.w)
	ctx, cancel := context.WithTimeout(context.Background(), wire.PullTime)
	defer cancel()
	inf, err := c.s.pull(ctx, cred, req.Name, req.From, c.origin(req))
	if err != nil {
		return fail(err)
	}
	return &wire.Reply{Segment: c.toWire(inf)}, -1
}
