package supervisor

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm/internal/wire"
)

// Config is what the supervisor needs to run serving processes.
type Config struct {
	// Exe is the path of the binary to run as the serving process; it is
	// read again at every start, so an upgrade runs what is on disk now.
	Exe string
	// Args are its arguments (those of 'gpushm daemon').
	Args []string
	// Listener and Epoch are the listening socket and the epoch page,
	// held here so that they outlive every serving process.
	Listener *os.File
	Epoch    *os.File
	// Grace is how long clients have to reclaim their leases after a
	// serving process died.
	Grace time.Duration
	// Store mirrors everything into systemd's file descriptor store
	// (NOTIFY_SOCKET), so that a restart of the whole service loses
	// nothing either.
	Store bool
	Log   *slog.Logger
	// Lock is the daemon lock (server.Lock), passed to every serving
	// process so that it stays held while either process lives; Heal lets
	// a serving process start a new supervisor if this one dies (heal.go):
	// not under systemd, which restarts the service itself.
	Lock *os.File
	Heal bool
	// Handover, if set, is a serving process whose supervisor died: Run
	// adopts it (handover.go) instead of starting one.
	Handover *Handover
}

// Supervisor holds every segment's descriptor and runs the serving
// process, restarting it when it dies and replacing it on SIGHUP.
type Supervisor struct {
	cfg      Config
	log      *slog.Logger
	st       *State
	store    *fdStore
	cur      *child
	restarts int
	grace    time.Time // end of the current grace period, if any
	notified bool      // READY=1 sent
	quick    int       // consecutive deaths within a second of starting
}

// child is one serving process and our end of its control socket.
type child struct {
	cmd     *exec.Cmd
	conn    *wire.Conn
	msgs    chan ctl      // control messages, closed at EOF
	exited  chan struct{} // closed once the process has been reaped
	err     error         // its exit status, once exited
	started time.Time
	pid     int
	ready   bool    // it said it serves
	ctl     pending // a control block received, for the put that follows it
	// An adopted serving process is not our child (cmd is nil): it is
	// watched and killed through its pidfd (handover.go).
	pidfd *pidfd
	// held is the memory made ahead that it asked us to hold (Link.Hold),
	// by id: freed once its successor serves, or it ends otherwise.
	heldMu sync.Mutex
	held   map[uint64]int
	// table is its record table's memfd (table.go), -1 until it sends one.
	table int
}

func (c *child) hold(id uint64, fd int) {
	c.heldMu.Lock()
	defer c.heldMu.Unlock()
	if c.held == nil {
		c.held = make(map[uint64]int)
	}
	if old, ok := c.held[id]; ok {
		closeFD(old)
	}
	c.held[id] = fd
}

func (c *child) unhold(id uint64) {
	c.heldMu.Lock()
	defer c.heldMu.Unlock()
	if fd, ok := c.held[id]; ok {
		closeFD(fd)
		delete(c.held, id)
	}
}

// dropHeld frees what c had us hold: for a reserve of many GiB, a second
// or more of this process's time, never on the way to serving again.
func (c *child) dropHeld() {
	c.heldMu.Lock()
	held := c.held
	c.held = nil
	c.heldMu.Unlock()
	for _, fd := range held {
		closeFD(fd)
	}
}

type ctl struct {
	m  msg
	fd int
}

// New makes a supervisor with the state st (empty, or handed back by
// systemd; see LoadStore).
func New(cfg Config, st *State) *Supervisor {
	if st == nil {
		st = newState()
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	return &Supervisor{cfg: cfg, log: cfg.Log, st: st}
}

// StartError means the first serving process exited before it served: a
// bad flag or an unusable backend, which restarting would not cure. The
// serving process has said why on its standard error.
type StartError struct {
	// Code is the serving process's exit status (1 if it had none).
	Code int
	Err  error
}

func (e *StartError) Error() string {
	return fmt.Sprintf("the serving process exited before serving: %v", e.Err)
}

// Run starts the serving process and supervises it until ctx is done or
// SIGTERM or SIGINT arrives; then it stops the serving process, releases
// every segment (unless systemd's fd store keeps them) and returns nil.
// SIGHUP replaces the serving process with the binary now on disk.
func (s *Supervisor) Run(ctx context.Context) error {
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGHUP, syscall.SIGTERM, syscall.SIGINT)
	defer signal.Stop(sigs)
	if s.cfg.Store {
		st, err := newFDStore(s.st, s.log, s.cfg.Listener, s.cfg.Epoch)
		if err != nil {
			return err
		}
		s.store = st
		s.st.mirror = st
	}
	if s.st.Len() > 0 {
		// Segments handed back by systemd: clients of the last service
		// may still hold leases.
		s.grace = time.Now().Add(s.cfg.Grace)
	}
	start := s.startFirst
	if s.cfg.Handover != nil {
		start = s.adopt
	}
	if err := start(ctx); err != nil {
		s.release()
		return err
	}
	for {
		select {
		case <-ctx.Done():
			return s.stop()
		case sig := <-sigs:
			switch sig {
			case syscall.SIGHUP:
				s.upgrade(ctx)
			default:
				s.log.Info("stopping", "signal", sig.String())
				return s.stop()
			}
		case c, ok := <-s.cur.msgs:
			if ok {
				s.apply(s.cur, c)
				continue
			}
			if err := s.restart(ctx); err != nil {
				s.release()
				return err
			}
		}
	}
}

