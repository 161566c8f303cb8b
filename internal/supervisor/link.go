package supervisor

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/wire"
)

// The serving process finds its supervisor's descriptors at fixed numbers:
// the control socket, the listening socket and the epoch page, in that
// order from 3, announced by envLink; and the daemon lock at 6, announced
// by envLock (a supervisor that passes it lets the serving process replace
// it, heal.go). A supervisor started by a serving process whose own died
// finds the same four, and the serving process's pidfd at 7, announced by
// envAdopt (handover.go).
const (
	envLink  = "GPUSHM_SUPERVISOR_FD"
	envLock  = "GPUSHM_SUPERVISOR_LOCK"
	envAdopt = "GPUSHM_ADOPT"
)

const (
	fdControl  = 3
	fdListener = 4
	fdEpoch    = 5
	fdLock     = 6
	fdPidfd    = 7
)

// msg is one control message, in either direction; at most one descriptor
// travels with it. The supervisor reads only the fields it acts on, and
// passes records and connection states through without interpreting them.
type msg struct {
	T   string          `json:"t"`
	ID  uint64          `json:"id,omitempty"`
	Rec json.RawMessage `json:"rec,omitempty"`
	// State is a parked connection's state (opaque to the supervisor).
	State      json.RawMessage `json:"state,omitempty"`
	NextID     uint64          `json:"next_id,omitempty"`
	GraceUntil int64           `json:"grace_until,omitempty"`
	Reason     string          `json:"reason,omitempty"`
	Restarts   int             `json:"restarts,omitempty"`
	PID        int             `json:"pid,omitempty"`
	// Batch is a batch's changes, each a put or a del.
	Batch []msg `json:"batch,omitempty"`
	// Batches, in "go", says the supervisor applies batches; a serving
	// process started by an older one sends their changes one by one.
	Batches bool `json:"batches,omitempty"`
	// Syncs, in "go", says the supervisor answers "sync" (Link.Sync).
	Syncs bool `json:"syncs,omitempty"`
	// Heal, in "go", lets the serving process start a new supervisor if
	// this one dies (heal.go).
	Heal bool `json:"heal,omitempty"`
	// Tables, in "go", says the supervisor reads a record table (table.go)
	// that the serving process sends it with "table"; Seq orders a put's
	// or a batch's records against the table's.
	Tables bool   `json:"tables,omitempty"`
	Seq    uint64 `json:"seq,omitempty"`
}

// maxControl bounds a control message: a batch holds two records of up to
// a protocol message each. It stays under the socket's send buffer
// (net.core.wmem_default, 208 KiB by default), the bound on one packet.
const maxControl = 3 * wire.MaxMessage

// Control message types.
const (
	// supervisor -> server
	tSeg     = "seg"     // a held segment: id, rec (absent if unknown), its descriptor if any
	tConn    = "conn"    // a parked client connection and its state (both directions)
	tGo      = "go"      // end of the state; serve
	tQuiesce = "quiesce" // stop serving and hand the connections over
	tResume  = "resume"  // the handover failed: serve again
	tExit    = "exit"    // exit now, freeing nothing
	tStop    = "stop"    // graceful stop: close everything and exit
	// server -> supervisor
	tPut      = "put"      // a record, and the segment's new descriptor if any
	tCtl      = "ctl"      // a channel's control block, for the put (or seg) right after it (both directions)
	tDel      = "del"      // a segment was freed
	tBatch    = "batch"    // puts and dels (no descriptors) that are one change: all or none
	tInit     = "init"     // the backend is up; waiting for the state
	tReady    = "ready"    // serving
	tQuiesced = "quiesced" // every connection has been sent
	tSync     = "sync"     // answer "synced" once everything before this is applied
	tHold     = "hold"     // keep a reference to memory made ahead (id, descriptor) until "unhold" of its id
	tUnhold   = "unhold"   // the memory held under id is the serving process's alone again
	tSynced   = "synced"   // supervisor -> server: the sync of this id
	tTable    = "table"    // the record table (table.go), its memfd
	// A serving process whose supervisor died and the one it started in
	// its place (heal.go, handover.go): the new supervisor says "init" when it
	// reads, the server sends every record (put, ctl) and then "handed",
	// and the new supervisor answers "adopted".
	tHanded  = "handed"  // server -> new supervisor: that was everything
	tAdopted = "adopted" // new supervisor -> server: it holds it all
)

