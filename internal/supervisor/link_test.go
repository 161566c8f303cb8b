package supervisor

import (
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm/internal/backend"
	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/wire"
)

// controlPair is a supervisor and a serving process's Link joined by a
// control socket, as spawn and Attach make them.
func controlPair(t *testing.T, st *State) (*Supervisor, *child, *Link) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	theirs, err := wire.NewConn(fds[0])
	if err != nil {
		t.Fatal(err)
	}
	ours, err := wire.NewConn(fds[1])
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { theirs.Close(); ours.Close() })
	l := &Link{conn: theirs, cmds: make(chan string, 4), Lost: func(err error) { t.Errorf("lost the supervisor: %v", err) }}
	s := New(Config{Log: slog.New(slog.NewTextHandler(io.Discard, nil))}, st)
	return s, &child{conn: ours, pid: 1}, l
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
	l.Lost = func(error) {}
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
