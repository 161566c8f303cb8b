package server_test

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm/internal/epoch"
	"github.com/gpushm/gpushm/internal/testdaemon"
	"github.com/gpushm/gpushm/internal/wire"
)

// TestConformance runs the exchanges of docs/protocol.md ("Conformance
// examples") against a real daemon over raw sockets, so that the document
// and the daemon cannot drift apart. The page says how to read a block.
func TestConformance(t *testing.T) {
	doc, err := os.ReadFile("../../docs/protocol.md")
	if err != nil {
		t.Fatal(err)
	}
	blocks, err := parseConformance(string(doc))
	if err != nil {
		t.Fatalf("docs/protocol.md: %v", err)
	}
	if len(blocks) == 0 {
		t.Fatal("docs/protocol.md has no conformance blocks")
	}
	// Every operation of the protocol is exercised (wire.Operations;
	// the page's op row lists the same, which wire's tests check).
	for _, op := range wire.Operations {
		if !slices.ContainsFunc(blocks, func(b *block) bool { return b.ops[op.Name] }) {
			t.Errorf("no conformance example sends op %q", op.Name)
		}
	}
	for _, b := range blocks {
		t.Run(b.title, func(t *testing.T) { b.run(t) })
	}
}

type step struct {
	line int
	kind byte   // '@' connection, '>' send, '<' receive, '!' epoch check
	text string // after the marker, without the descriptor suffix
	// '@': conn name, user, hello
	conn, user string
	hello      bool
	// '>' and '<': descriptors attached or expected
	fds   int
	memfd int64
	// '!': how far the epoch advanced
	advance uint64
}

type block struct {
	title string
	steps []step
	ops   map[string]bool
	users map[string]bool
}

var (
	fdSuffix = regexp.MustCompile(`\s\+(fd(?:\*(\d+))?|memfd:(\d+))$`)
	opField  = regexp.MustCompile(`"op":\s*"([a-z_]+)"`)
)

func parseConformance(doc string) ([]*block, error) {
	var blocks []*block
	var cur *block
	sc := bufio.NewScanner(strings.NewReader(doc))
	sc.Buffer(nil, 1<<20)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		switch {
		case cur == nil && line == "```conformance":
			cur = &block{ops: map[string]bool{}, users: map[string]bool{}}
			continue
		case cur == nil:
			continue
		case line == "```":
			if cur.title == "" || len(cur.steps) == 0 {
				return nil, fmt.Errorf("line %d: a block needs a # title and steps", n)
			}
			blocks = append(blocks, cur)
			cur = nil
			continue
		case strings.HasPrefix(line, "# "):
			if cur.title == "" {
				cur.title = strings.TrimPrefix(line, "# ")
			}
			continue
		case line == "":
			continue
		}
		st := step{line: n, kind: line[0]}
		switch st.kind {
		case '@':
			f := strings.Fields(line[1:])
			if len(f) == 0 {
				return nil, fmt.Errorf("line %d: @ without a connection", n)
			}
			st.conn = f[0]
			for _, w := range f[1:] {
				switch w {
				case "hello":
					st.hello = true
				case "alice", "bob", "root":
					st.user = w
				default:
					return nil, fmt.Errorf("line %d: %q", n, w)
				}
			}
			if st.user != "" {
				cur.users[st.user] = true
			}
		case '>', '<':
			if !strings.HasPrefix(line, string(st.kind)+" ") {
				return nil, fmt.Errorf("line %d: %q", n, line)
			}
			st.text = line[2:]
			if m := fdSuffix.FindStringSubmatchIndex(st.text); m != nil {
				sub := fdSuffix.FindStringSubmatch(st.text)
				st.text = st.text[:m[0]]
				switch {
				case sub[3] != "":
					st.memfd, _ = strconv.ParseInt(sub[3], 10, 64)
				case sub[2] != "":
					st.fds, _ = strconv.Atoi(sub[2])
				default:
					st.fds = 1
				}
			}
			if st.kind == '<' && (st.memfd > 0 || st.fds > 1) {
				return nil, fmt.Errorf("line %d: a reply carries at most one descriptor", n)
			}
			if st.kind == '>' {
				if m := opField.FindStringSubmatch(st.text); m != nil {
					cur.ops[m[1]] = true
				}
			}
		case '!':
			if _, err := fmt.Sscanf(line, "! epoch +%d", &st.advance); err != nil {
				return nil, fmt.Errorf("line %d: %q: want \"! epoch +N\"", n, line)
			}
		default:
			return nil, fmt.Errorf("line %d: %q", n, line)
		}
		if st.kind == '<' && (len(cur.steps) == 0 || cur.steps[len(cur.steps)-1].kind == '@') {
			return nil, fmt.Errorf("line %d: a reply with no request", n)
		}
		if st.kind != '<' && len(cur.steps) > 0 && cur.steps[len(cur.steps)-1].kind == '>' {
			return nil, fmt.Errorf("line %d: the request before has no reply shown", n)
		}
		cur.steps = append(cur.steps, st)
	}
	if cur != nil {
		return nil, errors.New("a conformance block is not closed")
	}
	return blocks, nil
}

