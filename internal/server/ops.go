package server

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"syscall"
	"time"

	"github.com/gpushm/gpushm/internal/channel"
	"github.com/gpushm/gpushm/internal/memfd"
	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/wire"
)

// handler answers one operation: one method of conn each, which
// handlers names. inFD is the descriptor that came with the request, -1
// for an operation that takes none (wire.Operation.FD).
type handler func(c *conn, req *wire.Request, inFD int) (*wire.Reply, int)

// handlers is the server's half of wire.Operations (as go-fuse's
// fuse/opcode.go maps each opcode to its handler): a handler for each
// operation there and for nothing else, which TestHandlersAreOperations
// checks. It is filled in init, as go-fuse fills its table: the handlers
// lead back to dispatch (a copy set aside is served again by a worker),
// which an initializer may not.
var handlers map[string]handler

func init() {
	handlers = map[string]handler{
		wire.OpHello:       func(c *conn, req *wire.Request, _ int) (*wire.Reply, int) { return c.opHello(req) },
		wire.OpInfo:        func(c *conn, _ *wire.Request, _ int) (*wire.Reply, int) { return c.opInfo() },
		wire.OpCreate:      func(c *conn, req *wire.Request, _ int) (*wire.Reply, int) { return c.opCreate(req) },
		wire.OpOpen:        func(c *conn, req *wire.Request, _ int) (*wire.Reply, int) { return c.opOpen(req) },
		wire.OpClose:       func(c *conn, req *wire.Request, _ int) (*wire.Reply, int) { return c.opClose(req) },
		wire.OpUnlink:      func(c *conn, req *wire.Request, _ int) (*wire.Reply, int) { return c.opUnlink(req) },
		wire.OpStat:        func(c *conn, req *wire.Request, _ int) (*wire.Reply, int) { return c.opStat(req) },
		wire.OpList:        func(c *conn, req *wire.Request, _ int) (*wire.Reply, int) { return c.list(req), -1 },
		wire.OpChmod:       func(c *conn, req *wire.Request, _ int) (*wire.Reply, int) { return c.opChmod(req) },
		wire.OpChown:       func(c *conn, req *wire.Request, _ int) (*wire.Reply, int) { return c.opChown(req) },
		wire.OpRename:      func(c *conn, req *wire.Request, _ int) (*wire.Reply, int) { return c.opRename(req) },
		wire.OpPublish:     (*conn).publish,
		wire.OpReclaim:     func(c *conn, req *wire.Request, _ int) (*wire.Reply, int) { return c.opReclaim(req) },
		wire.OpCommit:      func(c *conn, req *wire.Request, _ int) (*wire.Reply, int) { return c.commit(req) },
		wire.OpWaitVersion: func(c *conn, req *wire.Request, _ int) (*wire.Reply, int) { return c.opWaitVersion(req) },
		wire.OpFill:        (*conn).copyFile,
		wire.OpDump:        (*conn).copyFile,
		wire.OpEvict:       func(c *conn, req *wire.Request, _ int) (*wire.Reply, int) { return c.tier(c.leaseCred(), req) },
		wire.OpLoad:        func(c *conn, req *wire.Request, _ int) (*wire.Reply, int) { return c.tier(c.leaseCred(), req) },
		wire.OpPin:         func(c *conn, req *wire.Request, _ int) (*wire.Reply, int) { return c.tier(c.leaseCred(), req) },
		wire.OpSync:        func(c *conn, req *wire.Request, _ int) (*wire.Reply, int) { return c.tier(c.leaseCred(), req) },
		wire.OpOffer:       func(c *conn, req *wire.Request, _ int) (*wire.Reply, int) { return c.tier(c.leaseCred(), req) },
		wire.OpPeers:       func(c *conn, req *wire.Request, _ int) (*wire.Reply, int) { return c.opPeers(req.Name) },
		wire.OpPull:        func(c *conn, req *wire.Request, _ int) (*wire.Reply, int) { return c.opPull(c.leaseCred(), req) },
	}
}

