package supervisor

import (
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm/internal/backend"
	"github.com/gpushm/gpushm/internal/segment"
)

// controlPair is a supervisor and a serving process's Link joined by a
// control socket, as spawn and Attach make them.
func controlPair(t *testing.T, st *State) (*Supervisor, *child, *Link) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	theirs, err := controlConn(fds[0])
	if err != nil {
		t.Fatal(err)
	}
	ours, err := controlConn(fds[1])
	if err != nil {
		t.Fatal(err)
	}
	l := &Link{conn: theirs, cmds: make(chan string, 4), Lost: func(err error) { t.Errorf("lost the supervisor: %v", err) }}
	t.Cleanup(func() {
		// The test's end hangs up under the Link's reader: no loss. The
		// descriptors are closed only once the reader has ended: the next
		// test's sockets may get their numbers, and a reader that reached
		// its next recvmsg late would take that test's messages.
		l.mu.Lock()
		l.Lost = func(error) {}
		l.mu.Unlock()
		theirs.Shutdown()
		ours.Shutdown()
		l.readers.Wait()
		theirs.Close()
		ours.Close()
	})
	s := New(Config{Log: slog.New(slog.NewTextHandler(io.Discard, nil))}, st)
	return s, &child{conn: ours, pid: 1, table: -1}, l
}

// applyQueued applies what the serving process sent so far and returns
// the types of the messages: it sends a marker and reads up to it.
func applyQueued(t *testing.T, s *Supervisor, c *child, l *Link) []string {
	t.Helper()
	if err := l.send(msg{T: tReady}, -1); err != nil {
		t.Fatal(err)
	}
	var got []string
	for {
		m, fd, err := recv(c.conn)
		if err != nil {
			t.Fatal(err)
		}
		if m.T == tReady {
			return got
		}
		got = append(got, m.T)
		s.apply(c, ctl{m, fd})
	}
}

// memfd makes a memfd of size bytes, sealed as the host backend seals.
func memfd(t *testing.T, size int64) int {
	t.Helper()
	fd, err := unix.MemfdCreate("t", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Ftruncate(fd, size); err != nil {
		t.Fatal(err)
	}
	return fd
}

func ino(t *testing.T, fd int) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		t.Fatalf("fstat %d: %v", fd, err)
	}
	return st.Ino
}

// TestHandStatePairsControlBlocks: several channels of different sizes,
// handed to a new serving process, each come back with their own memory
// and their own control block; a control block no segment message
// claims is closed, not given to the next segment.
func TestHandStatePairsControlBlocks(t *testing.T) {
	st := newState()
	type seg struct {
		id        uint64
		size      int64
		data, ctl uint64 // inodes
		channel   bool
	}
	segs := []*seg{{id: 1, size: 16384, channel: true}, {id: 2, size: 131072, channel: true}, {id: 3, size: 8192}, {id: 4, size: 16384, channel: true}}
	for _, sg := range segs {
		fd := memfd(t, sg.size)
		sg.data = ino(t, fd)
		ctl := -1
		if sg.channel {
			ctl = memfd(t, 4096)
			sg.ctl = ino(t, ctl)
		}
		st.put(sg.id, json.RawMessage(fmt.Sprintf(`{"id":%d,"alloc":%d}`, sg.id, sg.size)), fd, ctl)
	}
	s, c, l := controlPair(t, st)
	// A stray control block first, as a confused sender might send.
	stray := memfd(t, 4096)
	if err := send(c.conn, msg{T: tCtl, ID: 3}, stray); err != nil {
		t.Fatal(err)
	}
	unix.Close(stray)
	if err := s.handState(c, nil, "restart"); err != nil {
		t.Fatal(err)
	}
	// After "go" the link reads commands until the socket closes, at the
	// end of the test.
	start, err := l.Receive()
	if err != nil {
		t.Fatal(err)
	}
	defer start.close()
	if len(start.Segments) != len(segs) {
		t.Fatalf("%d segments handed over, want %d", len(start.Segments), len(segs))
	}
	for i, h := range start.Segments {
		sg := segs[i]
		if h.ID != sg.id || ino(t, h.FD) != sg.data {
			t.Fatalf("segment %d came back as %d with another segment's memory", sg.id, h.ID)
		}
		switch {
		case sg.channel && (h.CtlFD < 0 || ino(t, h.CtlFD) != sg.ctl):
			t.Fatalf("channel %d did not get its own control block (fd %d)", sg.id, h.CtlFD)
		case !sg.channel && h.CtlFD >= 0:
			t.Fatalf("segment %d, not a channel, got a control block", sg.id)
		}
	}
	if _, err := unix.FcntlInt(0, unix.F_GETFD, 0); err != nil {
		t.Fatalf("standard input was closed by the handover: %v", err)
	}
}