// The users of the examples: two unprivileged users (their own uids and
// gids) and root. Running as another user takes root; without it, alice
// is whoever runs the test.
const (
	aliceID = 4242
	bobID   = 4343
)

func (b *block) run(t *testing.T) {
	root := os.Geteuid() == 0
	if !root && (b.users["bob"] || b.users["root"]) {
		t.Skip("runs clients as other users, which needs root")
	}
	ids := map[string]uint32{"alice": aliceID, "bob": bobID, "root": 0}
	if !root {
		ids["alice"] = uint32(os.Geteuid())
	}
	d := testdaemon.Start(t, "host")
	vars := map[string]any{
		"alice": json.Number(strconv.Itoa(int(ids["alice"]))),
		"bob":   json.Number(strconv.Itoa(bobID)),
	}
	conns := map[string]*wire.Conn{}
	var c *wire.Conn
	var sent []byte
	// The epoch page, from the first hello's reply, and its last value
	// checked.
	var page *epoch.Page
	var seen uint64
	keepPage := func(rep map[string]any, fd int) {
		if page != nil || rep["epoch"] != true || fd < 0 {
			return
		}
		p, err := epoch.Map(fd)
		if err != nil {
			t.Fatalf("map the epoch page: %v", err)
		}
		t.Cleanup(func() { p.Close() })
		page, seen = p, p.Load()
	}
	for i, st := range b.steps {
		where := fmt.Sprintf("docs/protocol.md:%d", st.line)
		switch st.kind {
		case '@':
			if c = conns[st.conn]; c != nil {
				if st.user != "" || st.hello {
					t.Fatalf("%s: connection %s is dialed already", where, st.conn)
				}
				continue
			}
			user := st.user
			if user == "" {
				user = "alice"
			}
			c = dialAs(t, d.Socket, ids[user], root)
			conns[st.conn] = c
			if st.hello {
				send(t, where, c, []byte(`{"id":1,"op":"hello","version":1}`), 0, 0)
				if rep, fd := recvReply(t, where, c); fd < 0 || rep["error"] != nil {
					t.Fatalf("%s: hello = %v (descriptor %d)", where, rep, fd)
				} else {
					keepPage(rep, fd)
					unix.Close(fd)
				}
			}
		case '>':
			if c == nil {
				t.Fatalf("%s: no connection (@name) yet", where)
			}
			msg, err := expand(st.text, vars)
			if err != nil {
				t.Fatalf("%s: %v", where, err)
			}
			sent = []byte(msg)
			send(t, where, c, sent, st.fds, st.memfd)
		case '<':
			rep, fd := recvReply(t, where, c)
			if fd >= 0 {
				keepPage(rep, fd)
				unix.Close(fd)
			}
			// Item of every exchange: a reply to a request whose id can be
			// read carries that id, whatever the block expects besides.
			if b.steps[i-1].kind == '>' {
				want, _ := readID(sent)
				if got := rep["id"]; got != json.Number(strconv.FormatUint(want, 10)) {
					t.Errorf("%s: reply id %v to %.100s, want %d", where, got, sent, want)
				}
			}
			want, err := parseExpected(st.text)
			if err != nil {
				t.Fatalf("%s: %v", where, err)
			}
			if err := match("", want, rep, vars); err != nil {
				t.Errorf("%s: %v\n\tsent: %.200s\n\tgot:  %.300s", where, err, sent, mustJSON(rep))
			}
			if got, wantFD := fd >= 0, st.fds > 0; got != wantFD {
				t.Errorf("%s: descriptor came: %v, want %v", where, got, wantFD)
			}
		case '!':
			if page == nil {
				t.Fatalf("%s: no epoch page yet (no hello answered)", where)
			}
			// The replies before came after the changes they report.
			now := page.Load()
			if now-seen != st.advance {
				t.Errorf("%s: the epoch advanced by %d, want %d", where, now-seen, st.advance)
			}
			seen = now
		}
	}
	for name, c := range conns {
		var buf [1]byte
		if n, _, _, _, err := unix.Recvmsg(c.FD(), buf[:], nil, unix.MSG_PEEK|unix.MSG_DONTWAIT); err != unix.EAGAIN {
			t.Errorf("connection %s has a packet nobody expected (%d bytes, %v)", name, n, err)
		}
	}
}