// dispatch answers req with the method for its operation, one each
// (handlers). inFD, the descriptor that came with a publish, fill or
// dump, is dispatch's to keep or close. A nil reply means the connection
// parked while req waited (c.pending has it).
func (c *conn) dispatch(req *wire.Request, inFD int) (*wire.Reply, int) {
	if !c.hello && req.Op != wire.OpHello {
		if inFD >= 0 {
			syscall.Close(inFD)
		}
		return fail(fmt.Errorf("%w: the first message must be hello", wire.ErrProto))
	}
	if !wire.CarriesFD(req.Op) {
		// Publish, fill and dump neither read a role nor end a reclaim.
		if req.Role == string(channel.Rx) {
			// A channel's consumer reads the slots and writes only its
			// control block, a descriptor of its own: it asks for read
			// access, whether it says readonly or not, and is served as a
			// read-only open.
			req.ReadOnly = true
		}
		if c.reclaiming && req.Op != wire.OpReclaim && req.Op != wire.OpHello {
			c.endReclaim()
		}
	}
	if h := handlers[req.Op]; h != nil {
		return h(c, req, inFD)
	}
	return fail(fmt.Errorf("unknown operation %q: %w", req.Op, syscall.ENOSYS))
}

// opHello checks the client's protocol version, takes its session (a
// client back after a restart reclaims what it holds next) and sends the
// epoch page.
func (c *conn) opHello(req *wire.Request) (*wire.Reply, int) {
	if req.Version != wire.Version {
		return fail(fmt.Errorf("%w: protocol version %d not supported (this daemon speaks %d)", wire.ErrProto, req.Version, wire.Version))
	}
	if len(req.Session) > maxSession {
		return fail(fmt.Errorf("%w: session of %d bytes, limit %d", wire.ErrProto, len(req.Session), maxSession))
	}
	c.hello = true
	if req.Session != "" && c.session == "" {
		c.session = req.Session
		c.bound = append(c.bound, c.s.takeBound(req.Session, c.cred.UID, c.proc)...)
		// A client back after a restart reclaims what it holds next.
		c.reclaiming = true
	}
	fd, err := c.s.epochReadOnly()
	if err != nil {
		return fail(err)
	}
	return &wire.Reply{Version: wire.Version, Server: c.s.version, Backend: c.s.backend.Name(), Epoch: true,
		Peer: &wire.Peer{UID: c.cred.UID, GID: c.cred.GID}}, fd
}

// opInfo reports the backend, its devices, the registry's use, the
// processes serving, the tiers, and the users and quotas.
func (c *conn) opInfo() (*wire.Reply, int) {
	devs, err := c.s.backend.Devices()
	if err != nil {
		return fail(err)
	}
	u := c.s.reg.Usage()
	sup := c.s.supervisorNow.Load()
	restarts := sup.restarts
	rep := &wire.Reply{Backend: c.s.backend.Name(), Devices: devs,
		Usage: &wire.Usage{Segments: u.Segments, Named: u.Named, Bytes: u.Bytes, Opens: u.Opens},
		PID:   os.Getpid(), SupervisorPID: sup.pid, Restarts: &restarts,
		Grace: c.s.reg.GraceLeft().Seconds()}
	if c.s.gpus != nil {
		rep.GPU = c.s.gpus(c.cred.UID)
	}
	if p, ok := c.s.backend.(pooler); ok {
		if ps := p.PoolStats(); ps != (wire.Pool{}) {
			rep.Pool = &ps
		}
	}
	rep.Tiers = wireTiers(c.s.reg.TierStats())
	rep.Users, rep.Quotas = wireUsers(c.s.reg.Users()), wireQuotas(c.s.reg.QuotasFor(c.leaseCred().UID))
	return rep, -1
}