func send(c *wire.Conn, m msg, fd int) error {
	b, err := json.Marshal(m)
	if err != nil {
		return err
	}
	return sendBytes(c, m.T, b, fd)
}

// sendBytes sends b, an encoded control message of type t.
func sendBytes(c *wire.Conn, t string, b []byte, fd int) error {
	if len(b) > maxControl {
		return fmt.Errorf("control message %q of %d bytes exceeds %d", t, len(b), maxControl)
	}
	return c.Send(b, fd)
}

func recv(c *wire.Conn) (msg, int, error) {
	b, fd, err := c.Recv()
	if err != nil {
		return msg{}, -1, err
	}
	var m msg
	if err := json.Unmarshal(b, &m); err != nil {
		closeFD(fd)
		return msg{}, -1, fmt.Errorf("%w: control message: %v", wire.ErrProto, err)
	}
	return m, fd, nil
}

// controlConn takes ownership of fd, one end of a control socket. Either
// end reads everything its peer sent, even after the peer died: a serving
// process SIGKILLed while an answer of the supervisor's ("synced") was
// still unread in its queue makes the kernel report a reset to the
// supervisor ahead of the journal messages the serving process had sent
// (and acknowledged to its clients), and those must be applied before a
// successor gets the state (wire.Conn.SetDrain).
func controlConn(fd int) (*wire.Conn, error) {
	c, err := wire.NewConn(fd)
	if err != nil {
		return nil, err
	}
	c.SetMaxMessage(maxControl)
	c.SetDrain(true)
	return c, nil
}

// Link is the serving process's end of the control socket. Its Put and
// Delete make the registry durable (it implements segment.Journal): a
// record reaches the supervisor's socket buffer before the operation that
// made it is acknowledged, and a buffered message outlives its sender, so
// a server killed right after acknowledging loses nothing.
type Link struct {
	mu   sync.Mutex // serializes sends; guards what follows
	conn *wire.Conn // nil while no supervisor holds the state (heal.go)
	// Lost is called once if the supervisor goes away or a send fails and
	// no new one can take over: without a supervisor the server cannot
	// keep its promises, and must stop at once. It must not return
	// normally to the sender.
	Lost func(error)
	cmds chan string
	// batches: the supervisor applies batches (it said so in "go").
	batches bool
	// syncs: it answers "sync"; syncing holds the waiting Syncs by id.
	syncs bool
	// table takes the records that come without a descriptor, when the
	// supervisor reads one (it said so in "go"); seq numbers every record
	// journaled, message or slot; recBuf is where one is encoded.
	table   *leaseTable
	tables  bool // the supervisor said it reads one; so will one it is replaced by
	seq     uint64
	recBuf  []byte
	syncID  uint64
	syncing map[uint64]chan struct{}
	// parked is set from "quiesce" to "resume", ending from "exit" or
	// "stop" on: a supervisor lost then is not replaced.
	parked, ending bool
	// What it takes to replace a supervisor that died: the descriptors it
	// passed (nil when it passed no lock), and heal, once Heal was called.
	listener, epoch, lock *os.File
	heal                  *healing
	// readers counts the goroutines reading a control socket (read), so
	// that whoever ends the Link can wait until none of them can still
	// reach for a descriptor it closes.
	readers sync.WaitGroup
}

var _ segment.Journal = (*Link)(nil)

// Attached reports whether this process was started by a supervisor.
func Attached() bool { return os.Getenv(envLink) != "" }

