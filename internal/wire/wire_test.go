package wire

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"io/fs"
	"math/bits"
	"os"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func TestDecodeRequest(t *testing.T) {
	tests := []struct {
		name string
		in   string
		ok   bool
	}{
		{"hello", `{"id":1,"op":"hello","version":1}`, true},
		{"create", `{"id":2,"op":"create","name":"w","size":4096,"device":0,"mode":384,"meta":{"dtype":"f32"},"exist_ok":true,"open":true}`, true},
		{"missing op", `{"id":1}`, false},
		{"unknown field", `{"id":1,"op":"open","nmae":"x"}`, false},
		{"trailing data", `{"id":1,"op":"open"} {}`, false},
		{"not json", `hello`, false},
		{"empty", ``, false},
		{"array", `[]`, false},
		{"wrong type", `{"id":"1","op":"open"}`, false},
		{"negative id", `{"id":-1,"op":"open"}`, false},
		{"huge meta (the server refuses it)", `{"id":1,"op":"create","meta":"` + strings.Repeat("x", MaxMeta) + `"}`, true},
		{"oversized", `{"id":1,"op":"create","name":"` + strings.Repeat("x", MaxMessage) + `"}`, false},
		{"null name", `{"id":1,"op":"stat","name":null}`, false},
		{"null device", `{"id":1,"op":"create","name":"x","size":1,"device":null}`, false},
		{"null meta is none", `{"id":1,"op":"create","name":"x","size":1,"meta":null}`, true},
		{"a string holding null", `{"id":1,"op":"stat","name":"null"}`, true},
		{"open with size", `{"id":1,"op":"open","name":"x","size":4096}`, false},
		{"stat with mode", `{"id":1,"op":"stat","name":"x","mode":420}`, false},
		{"info with name", `{"id":1,"op":"info","name":"x"}`, false},
		{"list with readonly", `{"id":1,"op":"list","readonly":true}`, false},
		{"hello with name", `{"id":1,"op":"hello","version":1,"name":"x"}`, false},
		{"publish with exist_ok", `{"id":1,"op":"publish","name":"x","size":1,"exist_ok":true}`, false},
		{"unused but zero", `{"id":1,"op":"stat","name":"x","mode":0,"size":0,"readonly":false,"after":""}`, true},
		{"unknown op is not checked", `{"id":1,"op":"explode","name":"x","size":1}`, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := DecodeRequest([]byte(tc.in))
			if tc.ok != (err == nil) {
				t.Fatalf("DecodeRequest(%.60q) = %v, want ok=%v", tc.in, err, tc.ok)
			}
			if err != nil && !errors.Is(err, ErrProto) {
				t.Fatalf("error %v does not wrap ErrProto", err)
			}
		})
	}
}

func TestDecodeRequestNullMeta(t *testing.T) {
	r, err := DecodeRequest([]byte(`{"id":1,"op":"create","name":"x","size":1,"meta":null}`))
	if err != nil || r.Meta != nil {
		t.Fatalf("meta null = %q, %v; want no meta", r.Meta, err)
	}
}

func TestRequestID(t *testing.T) {
	tests := []struct {
		in string
		id uint64
		ok bool
	}{
		{`{"id":7,"op":"info"}`, 7, true},
		{`{"op":"stat","nmae":"x","id":8}`, 8, true},
		{`{"id":9,"op":"stat","name":5}`, 9, true},
		{`{"id":10,"op":"info"} {}`, 10, true},
		{`{"id":11,"op":"info"}garbage`, 11, true},
		{`{"id":12,"id":13,"op":"info"}`, 12, true},
		{`{"id":14,"op":"stat","name":"` + strings.Repeat("y", 2*MaxMessage), 14, true}, // truncated
		{"{\"id\":15,\"name\":\"\xff\"}", 15, true},
		{`{"meta":{"id":1},"id":16}`, 16, true},
		{`{"id":18446744073709551615}`, 1<<64 - 1, true},
		{`{"id":18446744073709551616}`, 0, false},
		{`{"id":"7","op":"info"}`, 0, false},
		{`{"id":-1}`, 0, false},
		{`{"id":7.0}`, 0, false},
		{`{"id":null}`, 0, false},
		{`{"op":"info"}`, 0, false},
		{`{"op":"info",,"id":3}`, 0, false}, // the id is past a syntax error
		{`[{"id":3}]`, 0, false},
		{`not json`, 0, false},
		{``, 0, false},
	}
	for _, tc := range tests {
		id, ok := RequestID([]byte(tc.in))
		if id != tc.id || ok != tc.ok {
			t.Errorf("RequestID(%.60q) = %d, %v; want %d, %v", tc.in, id, ok, tc.id, tc.ok)
		}
	}
}