// startFirst starts the first serving process and waits until it serves.
func (s *Supervisor) startFirst(ctx context.Context) error {
	c, err := s.spawn()
	if err != nil {
		return err
	}
	reason := "start"
	if !s.grace.IsZero() {
		reason = "restart"
	}
	if err := s.handState(c, nil, reason); err != nil {
		return s.failStart(c, err)
	}
	if err := s.waitReady(ctx, c, nil); err != nil {
		return s.failStart(c, err)
	}
	s.cur = c
	s.serving(c)
	return nil
}

func (s *Supervisor) failStart(c *child, err error) error {
	c.kill()
	<-c.exited
	s.drain(c)
	code := 1
	var ee *exec.ExitError
	if errors.As(c.err, &ee) && ee.ExitCode() > 0 {
		code = ee.ExitCode()
	}
	return &StartError{Code: code, Err: err}
}

// serving notes that c serves: systemd hears READY=1.
func (s *Supervisor) serving(c *child) {
	s.log.Info("serving process ready", "pid", c.pid, "segments", s.st.Len(), "restarts", s.restarts)
	state := fmt.Sprintf("READY=1\nSTATUS=serving %d segments (serving process %d)", s.st.Len(), c.pid)
	if !s.notified {
		state += "\nMAINPID=" + strconv.Itoa(os.Getpid())
		s.notified = true
	}
	notify(state)
}

// restart replaces a serving process that died. The messages it sent
// before dying are all applied first: what it acknowledged is held.
func (s *Supervisor) restart(ctx context.Context) error {
	old := s.cur
	<-old.exited
	old.ctl.drop()
	// Every message it sent is applied (Run read them all); what it wrote
	// into its record table comes next, before its successor gets the state.
	s.endTable(old)
	ran := time.Since(old.started)
	s.log.Error("serving process died; restarting it", "pid", old.pid, "status", errString(old.err), "ran", ran.Round(time.Millisecond))
	s.restarts++
	// Back off only when serving processes die before they serve, again
	// and again (a crash at start); one killed while serving comes back at
	// once.
	if !old.ready {
		s.quick++
	} else {
		s.quick = 0
	}
	delay := time.Duration(0)
	if s.quick > 1 {
		delay = min(100*time.Millisecond<<min(s.quick-2, 6), 5*time.Second)
	}
	for {
		if delay > 0 {
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(delay):
			}
		}
		c, err := s.spawn()
		if err == nil {
			// The grace period runs from when the successor starts, so that
			// a slow start does not eat it.
			s.grace = time.Now().Add(s.cfg.Grace)
			if err = s.handState(c, nil, "restart"); err == nil {
				err = s.waitReady(ctx, c, nil)
			}
			if err == nil {
				s.cur = c
				s.serving(c)
				// Its memory made ahead, held so that its death did not
				// free it (Link.Hold), is freed now, off the way back.
				go old.dropHeld()
				return nil
			}
			c.kill()
			<-c.exited
			s.drain(c)
		}
		s.log.Error("restart failed; trying again", "err", err)
		delay = min(max(2*delay, 100*time.Millisecond), 5*time.Second)
		if ctx.Err() != nil {
			return nil
		}
	}
}