// Attach takes over the descriptors the supervisor passed. It returns the
// listener and the epoch page's descriptor.
func Attach() (*Link, *net.UnixListener, int, error) {
	if v := os.Getenv(envLink); v != strconv.Itoa(fdControl) {
		return nil, nil, -1, fmt.Errorf("%s=%q: not started by a gpushm supervisor", envLink, v)
	}
	os.Unsetenv(envLink)
	for _, fd := range []int{fdControl, fdListener, fdEpoch} {
		unix.CloseOnExec(fd)
	}
	conn, err := controlConn(fdControl)
	if err != nil {
		return nil, nil, -1, fmt.Errorf("control socket: %w", err)
	}
	// The listener's descriptor stays open beside the net.Listener's
	// duplicate, and the epoch page's beside the server's, for a supervisor
	// this process may have to start (heal.go).
	lf := os.NewFile(fdListener, "listener")
	fl, err := net.FileListener(lf)
	if err != nil {
		lf.Close()
		conn.Close()
		return nil, nil, -1, fmt.Errorf("listening socket from the supervisor: %w", err)
	}
	ln, ok := fl.(*net.UnixListener)
	if !ok {
		lf.Close()
		fl.Close()
		conn.Close()
		return nil, nil, -1, fmt.Errorf("listening socket from the supervisor is a %T", fl)
	}
	ln.SetUnlinkOnClose(false)
	l := &Link{conn: conn, cmds: make(chan string, 4), listener: lf}
	if fd, err := unix.FcntlInt(fdEpoch, unix.F_DUPFD_CLOEXEC, 0); err == nil {
		l.epoch = os.NewFile(uintptr(fd), "epoch")
	}
	if os.Getenv(envLock) == strconv.Itoa(fdLock) {
		unix.CloseOnExec(fdLock)
		l.lock = os.NewFile(fdLock, "lock")
	}
	os.Unsetenv(envLock)
	l.Lost = func(err error) {
		fmt.Fprintf(os.Stderr, "gpushm: lost the supervisor: %v\n", err)
		os.Exit(70)
	}
	return l, ln, fdEpoch, nil
}

// Held is a segment the supervisor holds: its record and its descriptor
// (-1 if none), and a channel's control block (-1 if none), which the
// receiver owns.
type Held struct {
	ID    uint64
	Rec   json.RawMessage // nil: a descriptor with no record
	FD    int
	CtlFD int
}

// Parked is a client connection handed from one serving process to the
// next: its socket (owned by the receiver) and its state, as the server
// that parked it wrote it.
type Parked struct {
	FD    int
	State json.RawMessage
}

// Start is what a serving process receives before it serves.
type Start struct {
	Segments []Held
	Conns    []Parked
	// NextID is the highest segment ID ever given out.
	NextID uint64
	// GraceUntil is when the grace period for reclaiming leases ends
	// (zero: none; clients' leases came with their connections).
	GraceUntil time.Time
	// Reason is "start", "restart" (after a crash) or "upgrade".
	Reason        string
	Restarts      int
	SupervisorPID int
	// Heal says the serving process may replace its supervisor if it
	// dies (Link.Heal): the supervisor allows it and passed what it takes.
	Heal bool
}

// Initialized tells the supervisor that the backend is up, so an upgrade
// may proceed to the handover.
func (l *Link) Initialized() error { return l.send(msg{T: tInit, PID: os.Getpid()}, -1) }

// Receive reads the state the supervisor hands over, up to "go".
func (l *Link) Receive() (*Start, error) {
	st := &Start{}
	// A channel's control block comes in a message of its own right
	// before its segment's (one descriptor a message); anything else
	// between them makes it a stray, closed rather than given to another
	// segment.
	var ctl pending
	defer ctl.drop()
	for {
		m, fd, err := recv(l.conn)
		if err != nil {
			st.close()
			return nil, fmt.Errorf("receive state: %w", err)
		}
		if m.T != tSeg {
			ctl.drop()
		}
		switch m.T {
		case tCtl:
			ctl.set(m.ID, fd)
		case tSeg:
			st.Segments = append(st.Segments, Held{ID: m.ID, Rec: m.Rec, FD: fd, CtlFD: ctl.take(m.ID)})
		case tConn:
			if fd < 0 {
				continue
			}
			st.Conns = append(st.Conns, Parked{FD: fd, State: m.State})
		case tGo:
			st.NextID, st.Reason, st.Restarts, st.SupervisorPID = m.NextID, m.Reason, m.Restarts, m.PID
			l.batches, l.syncs = m.Batches, m.Syncs
			if m.Tables {
				l.mu.Lock()
				l.tables = true
				l.startTableLocked()
				l.mu.Unlock()
			}
			st.Heal = m.Heal && l.lock != nil && l.epoch != nil
			if st.Heal {
				// From now on a lost supervisor is replaced once Heal is
				// called, not the end of this process.
				l.mu.Lock()
				l.heal = &healing{wake: make(chan struct{}, 1), started: make(chan struct{})}
				l.mu.Unlock()
			}
			if m.GraceUntil > 0 {
				st.GraceUntil = time.Unix(0, m.GraceUntil)
			}
			l.startReading(l.conn)
			return st, nil
		case tStop, tExit:
			closeFD(fd)
			st.close()
			return nil, errors.New("told to stop before serving")
		default:
			closeFD(fd)
		}
	}
}