func TestErrorCodes(t *testing.T) {
	e := &Error{Code: "ENOENT", Message: `open: no such segment: "x"`}
	if !errors.Is(e, fs.ErrNotExist) || !errors.Is(e, syscall.ENOENT) {
		t.Fatalf("%v does not match ENOENT", e)
	}
	if got := Code(&os.PathError{Op: "x", Err: syscall.EEXIST}); got != "EEXIST" {
		t.Fatalf("Code(EEXIST) = %s", got)
	}
	if got := Code(errors.New("plain")); got != "EIO" {
		t.Fatalf("Code(plain) = %s", got)
	}
	if Errno("ENOTACODE") != syscall.EIO {
		t.Fatal("unknown code does not map to EIO")
	}
}

// FuzzDecodeRequest checks that no packet makes the decoder panic and that
// whatever it accepts survives a round trip unchanged.
func FuzzDecodeRequest(f *testing.F) {
	for _, s := range []string{
		`{"id":1,"op":"hello","version":1}`,
		`{"id":2,"op":"create","name":"w","size":4096,"device":0,"mode":384,"meta":{"dtype":"f32","shape":[2,3]},"exist_ok":true,"open":true}`,
		`{"id":3,"op":"open","name":"w","readonly":true}`,
		`{"id":4,"op":"close","segment":7}`,
		`{"id":5,"op":"list","after":"a","limit":10}`,
		`{"id":6,"op":"unlink","name":"\u0000"}`,
		`{"id":1,"op":"create","size":1e99}`,
		`{"id":1,"op":"create","meta":null}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := DecodeRequest(b)
		// The reply id rule: a server answers a packet it refuses with
		// RequestID, so RequestID must read every id that a plain JSON
		// reader finds, and agree with the decoder on what it accepts.
		id, idOK := RequestID(b)
		if want, ok := oracleID(b); ok && (!idOK || id != want) {
			t.Fatalf("RequestID(%q) = %d, %v; a JSON reader finds id %d", b, id, idOK, want)
		}
		if r != nil && id != r.ID { // 0 when not found, as the decoder has it
			t.Fatalf("RequestID(%q) = %d, %v; the decoder read id %d", b, id, idOK, r.ID)
		}
		if err != nil {
			if !errors.Is(err, ErrProto) {
				t.Fatalf("error %v does not wrap ErrProto", err)
			}
			return
		}
		enc, err := Encode(r)
		if err != nil {
			return // re-encoding may grow past the limit (escapes)
		}
		r2, err := DecodeRequest(enc)
		if err != nil {
			t.Fatalf("re-decode of %s: %v", enc, err)
		}
		if !reflect.DeepEqual(normalize(r), normalize(r2)) {
			t.Fatalf("round trip changed %+v into %+v", r, r2)
		}
	})
}

// oracleID reads a packet's first top-level "id" member with
// encoding/json's tokenizer, as far as the packet's JSON goes: the id a
// client that sent b would wait for.
func oracleID(b []byte) (uint64, bool) {
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
		name, _ := tok.(string)
		if name != "id" {
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
		n, isNum := v.(json.Number)
		if !isNum {
			return 0, false
		}
		id, err := strconv.ParseUint(string(n), 10, 64)
		return id, err == nil
	}
	return 0, false
}

// normalize compacts Meta and escapes it for HTML, as json.Marshal does.
func normalize(r *Request) Request {
	c := *r
	if len(c.Meta) > 0 {
		var buf, esc bytes.Buffer
		json.Compact(&buf, c.Meta)
		json.HTMLEscape(&esc, buf.Bytes()) // as json.Marshal writes it
		c.Meta = esc.Bytes()
	}
	return c
}

func FuzzDecodeReply(f *testing.F) {
	f.Add([]byte(`{"id":2,"segment":{"id":1,"name":"w","size":1,"alloc_size":4096,"device":0,"handle_type":"memfd","uid":0,"gid":0,"mode":384,"opens":1,"created":1},"fd":true}`))
	f.Add([]byte(`{"id":3,"error":{"code":"ENOENT","message":"no"}}`))
	f.Add([]byte(`{"id":4,"segments":[],"next":"x"}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		if _, err := DecodeReply(b); err != nil && !errors.Is(err, ErrProto) {
			t.Fatalf("error %v does not wrap ErrProto", err)
		}
	})
}

