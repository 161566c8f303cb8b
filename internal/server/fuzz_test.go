package server_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"strconv"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/testdaemon"
	"github.com/gpushm/gpushm/internal/wire"
)

// FuzzReplyID sends arbitrary packets to a real daemon and checks the rule
// that lets a client match every reply (docs/protocol.md, "Replies"): each
// packet gets exactly one reply (two for a channel's descriptor), carrying
// the packet's id whenever a plain JSON reader finds one in it, or 0; and
// the connection survives. The seed corpus, in testdata/fuzz/FuzzReplyID,
// runs with every `go test`.
func FuzzReplyID(f *testing.F) {
	for _, s := range []string{
		`{"id":1,"op":"hello","version":1}`,
		`{"id":2,"op":"create","name":"f","size":4096,"open":true}`,
		`{"id":3,"op":"stat","nmae":"f"}`,
		`{"id":4,"op":"stat","name":null}`,
		`{"id":5,"op":"info"} {}`,
		`{"id":6,"op":"open","name":"f","size":4096}`,
		`{"id":7,"op":"create","name":"c","slots":2,"slot_bytes":64,"open":true,"role":"tx"}`,
		`{"op":"info","id":8,"op":"list"}`,
		`{"id":9,"op":"publish","name":"p","size":1}`,
		`{"id":10,"op":"explode"}`,
	} {
		f.Add([]byte(s), uint8(0))
	}
	f.Add([]byte(`{"id":11,"op":"info"}`), uint8(2))
	f.Add([]byte(`{"id":12,"op":"info"}`), uint8(7))

	d := testdaemon.Start(f, "host")
	// Whatever the fuzzer makes, it makes in a megabyte.
	d.Server.Registry().SetLimits(segment.Limits{DeviceBytes: map[int]int64{0: 1 << 20}})
	c, err := wire.Dial(d.Socket)
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { c.Close() })
	// A daemon that does not answer fails the run instead of hanging it.
	if err := c.SetTimeout(30 * time.Second); err != nil {
		f.Fatal(err)
	}
	if err := c.Send([]byte(`{"id":1,"op":"hello","version":1}`), -1); err != nil {
		f.Fatal(err)
	}
	if _, fd, err := c.Recv(); err != nil || fd < 0 {
		f.Fatalf("hello: %v", err)
	}
	devNull, err := unix.Open("/dev/null", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { unix.Close(devNull) })

	f.Fuzz(func(t *testing.T, b []byte, fds uint8) {
		if len(b) > 2*wire.MaxMessage || len(b) == 0 && fds%8 == 0 {
			// The kernel refuses packets larger than the socket holds, and
			// an empty packet reads as a hang-up.
			return
		}
		var rights []byte
		if n := int(fds % 8); n > 0 {
			all := make([]int, n)
			for i := range all {
				all[i] = devNull
			}
			rights = unix.UnixRights(all...)
		}
		if err := unix.Sendmsg(c.FD(), b, rights, nil, 0); err != nil {
			if errors.Is(err, unix.EMSGSIZE) {
				return
			}
			t.Fatalf("send: %v", err)
		}
		rb, fd, err := c.Recv()
		if err != nil {
			t.Fatalf("no reply to %q (%d descriptors): %v", b, fds%8, err)
		}
		if fd >= 0 {
			unix.Close(fd)
		}
		rep, err := wire.DecodeReply(rb)
		if err != nil {
			t.Fatalf("reply %q: %v", rb, err)
		}
		// Where a plain reader finds the id, the reply has it; where it
		// finds none (the daemon's reader goes a little further, past a
		// number that garbage follows, say), the reply has 0 or an id
		// that the packet spells.
		want, ok := readID(b)
		switch {
		case ok && rep.ID != want:
			t.Fatalf("reply to %q has id %d, want %d: %s", b, rep.ID, want, rb)
		case !ok && rep.ID != 0 && !bytes.Contains(b, []byte(strconv.FormatUint(rep.ID, 10))):
			t.Fatalf("reply to %q has id %d, which it does not hold: %s", b, rep.ID, rb)
		}
		if rep.Control {
			rb, fd, err := c.Recv()
			if err != nil || fd < 0 {
				t.Fatalf("the control block did not follow the reply to %q: %v", b, err)
			}
			unix.Close(fd)
			if second, err := wire.DecodeReply(rb); err != nil || second.ID != rep.ID || !second.ControlFD {
				t.Fatalf("second packet %q after %q", rb, b)
			}
		}
	})
}

// readID is the id a client that sent b waits for: the first top-level
// "id" member, read with encoding/json as far as b's JSON goes, if it is a
// uint64; else 0. It shares no code with the daemon's reader.
func readID(b []byte) (uint64, bool) {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return 0, false
	}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return 0, false
		}
		if name, _ := tok.(string); name != "id" {
			var skip json.RawMessage
			if err := dec.Decode(&skip); err != nil {
				return 0, false
			}
			continue
		}
		v, err := dec.Token()
		if err != nil {
			return 0, false
		}
		n, ok := v.(json.Number)
		if !ok {
			return 0, false
		}
		id, err := strconv.ParseUint(string(n), 10, 64)
		return id, err == nil
	}
	return 0, false
}