// pending is a control block received for the segment message that
// must follow it at once.
type pending struct {
	id uint64
	fd int
	ok bool
}

func (p *pending) set(id uint64, fd int) {
	p.drop()
	*p = pending{id: id, fd: fd, ok: fd >= 0}
}

// take returns the control block if it is id's (-1 if none), and drops
// one that is another segment's.
func (p *pending) take(id uint64) int {
	if !p.ok || p.id != id {
		p.drop()
		return -1
	}
	fd := p.fd
	*p = pending{}
	return fd
}

// drop closes a control block that no segment message claimed.
func (p *pending) drop() {
	if p.ok {
		closeFD(p.fd)
	}
	*p = pending{}
}

func (st *Start) close() {
	for _, h := range st.Segments {
		closeFD(h.FD)
		closeFD(h.CtlFD)
	}
	for _, c := range st.Conns {
		closeFD(c.FD)
	}
}

// startReading runs read(c) in a goroutine counted in l.readers.
func (l *Link) startReading(c *wire.Conn) {
	l.readers.Go(func() { l.read(c) })
}

// read delivers commands from the supervisor at the other end of c until
// it goes away; it closes c then, and only it may: a descriptor closed
// under a reader that is between two recvmsg calls can be the number of
// another socket by the next one.
func (l *Link) read(c *wire.Conn) {
	for {
		m, fd, err := recv(c)
		closeFD(fd)
		if err != nil {
			l.mu.Lock()
			l.lostLocked(c, fmt.Errorf("control socket: %w", err))
			l.mu.Unlock()
			c.Close()
			return
		}
		l.mu.Lock()
		switch m.T {
		case tQuiesce:
			l.parked = true
		case tResume:
			l.parked = false
		case tExit, tStop:
			l.ending = true
		}
		h := l.heal
		if m.T == tSynced {
			if ch := l.syncing[m.ID]; ch != nil {
				delete(l.syncing, m.ID)
				close(ch)
			}
		}
		l.mu.Unlock()
		switch m.T {
		case tQuiesce, tResume, tExit, tStop:
			l.cmds <- m.T
		case tAdopted:
			if h != nil {
				h.adopted(l, m.PID)
			}
		}
	}
}

// Sync returns once the supervisor has applied every change journaled
// before it, or after timeout, or at once when there is no supervisor or
// it does not answer syncs. A journal message is never waited for; Sync is
// for what must wait for its effect: the supervisor closing its descriptor
// of memory that was replaced, which frees a GPU allocation for good.
func (l *Link) Sync(timeout time.Duration) {
	l.mu.Lock()
	if l.conn == nil || !l.syncs {
		l.mu.Unlock()
		return
	}
	l.syncID++
	id, ch := l.syncID, make(chan struct{})
	if l.syncing == nil {
		l.syncing = map[uint64]chan struct{}{}
	}
	l.syncing[id] = ch
	err := send(l.conn, msg{T: tSync, ID: id}, -1)
	l.mu.Unlock()
	if err == nil {
		select {
		case <-ch:
		case <-time.After(timeout):
		}
	}
	l.mu.Lock()
	delete(l.syncing, id)
	l.mu.Unlock()
}

// Commands delivers the supervisor's commands: "quiesce" (hand over to a
// successor: Park, send every connection, then Quiesced), "resume" (the
// handover failed: serve again), "exit" (exit now; the successor serves)
// and "stop" (graceful stop).
func (l *Link) Commands() <-chan string { return l.cmds }

// Ready tells the supervisor that the server serves. A supervisor that
// died before is not told: the one started in its place learns it from
// the handover.
func (l *Link) Ready() error {
	err := l.send(msg{T: tReady, PID: os.Getpid()}, -1)
	if errors.Is(err, errNoSupervisor) && l.healing() {
		return nil
	}
	return err
}

func (l *Link) healing() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.heal != nil
}

// SendConn hands one parked connection to the supervisor, for the
// successor. fd stays the caller's.
func (l *Link) SendConn(fd int, state json.RawMessage) error {
	return l.send(msg{T: tConn, State: state}, fd)
}