// upgrade starts the binary on disk as a new serving process and hands it
// the state and the connections of the current one. A new process that
// fails before it takes over is stopped, and the current one goes on.
func (s *Supervisor) upgrade(ctx context.Context) {
	s.log.Info("upgrade: starting a new serving process", "exe", s.cfg.Exe)
	notify("RELOADING=1\nMONOTONIC_USEC=" + strconv.FormatInt(monotonicUsec(), 10))
	defer func() {
		notify(fmt.Sprintf("READY=1\nSTATUS=serving %d segments (serving process %d)", s.st.Len(), s.cur.pid))
	}()
	old := s.cur
	n, err := s.spawn()
	if err != nil {
		s.log.Error("upgrade failed: still serving the old binary", "err", err)
		return
	}
	abort := func(why error) {
		s.log.Error("upgrade failed: still serving the old binary", "err", why)
		n.kill()
		<-n.exited
		s.drain(n)
	}
	// 1. The new process brings its backend up while the old one serves.
	if err := s.await(ctx, n, old, tInit, time.Minute); err != nil {
		abort(err)
		return
	}
	// 2. The old one parks its connections and stops journaling.
	var conns []Parked
	if err := send(old.conn, msg{T: tQuiesce}, -1); err != nil {
		abort(fmt.Errorf("quiesce: %w", err))
		return
	}
	resume := func(why error) {
		for _, p := range conns {
			closeFD(p.FD)
		}
		send(old.conn, msg{T: tResume}, -1)
		abort(why)
	}
	deadline := time.After(30 * time.Second)
	for quiesced := false; !quiesced; {
		select {
		case c, ok := <-old.msgs:
			if !ok {
				// The old one died while parking; the new one takes over
				// as after a crash.
				s.log.Error("serving process died during the upgrade", "pid", old.pid)
				old.ctl.drop()
				for _, p := range conns {
					closeFD(p.FD)
				}
				conns = nil
				s.grace = time.Now().Add(s.cfg.Grace)
				quiesced = true
				continue
			}
			switch c.m.T {
			case tConn:
				conns = append(conns, Parked{FD: c.fd, State: c.m.State})
			case tQuiesced:
				quiesced = true
			default:
				s.apply(old, c)
			}
		case <-n.exited:
			resume(fmt.Errorf("the new process exited: %s", errString(n.err)))
			return
		case <-deadline:
			resume(errors.New("the old process did not hand over within 30s"))
			return
		}
	}
	// 3. The new one gets everything, and serves. The old one journals
	// no more (or is dead): its record table has its last records.
	s.mergeTable(old)
	err = s.handState(n, conns, "upgrade")
	for _, p := range conns {
		closeFD(p.FD) // the kernel gave the new process its own
	}
	if err == nil {
		err = s.waitReady(ctx, n, old)
	}
	if err != nil {
		conns = nil
		resume(err)
		return
	}
	send(old.conn, msg{T: tExit}, -1)
	// Its table was merged before the handover; the new one's records are
	// newer, whatever the old table's numbers say.
	closeFD(old.table)
	old.table = -1
	s.cur = n
	go func() {
		// The old process exits by itself; make sure of it.
		select {
		case <-old.exited:
		case <-time.After(10 * time.Second):
			old.kill()
		}
	}()
	go s.drain(old)
	s.log.Info("upgrade done", "old_pid", old.pid, "pid", n.pid)
	s.serving(n)
}