// TestApplyPairsControlBlocks: the supervisor gives a control block only
// to the put that follows it, for the same segment.
func TestApplyPairsControlBlocks(t *testing.T) {
	st := newState()
	s, c, l := controlPair(t, st)
	host, err := backend.NewHost()
	if err != nil {
		t.Fatal(err)
	}
	data, err := host.Allocate(0, 8192)
	if err != nil {
		t.Fatal(err)
	}
	defer data.Free()
	fd, _ := data.FD()
	ctl := memfd(t, 4096)
	defer unix.Close(ctl)
	// A control block, then a put of another segment: not paired.
	l.send(msg{T: tCtl, ID: 7}, ctl)
	l.Put(segment.Record{ID: 8, Alloc: 8192}, fd, -1)
	// A control block, then its own put: paired.
	l.Put(segment.Record{ID: 9, Alloc: 8192, Slots: 2, SlotBytes: 4096}, fd, ctl)
	applyQueued(t, s, c, l)
	if e := st.entries[8]; e == nil || e.fd < 0 || e.ctl >= 0 {
		t.Fatalf("segment 8: %+v, want memory and no control block", e)
	}
	if e := st.entries[9]; e == nil || e.ctl < 0 || ino(t, e.ctl) != ino(t, ctl) {
		t.Fatalf("segment 9: %+v, want its control block", e)
	}
}

// playSystemd plays systemd on a notify socket of the test's own
// (NOTIFY_SOCKET): it takes what is stored and keeps nothing.
func playSystemd(t *testing.T) {
	t.Helper()
	notify := filepath.Join(t.TempDir(), "notify")
	// Go's network poller, not a bare descriptor: its Close wakes the
	// reader, and the descriptor's number is not given out again while a
	// read is in flight. A bare recvmsg loop, its socket closed between two
	// calls, read the next test's socket (and took its "synced").
	ns, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: notify, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	systemd := make(chan struct{})
	go func() {
		defer close(systemd)
		// Play systemd: take what is stored, keep nothing.
		buf, oob := make([]byte, 4096), make([]byte, unix.CmsgSpace(4*4))
		for {
			_, oobn, _, _, err := ns.ReadMsgUnix(buf, oob)
			if err != nil {
				return
			}
			if cmsgs, err := unix.ParseSocketControlMessage(oob[:oobn]); err == nil {
				for _, c := range cmsgs {
					fds, _ := unix.ParseUnixRights(&c)
					for _, fd := range fds {
						unix.Close(fd)
					}
				}
			}
		}
	}()
	t.Cleanup(func() { ns.Close(); <-systemd })
	t.Setenv("NOTIFY_SOCKET", notify)
}