// Quiesced says every connection has been sent and nothing more will be
// journaled.
func (l *Link) Quiesced() error { return l.send(msg{T: tQuiesced}, -1) }

// Hold has the supervisor keep a reference to memory made ahead (the host
// reserve's pieces, fd) under id, until Unhold(id) or until a serving
// process has replaced this one. A process killed with much memory of its
// own frees it on its way out, and the supervisor reaps it, and starts its
// successor, only once it has: 16 GiB of host reserve made SIGKILL to
// serving again 2.2 to 3.3 s on an H200 machine instead of 0.35 s. Held
// here, the dying process only drops its references, and the supervisor
// frees the memory once the successor serves. Nothing depends on it: with
// no supervisor, or one too old to know "hold" (it closes what it does not
// know), the memory is freed as before.
func (l *Link) Hold(id uint64, fd int) { l.send(msg{T: tHold, ID: id}, fd) }

// Unhold ends Hold(id): the memory has become a segment's (and comes to
// the supervisor with its record), or is being freed.
func (l *Link) Unhold(id uint64) { l.send(msg{T: tUnhold, ID: id}, -1) }

// Put implements segment.Journal. A record that comes without a
// descriptor (an open's, a close's) goes into the record table when there
// is one (table.go). Otherwise a channel's control block goes first, in a
// message of its own (one descriptor a message), then at once the record
// with the data's descriptor: the supervisor gives a control block to the
// put that follows it only, and closes it if anything else comes.
func (l *Link) Put(rec segment.Record, fd, ctlFD int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.seq++
	// A record of a segment on disk goes as a message: the supervisor lets
	// go of the memory it held for it when it applies it (state.go).
	if fd < 0 && ctlFD < 0 && l.table != nil && rec.Tier != segment.OnDisk.String() {
		l.recBuf = rec.AppendJSON(l.recBuf[:0])
		if l.table.put(rec.ID, l.seq, l.recBuf) {
			return
		}
	}
	// Spelled out by hand, as json.Marshal(msg{T: tPut, ID: rec.ID, Rec:
	// ..., Seq: ...}) would.
	b := append(make([]byte, 0, 512), `{"t":"put"`...)
	if rec.ID != 0 {
		b = strconv.AppendUint(append(b, `,"id":`...), rec.ID, 10)
	}
	b = append(rec.AppendJSON(append(b, `,"rec":`...)), `,"seq":`...)
	b = append(strconv.AppendUint(b, l.seq, 10), '}')
	if ctlFD >= 0 {
		l.journalLocked(msg{T: tCtl, ID: rec.ID}, ctlFD)
	}
	l.journalBytesLocked(tPut, rec.ID, b, fd)
}

// startTableLocked makes a record table and sends it to the supervisor;
// without one, records go as messages, as before. l.mu is held.
func (l *Link) startTableLocked() {
	t, err := newLeaseTable()
	if err != nil {
		fmt.Fprintf(os.Stderr, "gpushm: no record table, journaling by message: %v\n", err)
		return
	}
	if l.conn == nil || send(l.conn, msg{T: tTable}, t.fd) != nil {
		t.close()
		return
	}
	l.table = t
}

// Delete implements segment.Journal.
func (l *Link) Delete(id uint64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.table != nil {
		l.table.drop(id)
	}
	l.journalLocked(msg{T: tDel, ID: id}, -1)
}

// Batch implements segment.Journal: one message, which the supervisor
// applies whole. A supervisor too old to know batches gets the changes one
// by one, as it always did.
func (l *Link) Batch(changes []segment.Change) {
	if !l.batches {
		for _, c := range changes {
			if c.Gone {
				l.Delete(c.Record.ID)
			} else {
				l.Put(c.Record, -1, -1)
			}
		}
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.seq++
	m := msg{T: tBatch, Seq: l.seq}
	for _, c := range changes {
		id := c.Record.ID
		if c.Gone {
			if l.table != nil {
				l.table.drop(id)
			}
			m.Batch = append(m.Batch, msg{T: tDel, ID: id})
			continue
		}
		m.Batch = append(m.Batch, msg{T: tPut, ID: id, Rec: c.Record.AppendJSON(nil)})
	}
	l.journalLocked(m, -1)
}

func (l *Link) send(m msg, fd int) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.conn == nil {
		return errNoSupervisor
	}
	return send(l.conn, m, fd)
}