// opReclaim takes back count leases of a segment (and a channel role) that
// this client's process held before a restart.
func (c *conn) opReclaim(req *wire.Request) (*wire.Reply, int) {
	n := req.Count
	if n == 0 {
		n = 1
	}
	if n < 0 || n > maxReclaim {
		return fail(fmt.Errorf("reclaim: count %d (want 1 to %d): %w", n, maxReclaim, syscall.EINVAL))
	}
	if err := c.mayReclaim(req.Segment); err != nil {
		return fail(fmt.Errorf("reclaim: %w", err))
	}
	seg, err := c.s.reg.Reclaim(c.leaseCred(), req.Segment, n, req.ReadOnly)
	if err != nil {
		return fail(fmt.Errorf("reclaim: %w", err))
	}
	if req.Role != "" {
		role, err := parseRole(req.Role)
		if err == nil {
			err = c.claim(seg, role) // the same checks as a first claim
		}
		if err != nil {
			for range n {
				c.s.reg.ReleaseBy(seg, c.leaseCred())
			}
			return fail(fmt.Errorf("reclaim: %w", err))
		}
	}
	for range n {
		c.hold(seg)
	}
	return &wire.Reply{Segment: c.segmentInfo(seg)}, -1
}

// opCreate makes a segment (or finds it, with exist_ok or a retried
// request) and, with open, hands out its descriptor.
func (c *conn) opCreate(req *wire.Request) (*wire.Reply, int) {
	dev := c.s.backend.DefaultDevice()
	if req.Device != nil {
		dev = *req.Device
	}
	o, err := c.createOptions(req, dev)
	if err != nil {
		return fail(fmt.Errorf("create: %w", err))
	}
	c.trace.Mark("options")
	o.Trace = c.trace
	seg, created, err := c.s.reg.Create(c.leaseCred(), o)
	if err != nil {
		return fail(fmt.Errorf("create: %w", err))
	}
	if created && (o.Bound || o.Uncommitted) && !slices.Contains(c.bound, seg) {
		c.bound = append(c.bound, seg)
	}
	rep := &wire.Reply{Created: &created, Segment: c.segmentInfo(seg)}
	if !req.Open {
		return rep, -1
	}
	fd, err := c.handOut(seg, req)
	if err != nil {
		// A create that cannot hand out its descriptor leaves nothing.
		c.s.reg.ReleaseBy(seg, c.leaseCred())
		if created {
			c.s.reg.Discard(seg)
		}
		return fail(fmt.Errorf("create %q: %w", req.Name, err))
	}
	c.hold(seg)
	c.trace.Mark("handout")
	rep.FD, rep.Control = true, c.ctlFD >= 0
	return rep, fd
}

// opOpen takes a lease on a segment by name, waiting for its commit or its
// copy back from host memory off the workers, and hands out its
// descriptor.
func (c *conn) opOpen(req *wire.Request) (*wire.Reply, int) {
	if req.Role == string(channel.Tx) && req.ReadOnly {
		return fail(fmt.Errorf("open %q: a producer writes: role \"tx\" cannot be read-only: %w", req.Name, syscall.EINVAL))
	}
	var seg *segment.Segment
	var err error
	if req.Wait != 0 || c.s.reg.WouldRestore(req.Name) {
		// A wait, or a copy back from host memory, must not hold
		// one of the workers.
		c.s.setAside(c.w)
	}
	if req.Wait != 0 {
		seg, err = c.acquireWait(c.leaseCred(), req)
	} else {
		seg, err = c.s.reg.Acquire(c.leaseCred(), req.Name, req.ReadOnly)
	}
	if errors.Is(err, errParked) {
		return nil, -1
	}
	if err != nil {
		return fail(fmt.Errorf("open: %w", err))
	}
	c.trace.Mark("lookup")
	fd, err := c.handOut(seg, req)
	if err != nil {
		c.s.reg.ReleaseBy(seg, c.leaseCred())
		return fail(fmt.Errorf("open %q: %w", req.Name, err))
	}
	c.hold(seg)
	c.trace.Mark("handout")
	return &wire.Reply{Segment: c.segmentInfo(seg), FD: true, Control: c.ctlFD >= 0}, fd
}

// opClose ends one lease of this connection's (and the channel role it
// names).
func (c *conn) opClose(req *wire.Request) (*wire.Reply, int) {
	if req.Role != "" {
		role, err := parseRole(req.Role)
		if err != nil {
			return fail(fmt.Errorf("close: %w", err))
		}
		if l := c.leases[req.Segment]; l != nil {
			c.unclaim(l.seg, role, false)
		}
	}
	if !c.release(req.Segment) {
		return fail(fmt.Errorf("close: this connection holds no open of segment %d: %w", req.Segment, syscall.EINVAL))
	}
	return &wire.Reply{}, -1
}