func socketPair(t *testing.T) (*Conn, *Conn) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	conns := make([]*Conn, 2)
	for i, fd := range fds {
		c, err := NewConn(fd)
		if err != nil {
			t.Fatal(err)
		}
		conns[i] = c
		t.Cleanup(func() { c.Close() })
	}
	return conns[0], conns[1]
}

func TestConnPassesDescriptors(t *testing.T) {
	a, b := socketPair(t)
	fd, err := unix.MemfdCreate("t", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	unix.Write(fd, []byte("payload"))
	if err := a.Send([]byte(`{"id":1}`), fd); err != nil {
		t.Fatal(err)
	}
	msg, got, err := b.Recv()
	if err != nil || string(msg) != `{"id":1}` || got < 0 {
		t.Fatalf("Recv = %q, %d, %v", msg, got, err)
	}
	defer unix.Close(got)
	buf := make([]byte, 7)
	if n, err := unix.Pread(got, buf, 0); err != nil || string(buf[:n]) != "payload" {
		t.Fatalf("received fd reads %q, %v", buf[:n], err)
	}
}

func TestConnRejectsOversizedAndExtraFDs(t *testing.T) {
	a, b := socketPair(t)
	// Raw writes, since Send would happily send these.
	raw := func(p []byte, oob []byte) {
		if err := unix.Sendmsg(a.fd, p, oob, nil, 0); err != nil {
			t.Fatal(err)
		}
	}
	raw(bytes.Repeat([]byte("x"), MaxMessage+100), nil)
	if _, _, err := b.Recv(); !errors.Is(err, ErrProto) {
		t.Fatalf("oversized Recv = %v, want ErrProto", err)
	}
	r1, w1, _ := os.Pipe()
	defer r1.Close()
	defer w1.Close()
	raw([]byte("{}"), unix.UnixRights(int(r1.Fd()), int(w1.Fd())))
	if _, fd, err := b.Recv(); !errors.Is(err, ErrProto) || fd != -1 {
		t.Fatalf("two-fd Recv = %d, %v, want ErrProto", fd, err)
	}
	// More descriptors than Recv has room for: a protocol error too, not
	// a shortage of descriptors.
	var many []int
	for range 6 {
		many = append(many, int(r1.Fd()))
	}
	raw([]byte(`{"id":9}`), unix.UnixRights(many...))
	if msg, fd, err := b.Recv(); !errors.Is(err, ErrProto) || errors.Is(err, ErrFDDropped) || fd != -1 || string(msg) != `{"id":9}` {
		t.Fatalf("six-fd Recv = %q, %d, %v, want the packet and ErrProto", msg, fd, err)
	}
	// The connection survives them all.
	a.Send([]byte("ok"), -1)
	if msg, _, err := b.Recv(); err != nil || string(msg) != "ok" {
		t.Fatalf("Recv after bad packets = %q, %v", msg, err)
	}
}

// TestConnDrain: a peer that closes while a message to it is unread makes
// the kernel report a reset ahead of what it had sent. Recv ends the
// connection there, unless SetDrain: then every message the peer sent is
// read, and EOF comes after them, with a spin, a wake descriptor or
// neither.
func TestConnDrain(t *testing.T) {
	for _, tc := range []struct {
		name  string
		drain bool
		setup func(t *testing.T, c *Conn)
	}{
		{"default", false, func(*testing.T, *Conn) {}},
		{"drain", true, func(*testing.T, *Conn) {}},
		{"drain with spin", true, func(_ *testing.T, c *Conn) { c.SetSpin(time.Millisecond) }},
		{"drain with wake", true, func(t *testing.T, c *Conn) {
			efd, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { unix.Close(efd) })
			c.SetWake(efd)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, b := socketPair(t)
			b.SetDrain(tc.drain)
			tc.setup(t, b)
			for i := range 3 {
				if err := a.Send([]byte(strconv.Itoa(i)), -1); err != nil {
					t.Fatal(err)
				}
			}
			if err := b.Send([]byte("never read"), -1); err != nil {
				t.Fatal(err)
			}
			a.Close()
			var got []string
			for {
				msg, _, err := b.Recv()
				if errors.Is(err, io.EOF) {
					break
				}
				if err != nil {
					t.Fatal(err)
				}
				got = append(got, string(msg))
			}
			want := []string{"0", "1", "2"}
			if !tc.drain {
				want = nil
			}
			if !slices.Equal(got, want) {
				t.Fatalf("read %q before EOF, want %q", got, want)
			}
		})
	}
}