// dialAs connects to the daemon as uid (gid the same). The credentials
// that SO_PEERCRED reports are the connecting thread's, so a thread of
// this process drops to uid to connect and then ends, its credentials
// with it.
func dialAs(t *testing.T, socket string, uid uint32, root bool) *wire.Conn {
	t.Helper()
	type result struct {
		c   *wire.Conn
		err error
	}
	done := make(chan result)
	go func() {
		if !root || uid == 0 {
			c, err := wire.Dial(socket)
			done <- result{c, err}
			return
		}
		// Never unlocked: the thread exits with this goroutine.
		runtime.LockOSThread()
		if _, _, e := unix.RawSyscall(unix.SYS_SETRESGID, uintptr(uid), uintptr(uid), uintptr(uid)); e != 0 {
			done <- result{nil, fmt.Errorf("setresgid: %w", e)}
			return
		}
		if _, _, e := unix.RawSyscall(unix.SYS_SETRESUID, uintptr(uid), uintptr(uid), uintptr(uid)); e != 0 {
			done <- result{nil, fmt.Errorf("setresuid: %w", e)}
			return
		}
		c, err := wire.Dial(socket)
		done <- result{c, err}
	}()
	r := <-done
	if r.err != nil {
		t.Fatalf("dial as uid %d: %v", uid, r.err)
	}
	t.Cleanup(func() { r.c.Close() })
	// A daemon that does not answer fails the test instead of hanging it.
	if err := r.c.SetTimeout(30 * time.Second); err != nil {
		t.Fatal(err)
	}
	return r.c
}