func (c *conn) opUnlink(req *wire.Request) (*wire.Reply, int) {
	if err := c.s.reg.Unlink(c.leaseCred(), req.Name); err != nil {
		return fail(fmt.Errorf("unlink: %w", err))
	}
	return &wire.Reply{}, -1
}

func (c *conn) opStat(req *wire.Request) (*wire.Reply, int) {
	inf, err := c.s.reg.Stat(req.Name)
	if err != nil {
		return fail(fmt.Errorf("stat: %w", err))
	}
	return &wire.Reply{Segment: c.toWire(inf)}, -1
}

func (c *conn) opChmod(req *wire.Request) (*wire.Reply, int) {
	seg, _, err := c.s.reg.Lookup(req.Name)
	if err == nil {
		if req.Mode == nil {
			return fail(fmt.Errorf("chmod: no mode: %w", syscall.EINVAL))
		}
		err = c.s.reg.SetMode(c.leaseCred(), seg, *req.Mode)
	}
	if err != nil {
		return fail(fmt.Errorf("%s: %w", req.Op, err))
	}
	return &wire.Reply{Segment: c.segmentInfo(seg)}, -1
}

func (c *conn) opChown(req *wire.Request) (*wire.Reply, int) {
	seg, _, err := c.s.reg.Lookup(req.Name)
	if err == nil {
		var uid, gid int64
		if uid, err = ownerID("uid", req.UID); err == nil {
			gid, err = ownerID("gid", req.GID)
		}
		if err == nil {
			err = c.s.reg.SetOwner(c.leaseCred(), seg, uid, gid)
		}
	}
	if err != nil {
		return fail(fmt.Errorf("%s: %w", req.Op, err))
	}
	return &wire.Reply{Segment: c.segmentInfo(seg)}, -1
}

// opWaitVersion waits, off the workers, for a name to name a segment other
// than the one the client holds.
func (c *conn) opWaitVersion(req *wire.Request) (*wire.Reply, int) {
	c.s.setAside(c.w) // a wait must not hold one of the workers
	inf, err := c.waitVersion(req)
	if errors.Is(err, errParked) {
		return nil, -1
	}
	if err != nil {
		return fail(fmt.Errorf("wait_version: %w", err))
	}
	return &wire.Reply{Segment: c.toWire(inf)}, -1
}

func (c *conn) opRename(req *wire.Request) (*wire.Reply, int) {
	var flags uint32
	if req.NoReplace {
		flags = segment.RenameNoReplace
	}
	if err := c.s.reg.Rename(c.leaseCred(), req.Name, req.To, flags); err != nil {
		return fail(fmt.Errorf("rename: %w", err))
	}
	return &wire.Reply{}, -1
}

// maxTTL bounds ttl_seconds: a year is longer than any idle segment should
// be kept, and keeps the arithmetic far from overflow.
const maxTTL = 365 * 24 * time.Hour

// ownerID reads chown's uid or gid: absent is -1 (unchanged). The values a
// kernel takes as ids are 0 to 2^32-2; 2^32-1 is chown(2)'s "unchanged",
// which the protocol spells by leaving the field out.
func ownerID(field string, v *int64) (int64, error) {
	if v == nil {
		return -1, nil
	}
	if *v < 0 || *v >= 1<<32-1 {
		return 0, fmt.Errorf("%s %d out of range (0 to %d; leave it out to keep it): %w", field, *v, uint32(1<<32-2), syscall.EINVAL)
	}
	return *v, nil
}

// maxSession bounds a client's session name; maxReclaim the leases one
// reclaim may take.
const (
	maxSession = 128
	maxReclaim = 1 << 20
)