func TestConnTimeout(t *testing.T) {
	a, b := socketPair(t)
	if err := b.SetTimeout(50 * time.Millisecond); err != nil {
		t.Fatal(err)
	}
	if _, _, err := b.Recv(); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("Recv with nothing sent = %v, want a timeout", err)
	}
	// The connection still works after a timeout.
	if err := a.Send([]byte("late"), -1); err != nil {
		t.Fatal(err)
	}
	if msg, _, err := b.Recv(); err != nil || string(msg) != "late" {
		t.Fatalf("Recv after a timeout = %q, %v", msg, err)
	}
	// A peer that reads nothing fills the socket; Send then times out.
	var err error
	for range 100000 {
		if err = b.Send(make([]byte, 4096), -1); err != nil {
			break
		}
	}
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("Send to a peer that reads nothing = %v, want a timeout", err)
	}
}

func TestDialTimeout(t *testing.T) {
	path := t.TempDir() + "/s.sock"
	ln, err := unix.Socket(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(ln)
	if err := unix.Bind(ln, &unix.SockaddrUnix{Name: path}); err != nil {
		t.Fatal(err)
	}
	// A listener that accepts nothing: its backlog fills, and connect
	// then waits.
	if err := unix.Listen(ln, 0); err != nil {
		t.Fatal(err)
	}
	var err2 error
	for range 4 {
		var c *Conn
		if c, err2 = DialTimeout(path, 100*time.Millisecond); err2 != nil {
			break
		}
		defer c.Close()
	}
	if !errors.Is(err2, os.ErrDeadlineExceeded) {
		t.Fatalf("DialTimeout to a full backlog = %v, want a timeout", err2)
	}
}

// TestEveryFieldIsChecked keeps the unused-field rule whole as fields are
// added: each of Request's fields but id and op has a bit, set when it
// holds something, and at least one operation that uses it.
func TestEveryFieldIsChecked(t *testing.T) {
	var all uint64
	for _, fields := range usedFields() {
		all |= fields
	}
	rt := reflect.TypeFor[Request]()
	n := 0
	for i := range rt.NumField() {
		name, _, _ := strings.Cut(rt.Field(i).Tag.Get("json"), ",")
		if name == "id" || name == "op" || name == "-" {
			continue
		}
		n++
		var r Request
		v := reflect.ValueOf(&r).Elem().Field(i)
		switch v.Kind() {
		case reflect.Pointer:
			v.Set(reflect.New(v.Type().Elem()))
			v.Elem().Set(reflect.ValueOf(1).Convert(v.Type().Elem()))
		case reflect.Slice:
			v.SetBytes([]byte(`{}`))
		case reflect.String:
			v.SetString("x")
		case reflect.Bool:
			v.SetBool(true)
		default:
			v.Set(reflect.ValueOf(1).Convert(v.Type()))
		}
		got := setFields(&r)
		if bits.OnesCount64(got) != 1 || fieldNames[bits.TrailingZeros64(got)] != name {
			t.Errorf("with %s set, setFields = %#b", name, got)
		}
		if got&all == 0 {
			t.Errorf("no operation uses %s", name)
		}
	}
	if n != fieldCount {
		t.Errorf("Request has %d fields beyond id and op, fieldNames %d", n, fieldCount)
	}
}

// BenchmarkDecodeRequest decodes a typical open, as the server does on
// every round trip.
func BenchmarkDecodeRequest(b *testing.B) {
	msg := []byte(`{"id":12345,"op":"open","name":"weights-shard-07","readonly":true}`)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := DecodeRequest(msg); err != nil {
			b.Fatal(err)
		}
	}
}