func send(t *testing.T, where string, c *wire.Conn, msg []byte, nfds int, memfd int64) {
	t.Helper()
	var fds []int
	if memfd > 0 {
		fd, err := unix.MemfdCreate("conformance", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
		if err != nil {
			t.Fatal(err)
		}
		if err := unix.Ftruncate(fd, memfd); err != nil {
			t.Fatal(err)
		}
		fds = append(fds, fd)
	}
	for range nfds {
		fd, err := unix.Open("/dev/null", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		fds = append(fds, fd)
	}
	defer func() {
		for _, fd := range fds {
			unix.Close(fd)
		}
	}()
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	if err := unix.Sendmsg(c.FD(), msg, oob, nil, 0); err != nil {
		t.Fatalf("%s: send: %v", where, err)
	}
}

// recvReply reads one packet, decoded with numbers kept as they were sent.
func recvReply(t *testing.T, where string, c *wire.Conn) (map[string]any, int) {
	t.Helper()
	b, fd, err := c.Recv()
	if err != nil {
		t.Fatalf("%s: no reply: %v", where, err)
	}
	var rep map[string]any
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	if err := dec.Decode(&rep); err != nil {
		t.Fatalf("%s: reply %q: %v", where, b, err)
	}
	return rep, fd
}

var (
	repeat   = regexp.MustCompile(`<<(.)\*(\d+)>>`)
	variable = regexp.MustCompile(`\$([A-Za-z_][A-Za-z0-9_]*)`)
)

// expand writes out a request's repetitions and variables.
func expand(s string, vars map[string]any) (string, error) {
	s = repeat.ReplaceAllStringFunc(s, func(m string) string {
		sub := repeat.FindStringSubmatch(m)
		n, _ := strconv.Atoi(sub[2])
		return strings.Repeat(sub[1], n)
	})
	var err error
	s = variable.ReplaceAllStringFunc(s, func(m string) string {
		v, ok := vars[m[1:]]
		if !ok {
			err = fmt.Errorf("%s is not captured yet", m)
			return m
		}
		return mustJSON(v)
	})
	return s, err
}

// parseExpected reads an expected reply; a variable becomes the string
// "$name", which match treats as one.
func parseExpected(s string) (map[string]any, error) {
	s = variable.ReplaceAllString(s, `"$$$1"`)
	var want map[string]any
	dec := json.NewDecoder(strings.NewReader(s))
	dec.UseNumber()
	if err := dec.Decode(&want); err != nil {
		return nil, fmt.Errorf("expected reply %q: %v", s, err)
	}
	return want, nil
}

// match checks got against want as docs/protocol.md says: want's members
// are in got with the same values; null means absent; "*text*" is any
// string containing text; "$name" captures or compares.
func match(path string, want, got any, vars map[string]any) error {
	if s, ok := want.(string); ok {
		switch {
		case strings.HasPrefix(s, "$"):
			if v, bound := vars[s[1:]]; bound {
				want = v
			} else {
				vars[s[1:]] = got
				return nil
			}
		case len(s) >= 2 && strings.HasPrefix(s, "*") && strings.HasSuffix(s, "*"):
			if g, ok := got.(string); !ok || !strings.Contains(g, s[1:len(s)-1]) {
				return fmt.Errorf("%s = %s, want a string containing %q", path, mustJSON(got), s[1:len(s)-1])
			}
			return nil
		}
	}
	switch w := want.(type) {
	case map[string]any:
		g, ok := got.(map[string]any)
		if !ok {
			return fmt.Errorf("%s = %s, want an object", path, mustJSON(got))
		}
		for k, wv := range w {
			gv, present := g[k]
			if wv == nil {
				if present {
					return fmt.Errorf("%s.%s = %s, want it absent", path, k, mustJSON(gv))
				}
				continue
			}
			if !present {
				return fmt.Errorf("%s.%s is absent, want %s", path, k, mustJSON(wv))
			}
			if err := match(path+"."+k, wv, gv, vars); err != nil {
				return err
			}
		}
		return nil
	case []any:
		g, ok := got.([]any)
		if !ok || len(g) != len(w) {
			return fmt.Errorf("%s = %s, want %d elements", path, mustJSON(got), len(w))
		}
		for i := range w {
			if err := match(fmt.Sprintf("%s[%d]", path, i), w[i], g[i], vars); err != nil {
				return err
			}
		}
		return nil
	case json.Number:
		g, ok := got.(json.Number)
		if !ok {
			return fmt.Errorf("%s = %s, want %s", path, mustJSON(got), w)
		}
		wf, err1 := w.Float64()
		gf, err2 := g.Float64()
		if g != w && (err1 != nil || err2 != nil || wf != gf) {
			return fmt.Errorf("%s = %s, want %s", path, g, w)
		}
		return nil
	}
	if want != got {
		return fmt.Errorf("%s = %s, want %s", path, mustJSON(got), mustJSON(want))
	}
	return nil
}

func mustJSON(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Sprint(v)
	}
	return string(b)
}