// createOptions reads the parts of a create (or publish) request that the
// registry takes.
func (c *conn) createOptions(req *wire.Request, dev int) (segment.CreateOptions, error) {
	o := segment.CreateOptions{
		Name: req.Name, Size: req.Size, Device: dev,
		Mode: deref(req.Mode), UseMode: req.Mode != nil,
		Meta: req.Meta, ExistOK: req.ExistOK, Open: req.Open, ReadOnly: req.ReadOnly,
		Resident: req.Pin,
		Persist:  req.Persist,
		Offer:    req.Offer,
		Session:  c.session,
		Slots:    req.Slots, SlotBytes: req.SlotBytes,
		Uncommitted: req.Uncommitted,
		NextVersion: req.NextVersion,
	}
	if len(req.Meta) > wire.MaxMeta {
		return o, fmt.Errorf("meta of %d bytes, limit %d: %w", len(req.Meta), wire.MaxMeta, syscall.EINVAL)
	}
	if req.Slots != 0 || req.SlotBytes != 0 {
		if req.Slots == 0 {
			return o, fmt.Errorf("slot_bytes without slots: %w", syscall.EINVAL)
		}
		o.Control = initControl(req.Slots, req.SlotBytes)
	}
	if req.Role != "" && !req.Open {
		return o, fmt.Errorf("a role is taken by opening: %w", syscall.EINVAL)
	}
	if req.ReadOnly && !req.Open {
		return o, fmt.Errorf("readonly applies to the open of a create with open: %w", syscall.EINVAL)
	}
	if req.Empty {
		// A name that holds no memory: there is nothing to open, fill
		// or commit, and a channel is its slots.
		if req.Size != 0 || req.Open || req.Uncommitted || req.Slots != 0 {
			return o, fmt.Errorf("an empty segment has size 0 and no memory to open, fill or commit (empty takes no size, open, uncommitted or slots): %w", syscall.EINVAL)
		}
		o.AllowEmpty = true
	}
	// A client that lost the reply resends the request, id and all, on a
	// new connection: this finds what the first attempt made.
	o.Origin = c.origin(req)
	switch req.Lifetime {
	case "":
	case wire.LifetimeConnection:
		// The creator is journaled, so that after a restart the segment
		// waits for exactly this process.
		o.Bound, o.Creator = true, c.proc
	default:
		return o, fmt.Errorf("lifetime %q (want \"connection\" or none): %w", req.Lifetime, syscall.EINVAL)
	}
	if o.Uncommitted {
		// It ends with its creator too, and waits for it across a restart.
		o.Creator = c.proc
	}
	if req.TTL < 0 || req.TTL > maxTTL.Seconds() {
		return o, fmt.Errorf("ttl_seconds %g (want 0 to %g): %w", req.TTL, maxTTL.Seconds(), syscall.EINVAL)
	}
	o.TTL = time.Duration(req.TTL * float64(time.Second))
	return o, nil
}

// origin names req across reconnections of its client ("" for a client
// without a session).
func (c *conn) origin(req *wire.Request) string {
	if c.session == "" {
		return ""
	}
	return c.session + "/" + strconv.FormatUint(req.ID, 10)
}

// publish names memory the client allocated and sent: the daemon keeps the
// descriptor, so the name stays valid after the publisher exits.
func (c *conn) publish(req *wire.Request, fd int) (*wire.Reply, int) {
	dev := c.s.backend.DefaultDevice()
	if req.Device != nil {
		dev = *req.Device
	}
	// exist_ok, open and uncommitted do not apply: DecodeRequest refused
	// them.
	o, err := c.createOptions(req, dev)
	if err == nil {
		err = segment.ValidName(req.Name)
	}
	if err != nil {
		syscall.Close(fd)
		return fail(fmt.Errorf("publish: %w", err))
	}
	mem, err := c.s.backend.Adopt(dev, fd, req.Size)
	if err != nil {
		syscall.Close(fd)
		return fail(err)
	}
	o.Memory = mem
	// A retried publish that its first attempt already made finds that
	// segment (Origin), and Create frees the memory sent again.
	seg, _, err := c.s.reg.Create(segment.Cred{UID: c.cred.UID, GID: c.cred.GID}, o)
	if err != nil {
		return fail(fmt.Errorf("publish: %w", err))
	}
	if o.Bound && !slices.Contains(c.bound, seg) {
		c.bound = append(c.bound, seg)
	}
	created := true
	return &wire.Reply{Created: &created, Segment: c.segmentInfo(seg)}, -1
}