// TestRenameOverIsOneJournalWrite: a rename over an existing name is one
// control message and one frame of the fd store's journal; every cut of
// that frame replays as the state before the rename, the whole frame as
// the state after, never one in between.
func TestRenameOverIsOneJournalWrite(t *testing.T) {
	playSystemd(t)

	st := newState()
	s, c, l := controlPair(t, st)
	l.batches = true
	listener, epoch := os.NewFile(uintptr(memfd(t, 1)), "listener"), os.NewFile(uintptr(memfd(t, 4096)), "epoch")
	defer listener.Close()
	defer epoch.Close()
	store, err := newFDStore(st, s.log, listener, epoch)
	if err != nil {
		t.Fatal(err)
	}
	st.mirror = store
	defer unix.Close(store.journal)

	host, err := backend.NewHost()
	if err != nil {
		t.Fatal(err)
	}
	reg := segment.New(host, nil)
	reg.SetJournal(l)
	defer func() { reg.Detach(); reg.Close() }()
	// Records as large as they may be: the batch carries two.
	big := func(name string) json.RawMessage {
		return json.RawMessage(fmt.Sprintf(`{"name":%q,"pad":"%0*d"}`, name, 32700, 0))
	}
	for _, name := range []string{"a", "b", "c"} {
		if _, _, err := reg.Create(segment.Root, segment.CreateOptions{Name: name, Size: 4096, Meta: big(name), Open: name == "c"}); err != nil {
			t.Fatal(err)
		}
	}
	if got := applyQueued(t, s, c, l); len(got) != 3 {
		t.Fatalf("creates sent %v", got)
	}
	journal := func() []byte {
		b := make([]byte, store.written)
		if _, err := unix.Pread(store.journal, b, 0); err != nil {
			t.Fatal(err)
		}
		return b
	}
	names := func(b []byte) map[string]string { return journalNames(t, b) }
	for _, tc := range []struct {
		from, to      string
		before, after map[string]string
	}{
		// b nobody has open: freed with the rename.
		{"a", "b", map[string]string{"a": "a", "b": "b", "c": "c"}, map[string]string{"b": "a", "c": "c"}},
		// c open: kept unnamed.
		{"b", "c", map[string]string{"b": "a", "c": "c"}, map[string]string{"c": "a", "unnamed c": "c"}},
	} {
		before := journal()
		if got := names(before); !equalMaps(got, tc.before) {
			t.Fatalf("before rename %s %s: %v, want %v", tc.from, tc.to, got, tc.before)
		}
		if err := reg.Rename(segment.Root, tc.from, tc.to, 0); err != nil {
			t.Fatal(err)
		}
		if got := applyQueued(t, s, c, l); len(got) != 1 || got[0] != tBatch {
			t.Fatalf("rename %s over %s sent %v, want one batch", tc.from, tc.to, got)
		}
		after := journal()
		if got := names(after); !equalMaps(got, tc.after) {
			t.Fatalf("after rename %s %s: %v, want %v", tc.from, tc.to, got, tc.after)
		}
		// Cuts in the frame's header and its last bytes, and a sample
		// between (every cut decodes the whole journal).
		for n := len(before); n < len(after); n = nextCut(n, len(before), len(after)) {
			if got := names(after[:n]); !equalMaps(got, tc.before) {
				t.Fatalf("rename %s %s cut at byte %d of its frame replays as %v, want %v", tc.from, tc.to, n-len(before), got, tc.before)
			}
		}
	}
	// A supervisor too old for batches gets the changes one by one.
	l.batches = false
	reg.Create(segment.Root, segment.CreateOptions{Name: "d", Size: 4096})
	applyQueued(t, s, c, l)
	if err := reg.Rename(segment.Root, "d", "c", 0); err != nil {
		t.Fatal(err)
	}
	if got := applyQueued(t, s, c, l); len(got) != 2 || got[0] != tDel || got[1] != tPut {
		t.Fatalf("rename for an old supervisor sent %v, want [del put]", got)
	}
}

// journalNames replays the journal b: each name it leaves, or "unnamed
// NAME" for a segment kept without one, to the name in its meta.
func journalNames(t *testing.T, b []byte) map[string]string {
	t.Helper()
	recs, _, _ := decodeJournal(b)
	out := map[string]string{}
	for _, rec := range recs {
		var r segment.Record
		if err := json.Unmarshal(rec, &r); err != nil {
			t.Fatal(err)
		}
		var meta struct{ Name string }
		json.Unmarshal(r.Meta, &meta)
		if r.Linked {
			out[r.Name] = meta.Name
		} else {
			out["unnamed "+r.Name] = meta.Name
		}
	}
	return out
}

func nextCut(n, from, to int) int {
	if n-from < 16 || to-n <= 16 {
		return n + 1
	}
	return min(n+997, to-16)
}

func equalMaps(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || w != v {
			return false
		}
	}
	return true
}

// TestSyncWaitsForTheSupervisor: Sync returns only once the supervisor has
// applied what came before it (here: a put that replaces a descriptor,
// closing the old one), and at once without a supervisor that syncs.
func TestSyncWaitsForTheSupervisor(t *testing.T) {
	st := newState()
	s, c, l := controlPair(t, st)
	l.syncs = true
	l.startReading(l.conn)
	old, repl := memfd(t, 4096), memfd(t, 4096)
	rec := json.RawMessage(`{"id":1,"name":"a","linked":true,"size":4096,"alloc":4096}`)
	l.mu.Lock()
	l.journalLocked(msg{T: tPut, ID: 1, Rec: rec}, old)
	l.journalLocked(msg{T: tPut, ID: 1, Rec: rec}, repl)
	l.mu.Unlock()
	unix.Close(old)
	unix.Close(repl)
	applied := make(chan struct{})
	const slow = 200 * time.Millisecond
	// The clock starts before the supervisor's pause: a goroutine may run
	// before the next statement does, and a clock started after its pause
	// began could see the whole wait last less than slow.
	start := time.Now()
	go func() {
		defer close(applied)
		time.Sleep(slow) // a supervisor busy elsewhere
		for range 3 {    // two puts and the sync
			m, fd, err := recv(c.conn)
			if err != nil {
				t.Error(err)
				return
			}
			s.apply(c, ctl{m, fd})
		}
	}()
	done := make(chan struct{})
	go func() { l.Sync(10 * time.Second); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		c.conn.Shutdown()
		<-applied
		t.Fatal("Sync did not return once the supervisor applied it")
	}
	if d := time.Since(start); d < slow {
		t.Fatalf("Sync returned after %s, before the supervisor applied anything", d)
	}
	<-applied
	if n := st.FDs(); n != 1 {
		t.Fatalf("the supervisor holds %d descriptors after the sync, want 1 (the replacement)", n)
	}
	l.mu.Lock()
	l.syncs = false
	l.mu.Unlock()
	start = time.Now()
	l.Sync(10 * time.Second)
	if time.Since(start) > time.Second {
		t.Fatal("Sync waited for a supervisor that does not sync")
	}
}