// await waits for message type t from c, applying what the other serving
// process (other, may be nil) journals meanwhile.
func (s *Supervisor) await(ctx context.Context, c, other *child, t string, limit time.Duration) error {
	deadline := time.After(limit)
	var otherMsgs chan ctl
	if other != nil {
		otherMsgs = other.msgs
	}
	for {
		select {
		case m, ok := <-c.msgs:
			if !ok {
				<-c.exited
				return fmt.Errorf("the serving process exited (%s) before it was %s", errString(c.err), t)
			}
			if m.m.T == t {
				if t == tReady {
					c.ready = true
				}
				return nil
			}
			s.apply(c, m)
		case m, ok := <-otherMsgs:
			if !ok {
				otherMsgs = nil
				continue
			}
			s.apply(other, m)
		case <-deadline:
			return fmt.Errorf("no %q from the serving process within %s", t, limit)
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

func (s *Supervisor) waitReady(ctx context.Context, c, other *child) error {
	return s.await(ctx, c, other, tReady, 5*time.Minute)
}

// apply acts on one message from a serving process.
func (s *Supervisor) apply(c *child, m ctl) {
	if m.m.T != tPut && c.ctl.ok {
		// Link.Put sends the control block and its record back to back;
		// a serving process that died between the two leaves a control
		// block of a change it never acknowledged.
		s.log.Warn("a channel's control block came without its record; closed", "pid", c.pid, "id", c.ctl.id)
		c.ctl.drop()
	}
	switch m.m.T {
	case tCtl:
		c.ctl.set(m.m.ID, m.fd)
	case tPut:
		ctl := c.ctl.take(m.m.ID)
		if m.m.ID == 0 || !isObject(m.m.Rec) {
			s.log.Error("serving process sent a bad record; ignored", "pid", c.pid, "id", m.m.ID)
			closeFD(m.fd)
			closeFD(ctl)
			return
		}
		s.st.put(m.m.ID, m.m.Rec, m.fd, ctl)
		s.st.seen(m.m.ID, m.m.Seq)
	case tDel:
		closeFD(m.fd)
		s.st.del(m.m.ID)
	case tBatch:
		closeFD(m.fd)
		ops, err := batchOps(m.m.Batch)
		if err != nil {
			s.log.Error("serving process sent a bad batch; ignored", "pid", c.pid, "err", err)
			return
		}
		s.st.batch(ops)
		for _, op := range ops {
			s.st.seen(op.ID, m.m.Seq)
		}
	case tConn:
		// Only during an upgrade; a stray one is closed.
		closeFD(m.fd)
	case tSync:
		// Everything this process sent before is applied.
		closeFD(m.fd)
		send(c.conn, msg{T: tSynced, ID: m.m.ID}, -1)
	case tHold:
		if m.fd < 0 {
			return
		}
		c.hold(m.m.ID, m.fd)
	case tUnhold:
		closeFD(m.fd)
		c.unhold(m.m.ID)
	case tTable:
		if m.fd >= 0 {
			closeFD(c.table)
			c.table = m.fd
		}
	default:
		closeFD(m.fd)
	}
}

// drain applies what a dead serving process left in its socket.
func (s *Supervisor) drain(c *child) {
	for m := range c.msgs {
		s.apply(c, m)
	}
	c.ctl.drop()
	s.endTable(c)
	c.dropHeld()
}

// endTable merges c's record table and lets it go: c is gone.
func (s *Supervisor) endTable(c *child) {
	s.mergeTable(c)
	closeFD(c.table)
	c.table = -1
}

// mergeTable takes into the state the records c wrote into its record
// table that are newer than what its messages said (table.go). c writes
// no more: it is gone, or parked for an upgrade.
func (s *Supervisor) mergeTable(c *child) {
	if c.table < 0 {
		return
	}
	recs, err := readTable(c.table)
	if err != nil {
		s.log.Error("cannot read the serving process's record table; its last leases may be missing", "pid", c.pid, "err", err)
		return
	}
	if n := s.st.merge(recs); n > 0 {
		s.log.Debug("records from the table", "pid", c.pid, "records", n)
	}
}

// handState sends c the state, the parked connections and "go".
func (s *Supervisor) handState(c *child, conns []Parked, reason string) error {
	// c numbers its records from 1: whatever it writes is newer than
	// what the state holds.
	s.st.resetSeqs()
	for _, id := range s.st.ids() {
		e := s.st.entries[id]
		if e.ctl >= 0 {
			if err := send(c.conn, msg{T: tCtl, ID: id}, e.ctl); err != nil {
				return fmt.Errorf("hand over segment %d's control block: %w", id, err)
			}
		}
		if err := send(c.conn, msg{T: tSeg, ID: id, Rec: e.rec}, e.fd); err != nil {
			return fmt.Errorf("hand over segment %d: %w", id, err)
		}
	}
	for _, p := range conns {
		if err := send(c.conn, msg{T: tConn, State: p.State}, p.FD); err != nil {
			return fmt.Errorf("hand over a connection: %w", err)
		}
	}
	g := msg{T: tGo, NextID: s.st.nextID, Reason: reason, Restarts: s.restarts, PID: os.Getpid(), Batches: true, Syncs: true,
		Heal: s.cfg.Heal && s.cfg.Lock != nil,
		// Under systemd's fd store every record goes by message: the store
		// keeps a copy of each as it comes, for when both processes die,
		// and a record table dies with them.
		Tables: s.store == nil}
	if time.Now().Before(s.grace) {
		g.GraceUntil = s.grace.UnixNano()
	}
	return send(c.conn, g, -1)
}

// stop ends the serving process gracefully and releases what is held:
// every segment is freed, unless systemd's fd store keeps them (then
// whether they survive is the unit's FileDescriptorStorePreserve=).
func (s *Supervisor) stop() error {
	notify("STOPPING=1")
	c := s.cur
	if err := send(c.conn, msg{T: tStop}, -1); err != nil {
		c.kill()
	}
	// Changes the serving process acknowledged before it stopped are
	// applied, not dropped: under systemd's fd store they outlive the stop
	// (an 'rm' just before a restart must stay done).
	drained := make(chan struct{})
	go func() {
		s.drain(c)
		close(drained)
	}()
	select {
	case <-c.exited:
	case <-time.After(30 * time.Second):
		s.log.Error("serving process ignored the stop for 30s; killing it", "pid", c.pid)
		c.kill()
		<-c.exited
	}
	<-drained
	s.release()
	if c.err != nil && !errors.Is(c.err, errStatusUnknown) {
		return fmt.Errorf("serving process: %w", c.err)
	}
	s.log.Info("stopped")
	return nil
}

func (s *Supervisor) release() {
	if s.store != nil {
		s.log.Info("segments stay in systemd's fd store: 'systemctl stop' frees them unless FileDescriptorStorePreserve=yes", "segments", s.st.Len())
	}
	s.st.release()
}

// spawn starts a serving process with a fresh control socket.
func (s *Supervisor) spawn() (*child, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("control socket: %w", err)
	}
	ours, err := controlConn(fds[0])
	if err != nil {
		unix.Close(fds[0])
		unix.Close(fds[1])
		return nil, err
	}
	theirs := os.NewFile(uintptr(fds[1]), "control")
	defer theirs.Close()
	cmd := exec.Command(s.cfg.Exe, s.cfg.Args...)
	cmd.Args[0] = ServingName // name.go
	cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
	cmd.ExtraFiles = []*os.File{theirs, s.cfg.Listener, s.cfg.Epoch}
	cmd.Env = append(childEnv(), envLink+"="+strconv.Itoa(fdControl))
	if s.cfg.Lock != nil {
		cmd.ExtraFiles = append(cmd.ExtraFiles, s.cfg.Lock)
		cmd.Env = append(cmd.Env, envLock+"="+strconv.Itoa(fdLock))
	}
	// Its own process group: a terminal's ^C reaches the supervisor only,
	// which stops the serving process in order.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		ours.Close()
		return nil, fmt.Errorf("start serving process %s: %w", s.cfg.Exe, err)
	}
	c := &child{cmd: cmd, conn: ours, msgs: make(chan ctl, 64), exited: make(chan struct{}), table: -1,
		started: time.Now(), pid: cmd.Process.Pid}
	go s.readChild(c)
	go func() {
		c.err = cmd.Wait()
		// The control socket may outlive the process in a grandchild it
		// leaked; end it so the reader sees EOF.
		ours.Shutdown()
		close(c.exited)
	}()
	return c, nil
}

// journalBatch is how long the supervisor lets a serving process's
// messages gather after it woke for one. Every open and close journals its
// segment's record; waking this process for each cost the serving process
// most of its part of an open on a 2-core VM (15 us of 24). Nothing here
// waits on a message being read at once: queued messages (and their
// descriptors) are the socket's until read, and are all read after the
// sender dies (drain); Sync waits at most this much longer.
const journalBatch = time.Millisecond

// readChild delivers c's control messages until its socket ends.
func (s *Supervisor) readChild(c *child) {
	defer close(c.msgs)
	c.conn.SetBatch(journalBatch)
	for {
		m, fd, err := recv(c.conn)
		if err != nil {
			if !errors.Is(err, wire.ErrProto) {
				return
			}
			s.log.Error("bad control message", "pid", c.pid, "err", err)
			continue
		}
		c.msgs <- ctl{m, fd}
	}
}

func (c *child) kill() {
	if c.pidfd != nil {
		c.pidfd.kill()
		return
	}
	c.cmd.Process.Kill()
}

// childEnv is this process's environment without what belongs to it alone:
// the serving process must not talk to systemd or take its descriptors.
func childEnv() []string {
	var out []string
	for _, kv := range os.Environ() {
		switch k, _, _ := cutEnv(kv); k {
		case "NOTIFY_SOCKET", "LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES", "FDSTORE", envLink, envLock, envAdopt:
			continue
		}
		out = append(out, kv)
	}
	return out
}

func cutEnv(kv string) (string, string, bool) {
	for i := 0; i < len(kv); i++ {
		if kv[i] == '=' {
			return kv[:i], kv[i+1:], true
		}
	}
	return kv, "", false
}

func errString(err error) string {
	if err == nil {
		return "exit 0"
	}
	return err.Error()
}

func monotonicUsec() int64 {
	var ts unix.Timespec
	unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	return ts.Nano() / 1000
}