// maxPage bounds a list page; the page shrinks further if it would not fit
// in one packet.
const maxPage = 256

func (c *conn) list(req *wire.Request) *wire.Reply {
	limit := req.Limit
	if limit <= 0 || limit > maxPage {
		limit = maxPage
	}
	infos := c.s.reg.List(req.After, limit+1)
	more := len(infos) > limit
	if more {
		infos = infos[:limit]
	}
	for {
		rep := &wire.Reply{Segments: make([]wire.Segment, len(infos))}
		for i, inf := range infos {
			rep.Segments[i] = *c.toWire(inf)
		}
		if more && len(infos) > 0 {
			rep.Next = infos[len(infos)-1].Name
		}
		b, err := json.Marshal(rep)
		if err == nil && len(b)+64 <= wire.MaxMessage {
			return rep
		}
		// Names are at most 255 bytes, so a handful always fits.
		infos, more = infos[:len(infos)/2], true
	}
}

func (c *conn) segmentInfo(seg *segment.Segment) *wire.Segment {
	return c.toWire(c.s.reg.Info(seg))
}

// toWire is inf as this connection's user may see it (docs/security.md,
// "What others may see"): whoever may read the segment sees all of it;
// anyone else what ls -l shows of a file (name, size, owner, mode, times,
// state), not what its owner wrote into it (meta: a bundle's origin
// paths, a model's layout) nor who holds its old versions (pids).
func (c *conn) toWire(inf segment.Info) *wire.Segment {
	w := c.s.toWire(inf)
	if inf.Allows(c.leaseCred(), segment.Read) {
		return w
	}
	w.Meta, w.Sources = nil, nil
	for i := range w.Versions {
		w.Versions[i].PIDs = nil
	}
	return w
}

func deref(p *uint32) uint32 {
	if p == nil {
		return 0
	}
	return *p
}

// handOut is the descriptor an open of seg sends, with a channel's role
// taken as req asks and its control block ready to follow (c.ctlFD).
func (c *conn) handOut(seg *segment.Segment, req *wire.Request) (int, error) {
	fd, err := seg.FD()
	if err != nil {
		return -1, err
	}
	if !seg.IsChannel() {
		if req.Role != "" {
			return -1, fmt.Errorf("%q is not a channel: no role to take: %w", req.Name, syscall.EINVAL)
		}
		if req.ReadOnly {
			return c.readOnlyData(fd)
		}
		return fd, nil
	}
	ctl := -1
	err = c.s.reg.WithControl(seg, func(fd int) error {
		ctl = fd // the caller's lease keeps it open until it is sent
		return nil
	})
	if err != nil {
		return -1, err
	}
	if req.ReadOnly || req.Role == string(channel.Rx) {
		// A consumer reads the slots; it writes only the control block.
		if fd, err = c.readOnlyData(fd); err != nil {
			return -1, err
		}
	}
	if req.Role == "" {
		// Opened to look: no end writes through this control block.
		if ctl, err = c.readOnly(ctl); err != nil {
			return -1, err
		}
	}
	if req.Role != "" {
		role, err := parseRole(req.Role)
		if err != nil {
			return -1, err
		}
		if err := c.claim(seg, role); err != nil {
			return -1, err
		}
	}
	c.ctlFD = ctl
	return fd, nil
}

// readOnlyData is the descriptor a read-only open of memory at fd sends:
// on the host backend a descriptor of the memfd that cannot be mapped
// writable or written; on cuda fd itself, since an exported CUDA handle
// carries no access mode (docs/security.md).
func (c *conn) readOnlyData(fd int) (int, error) {
	if c.s.backend.HandleType() != wire.HandleMemfd {
		return fd, nil
	}
	return c.readOnly(fd)
}

// readOnly is a read-only descriptor of the memfd fd, closed once the
// reply is sent.
func (c *conn) readOnly(fd int) (int, error) {
	ro, err := memfd.ReadOnly(fd)
	if err != nil {
		return -1, err
	}
	c.temp = append(c.temp, ro)
	return ro, nil
}