func TestConnWakeAndWouldBlock(t *testing.T) {
	a, b := socketPair(t)
	// A readable wake descriptor ends a wait without consuming a message;
	// the buffer can go back to the pool in between.
	ev, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(ev)
	b.SetWake(-1, ev) // a negative descriptor is never readable
	go func() {
		time.Sleep(10 * time.Millisecond)
		unix.Write(ev, []byte{1, 0, 0, 0, 0, 0, 0, 0})
	}()
	if _, _, err := b.Recv(); !errors.Is(err, ErrWoken) {
		t.Fatalf("Recv with the wake descriptor readable = %v, want ErrWoken", err)
	}
	b.ReleaseBuffer()
	b.SetWake()
	if err := a.Send([]byte(`{"id":1}`), -1); err != nil {
		t.Fatal(err)
	}
	if msg, _, err := b.Recv(); err != nil || string(msg) != `{"id":1}` {
		t.Fatalf("Recv after the wake = %q, %v", msg, err)
	}

	// A peer that does not read: TrySend refuses rather than waits, and
	// the packet it refused is not half sent.
	n := 0
	for ; n < 1<<16; n++ {
		err := a.TrySend([]byte(`{"id":2}`), -1)
		if errors.Is(err, ErrWouldBlock) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	if n == 1<<16 {
		t.Fatal("TrySend never found the peer's queue full")
	}
	for i := range n {
		if msg, _, err := b.Recv(); err != nil || string(msg) != `{"id":2}` {
			t.Fatalf("packet %d of %d: %q, %v", i, n, msg, err)
		}
	}
	if err := a.TrySend([]byte(`{"id":3}`), -1); err != nil {
		t.Fatalf("TrySend once the peer read: %v", err)
	}
	if msg, _, err := b.Recv(); err != nil || string(msg) != `{"id":3}` {
		t.Fatalf("last packet: %q, %v", msg, err)
	}
}

// TestConnBatch: a reader that batches reads a burst in order, with its
// descriptors, waiting before it reads on after a read that slept; its
// timeout and the peer's hang-up end a wait as without batching.
func TestConnBatch(t *testing.T) {
	a, b := socketPair(t)
	b.SetBatch(20 * time.Millisecond)
	if err := b.SetTimeout(2 * time.Second); err != nil {
		t.Fatal(err)
	}
	go func() {
		time.Sleep(10 * time.Millisecond)
		a.Send([]byte("first"), -1)
	}()
	if msg, _, err := b.Recv(); err != nil || string(msg) != "first" {
		t.Fatalf("first: %q, %v", msg, err)
	}
	f, err := os.Open("/dev/null")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for i := range 5 {
		if err := a.Send([]byte{byte('0' + i)}, int(f.Fd())); err != nil {
			t.Fatal(err)
		}
	}
	start := time.Now()
	for i := range 5 {
		msg, fd, err := b.Recv()
		if err != nil || string(msg) != string(rune('0'+i)) || fd < 0 {
			t.Fatalf("message %d: %q, fd %d, %v", i, msg, fd, err)
		}
		unix.Close(fd)
		if i == 0 && time.Since(start) < 15*time.Millisecond {
			t.Fatalf("the read after one that slept came after %v, before the batch's 20ms", time.Since(start))
		}
	}
	if err := b.SetTimeout(50 * time.Millisecond); err != nil {
		t.Fatal(err)
	}
	if _, _, err := b.Recv(); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("Recv with nothing sent = %v, want a deadline error", err)
	}
	a.Send([]byte("last"), -1)
	a.Close()
	if msg, _, err := b.Recv(); err != nil || string(msg) != "last" {
		t.Fatalf("last: %q, %v", msg, err)
	}
	if _, _, err := b.Recv(); !errors.Is(err, io.EOF) {
		t.Fatalf("Recv after the peer closed = %v, want EOF", err)
	}
}

// Poll reads a message that comes within its time, and otherwise says so
// after that time without consuming anything; Recv then waits as before.
func TestConnPoll(t *testing.T) {
	a, b := socketPair(t)
	const d = 20 * time.Millisecond
	start := time.Now()
	if msg, fd, err := b.Poll(d); !errors.Is(err, ErrNothing) || msg != nil || fd != -1 {
		t.Fatalf("Poll with nothing sent = %q, %d, %v; want ErrNothing", msg, fd, err)
	}
	if el := time.Since(start); el < d {
		t.Fatalf("Poll gave up after %s, before its %s", el, d)
	}
	if _, _, err := b.Poll(0); !errors.Is(err, ErrNothing) {
		t.Fatalf("Poll(0) with nothing sent: %v; want ErrNothing", err)
	}
	a.Send([]byte("one"), -1)
	if msg, _, err := b.Poll(d); err != nil || string(msg) != "one" {
		t.Fatalf("Poll with a message sent = %q, %v", msg, err)
	}
	go func() {
		time.Sleep(2 * d)
		a.Send([]byte("two"), -1)
	}()
	if msg, _, err := b.Recv(); err != nil || string(msg) != "two" {
		t.Fatalf("Recv after a Poll = %q, %v", msg, err)
	}
}