// TestJournalOfAKilledServingProcess: what a serving process journaled
// before it died is all applied, even when it died with an answer of the
// supervisor's unread (a "synced"), which makes the kernel report a reset
// ahead of the journal messages still queued.
func TestJournalOfAKilledServingProcess(t *testing.T) {
	st := newState()
	s, c, l := controlPair(t, st)
	c.msgs = make(chan ctl, 64)
	mem := memfd(t, 4096)
	defer unix.Close(mem)
	l.mu.Lock()
	l.journalLocked(msg{T: tPut, ID: 1, Rec: json.RawMessage(`{"id":1,"name":"a","linked":true,"size":4096,"alloc":4096}`)}, mem)
	l.journalLocked(msg{T: tPut, ID: 2, Rec: json.RawMessage(`{"id":2,"name":"b","linked":true}`)}, -1)
	l.journalLocked(msg{T: tSync, ID: 1}, -1)
	l.journalLocked(msg{T: tDel, ID: 2}, -1)
	l.journalLocked(msg{T: tPut, ID: 3, Rec: json.RawMessage(`{"id":3,"name":"c","linked":true}`)}, -1)
	l.mu.Unlock()
	// The supervisor applies up to the sync and answers it; the serving
	// process is killed before it reads the answer.
	for range 3 {
		m, fd, err := recv(c.conn)
		if err != nil {
			t.Fatal(err)
		}
		s.apply(c, ctl{m, fd})
	}
	l.conn.Close()
	go s.readChild(c)
	s.drain(c)
	var names []string
	for _, id := range st.ids() {
		var r struct{ Name string }
		json.Unmarshal(st.entries[id].rec, &r)
		names = append(names, r.Name)
	}
	if fmt.Sprint(names) != "[a c]" || st.FDs() != 1 {
		t.Fatalf("the supervisor holds %v (%d descriptors), want [a c] (1)", names, st.FDs())
	}
}

// TestHoldUntilDropped: memory a serving process asks the supervisor to
// hold (Link.Hold) stays held, through its own descriptor, after the
// serving process closes its own; Unhold lets it go; what is still held
// when the serving process ends (drain) is let go of then.
func TestHoldUntilDropped(t *testing.T) {
	s, c, l := controlPair(t, newState())
	a, b := memfd(t, 4096), memfd(t, 8192)
	l.Hold(1, a)
	l.Hold(2, b)
	l.Unhold(2)
	l.Unhold(3) // never held: nothing to do
	if got := applyQueued(t, s, c, l); !slices.Equal(got, []string{tHold, tHold, tUnhold, tUnhold}) {
		t.Fatalf("messages %v", got)
	}
	inoA := ino(t, a)
	unix.Close(a)
	unix.Close(b)
	c.heldMu.Lock()
	fd, ok := c.held[1]
	n := len(c.held)
	c.heldMu.Unlock()
	if !ok || n != 1 {
		t.Fatalf("held %v, want memory 1 alone", c.held)
	}
	if ino(t, fd) != inoA {
		t.Fatal("the held descriptor is not the memory sent")
	}
	c.msgs = make(chan ctl)
	close(c.msgs)
	s.drain(c)
	if c.held != nil {
		t.Fatalf("after drain: %v still held", c.held)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0); err == nil {
		if l, _ := os.Readlink(fmt.Sprintf("/proc/self/fd/%d", fd)); strings.HasPrefix(l, "/memfd:t") {
			t.Fatal("the held descriptor is still open after drain")
		}
	}
}
