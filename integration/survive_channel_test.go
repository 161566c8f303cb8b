package integration

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/testutil"
)

// Channels across crashes, upgrades and a killed supervisor: no message
// lost, none delivered twice.

// chanSpec is one channel of a test stream: NAME:SLOTS:SLOT_BYTES.
type chanSpec struct {
	name      string
	slots     int
	slotBytes int64
}

func (c chanSpec) String() string { return fmt.Sprintf("%s:%d:%d", c.name, c.slots, c.slotBytes) }

func parseChans(s string) ([]chanSpec, error) {
	var out []chanSpec
	for _, f := range strings.Split(s, ",") {
		var c chanSpec
		parts := strings.Split(f, ":")
		if len(parts) != 3 {
			return nil, fmt.Errorf("channel %q: want NAME:SLOTS:SLOT_BYTES", f)
		}
		c.name = parts[0]
		var err1, err2 error
		c.slots, err1 = strconv.Atoi(parts[1])
		c.slotBytes, err2 = strconv.ParseInt(parts[2], 10, 64)
		if err := errors.Join(err1, err2); err != nil {
			return nil, fmt.Errorf("channel %q: %w", f, err)
		}
		out = append(out, c)
	}
	return out, nil
}

func joinChans(cs []chanSpec) string {
	var parts []string
	for _, c := range cs {
		parts = append(parts, c.String())
	}
	return strings.Join(parts, ",")
}

// fillMessage writes message seq of the k-th channel: every 8-byte word
// holds k<<56 | seq, and the bytes after the last whole word hold k. A
// message of another channel, or another message of this one, differs in
// every word.
func fillMessage(b []byte, k int, seq uint64) {
	w := uint64(k)<<56 | seq
	n := len(b) / 8 * 8
	for i := 0; i < n; i += 8 {
		binary.LittleEndian.PutUint64(b[i:], w)
	}
	for i := n; i < len(b); i++ {
		b[i] = byte(k)
	}
}

func checkMessage(b []byte, k int, seq uint64) error {
	w := uint64(k)<<56 | seq
	n := len(b) / 8 * 8
	for i := 0; i < n; i += 8 {
		if got := binary.LittleEndian.Uint64(b[i:]); got != w {
			return fmt.Errorf("message %d: word %d holds %#x (channel %d, message %d), want %#x", seq, i/8, got, got>>56, got&(1<<56-1), w)
		}
	}
	for i := n; i < len(b); i++ {
		if b[i] != byte(k) {
			return fmt.Errorf("message %d: byte %d holds %d, want %d", seq, i, b[i], k)
		}
	}
	return nil
}

// chanEnd is one end of one channel in chansMain; its counts are read by
// the command loop while it runs.
type chanEnd struct {
	spec       chanSpec
	k          int
	mu         sync.Mutex
	first      uint64 // the first message's seq
	next       uint64 // the seq of the message after the last one done
	started    bool
	reconnects int // connections to the daemon made again
	err        error
}

func (e *chanEnd) done(seq uint64) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if !e.started {
		e.first, e.started = seq, true
	}
	e.next = seq + 1
}

func (e *chanEnd) end(err error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.err = err
}

// chansMain is a process holding one end (GPUSHM_TEST_CHANS=tx or rx) of
// each channel in CHANS, each on a connection of its own. A producer
// makes its channel (or opens it) and sends messages until told "stop";
// a consumer receives until EOF, checking that each message has the next
// seq and holds its own bytes (fillMessage). Every so often each makes a
// daemon call, so that a lost connection is made again and its role
// reclaimed on the way. Commands on stdin, one answer line each:
//
//	count  ok NAME=FIRST:NEXT:RECONNECTS ... (the first seq seen, the next
//	       expected, and how many times the connection was made again)
//	stop   (tx) close every channel; then as count
//	wait   (rx) wait for every stream's end; then as count
//
// An answer is "fail ..." once any end failed.
func chansMain(role string) error {
	specs, err := parseChans(os.Getenv("CHANS"))
	if err != nil {
		return err
	}
	sock := os.Getenv("GPUSHM_SOCKET")
	stop := make(chan struct{})
	opened := make(chan error, len(specs))
	var wg sync.WaitGroup
	ends := make([]*chanEnd, len(specs))
	for k, spec := range specs {
		e := &chanEnd{spec: spec, k: k}
		ends[k] = e
		wg.Go(func() { e.end(runChanEnd(sock, role, e, opened, stop)) })
	}
	// Ready once every end holds its role: a consumer started after this
	// producer cannot find the stream ended by the producer before it.
	for range specs {
		if err := <-opened; err != nil {
			return err
		}
	}
	report := func() string {
		var parts []string
		for _, e := range ends {
			e.mu.Lock()
			if e.err != nil {
				err := e.err
				e.mu.Unlock()
				return fmt.Sprintf("fail %s: %v", e.spec.name, err)
			}
			parts = append(parts, fmt.Sprintf("%s=%d:%d:%d", e.spec.name, e.first, e.next, e.reconnects))
			e.mu.Unlock()
		}
		return "ok " + strings.Join(parts, " ")
	}
	fmt.Println("ok ready")
	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		switch sc.Text() {
		case "count":
		case "stop", "wait":
			if sc.Text() == "stop" {
				close(stop)
			}
			wg.Wait()
			fmt.Println(report())
			return nil
		}
		fmt.Println(report())
	}
	return nil
}

func runChanEnd(sock, role string, e *chanEnd, opened chan<- error, stop <-chan struct{}) error {
	ctx := context.Background()
	c, ch, err := openChanEnd(ctx, sock, role, e.spec)
	opened <- err
	if err != nil {
		return err
	}
	defer c.Close()
	for n := 1; ; n++ {
		if n%10 == 0 {
			if _, err := c.Stat(ctx, e.spec.name); err != nil {
				return err
			}
			e.mu.Lock()
			e.reconnects = c.Reconnects()
			e.mu.Unlock()
		}
		if role == "tx" {
			select {
			case <-stop:
				return ch.Close()
			default:
			}
			m, err := ch.Send(ctx, 0)
			if err != nil {
				return fmt.Errorf("send: %w", err)
			}
			fillMessage(m.Bytes(), e.k, m.Seq())
			if err := m.Done(0); err != nil {
				return err
			}
			e.done(m.Seq())
			time.Sleep(time.Millisecond)
			continue
		}
		m, err := ch.Recv(ctx, 0)
		if errors.Is(err, io.EOF) {
			return ch.Close()
		}
		if err != nil {
			return fmt.Errorf("recv: %w", err)
		}
		e.mu.Lock()
		want, started := e.next, e.started
		e.mu.Unlock()
		if started && m.Seq() != want {
			return fmt.Errorf("message %d came after %d", m.Seq(), want-1)
		}
		if err := checkMessage(m.Bytes(), e.k, m.Seq()); err != nil {
			return err
		}
		if err := m.Done(0); err != nil {
			return err
		}
		e.done(m.Seq())
	}
}

func openChanEnd(ctx context.Context, sock, role string, spec chanSpec) (*gpushm.Client, *gpushm.Channel, error) {
	c, err := gpushm.Dial(ctx, sock)
	if err != nil {
		return nil, nil, err
	}
	var ch *gpushm.Channel
	if role == "tx" {
		ch, err = c.Channel(ctx, spec.name, gpushm.Producer, &gpushm.ChannelOptions{Slots: spec.slots, SlotBytes: spec.slotBytes})
	} else {
		ch, err = c.Channel(ctx, spec.name, gpushm.Consumer, nil)
	}
	if err == nil {
		if got := ch.Info().Channel; got.Slots != spec.slots || got.SlotBytes != spec.slotBytes {
			err = fmt.Errorf("opened %d slots of %d bytes, want %s", got.Slots, got.SlotBytes, spec)
		}
	}
	if err != nil {
		c.Close()
		return nil, nil, fmt.Errorf("%s: %w", spec.name, err)
	}
	return c, ch, nil
}

// chanProc is a chansMain process.
type chanProc struct {
	*chaosClient
	role string
}

func startChans(t *testing.T, sock, role string, specs []chanSpec) *chanProc {
	t.Helper()
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), "GPUSHM_TEST_CHANS="+role, "GPUSHM_SOCKET="+sock, "CHANS="+joinChans(specs))
	in, _ := cmd.StdinPipe()
	out, _ := cmd.StdoutPipe()
	p := &chanProc{chaosClient: &chaosClient{cmd: cmd, in: in, out: bufio.NewReader(out), errs: &syncBuffer{}}, role: role}
	cmd.Stderr = p.errs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	if line, err := p.out.ReadString('\n'); strings.TrimSpace(line) != "ok ready" {
		t.Fatalf("%s: %q %v\n%s", role, line, err, p.errs.String())
	}
	return p
}

// endCount is where one end of one channel is.
type endCount struct {
	first, next uint64 // the first message's seq, the next one's
	reconnects  int
}

// counts asks for (or with "stop" and "wait", ends with) every channel's
// count.
func (p *chanProc) counts(t *testing.T, cmd string) map[string]endCount {
	t.Helper()
	line := p.ask(t, 0, cmd)
	out := map[string]endCount{}
	for _, f := range strings.Fields(strings.TrimPrefix(line, "ok")) {
		name, v, _ := strings.Cut(f, "=")
		var c endCount
		if _, err := fmt.Sscanf(v, "%d:%d:%d", &c.first, &c.next, &c.reconnects); err != nil {
			t.Fatalf("%s: %q: %v", p.role, line, err)
		}
		out[name] = c
	}
	return out
}

// progress waits until every channel's end has gone past where it was
// (before; every channel of specs when nil) and, with reconnected, has
// made its connection to the daemon again: it went on through a restart,
// and took its role back.
func (p *chanProc) progress(t *testing.T, specs []chanSpec, before map[string]endCount, reconnected bool) map[string]endCount {
	t.Helper()
	for deadline := time.Now().Add(60 * time.Second); ; {
		now := p.counts(t, "count")
		moved := true
		for _, spec := range specs {
			was, c := before[spec.name], now[spec.name]
			if c.next <= was.next || reconnected && c.reconnects <= was.reconnects {
				moved = false
			}
		}
		if moved {
			return now
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not every channel went on within 60s: %v, before %v", p.role, now, before)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// checkChannels checks that the daemon lists exactly specs, each a
// channel of its own layout and none an orphan; and, with tx and rx, that
// each role is still held by its process: a third process asking for it
// is told who holds it.
func checkChannels(t *testing.T, sock string, specs []chanSpec, tx, rx *chanProc) {
	t.Helper()
	ctx := context.Background()
	c, err := gpushm.Dial(ctx, sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	segs, err := c.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(segs) != len(specs) {
		t.Fatalf("listed %+v, want the channels %v", segs, specs)
	}
	for _, spec := range specs {
		inf, err := c.Stat(ctx, spec.name)
		if err != nil {
			t.Fatalf("stat %s: %v", spec.name, err)
		}
		if inf.Orphan != "" || inf.Channel == nil || inf.Channel.Slots != spec.slots || inf.Channel.SlotBytes != spec.slotBytes ||
			inf.Size != int64(spec.slots)*inf.Channel.SlotStride {
			t.Fatalf("stat %s: %+v (channel %+v), want %s", spec.name, inf, inf.Channel, spec)
		}
		for _, end := range []struct {
			role gpushm.Role
			p    *chanProc
		}{{gpushm.Producer, tx}, {gpushm.Consumer, rx}} {
			if end.p == nil {
				continue
			}
			_, err := c.Channel(ctx, spec.name, end.role, nil)
			if want := fmt.Sprintf("(pid %d)", end.p.cmd.Process.Pid); err == nil || !errors.Is(err, syscall.EBUSY) || !strings.Contains(err.Error(), want) {
				t.Fatalf("%s: taking role %s from another process: %v, want EBUSY naming %s", spec.name, end.role, err, want)
			}
		}
	}
}

// leaveMessages makes each channel of specs and sends it as many
// messages as it has slots, of which it receives one: slots-1 messages
// are left in each, and both ends are closed.
func leaveMessages(t *testing.T, c *gpushm.Client, specs []chanSpec) {
	t.Helper()
	ctx := context.Background()
	for k, spec := range specs {
		tx, err := c.Channel(ctx, spec.name, gpushm.Producer, &gpushm.ChannelOptions{Slots: spec.slots, SlotBytes: spec.slotBytes})
		if err != nil {
			t.Fatal(err)
		}
		rx, err := c.Channel(ctx, spec.name, gpushm.Consumer, nil)
		if err != nil {
			t.Fatal(err)
		}
		for range spec.slots {
			m, err := tx.Send(ctx, 0)
			if err != nil {
				t.Fatal(err)
			}
			fillMessage(m.Bytes(), k, m.Seq())
			m.Done(0)
		}
		m, err := rx.Recv(ctx, 0)
		if err != nil {
			t.Fatal(err)
		}
		m.Done(0)
		if err := errors.Join(rx.Close(), tx.Close()); err != nil {
			t.Fatal(err)
		}
	}
}

// takeLeftMessages receives what leaveMessages left in each channel,
// checking each message's seq and bytes, and then the end of the stream.
func takeLeftMessages(t *testing.T, c *gpushm.Client, specs []chanSpec) {
	t.Helper()
	ctx := context.Background()
	for k, spec := range specs {
		rx, err := c.Channel(ctx, spec.name, gpushm.Consumer, nil)
		if err != nil {
			t.Fatal(err)
		}
		for seq := uint64(1); seq < uint64(spec.slots); seq++ {
			m, err := rx.Recv(ctx, 0)
			if err != nil {
				t.Fatalf("%s: message %d, sent before the restarts: %v", spec.name, seq, err)
			}
			if m.Seq() != seq {
				t.Fatalf("%s: message %d came as %d", spec.name, seq, m.Seq())
			}
			if err := checkMessage(m.Bytes(), k, seq); err != nil {
				t.Fatalf("%s: %v", spec.name, err)
			}
			m.Done(0)
		}
		if _, err := rx.Recv(ctx, 0); !errors.Is(err, io.EOF) {
			t.Fatalf("%s: after the messages of a closed producer: %v, want io.EOF", spec.name, err)
		}
		if err := rx.Close(); err != nil {
			t.Fatal(err)
		}
	}
}

// TestSurviveChannels: several channels of different sizes keep their
// names, memory, control blocks, roles and sequence numbers through
// kill -9 of the serving process and upgrades: first idle, with messages
// waiting in their slots (each channel then maps memory of its own, not
// the newest channel's), then with a producer process and a consumer
// process streaming on all of them at once. Every message is checked,
// every stream ends with EOF after its producer closes, and stopping the
// daemon logs no error.
func TestSurviveChannels(t *testing.T) {
	dir := testutil.SocketDir(t)
	sock := filepath.Join(dir, "gpushm.sock")
	d := Start(t, Options{Socket: sock, Args: []string{"--grace", "30s"}})
	specs := []chanSpec{{"A", 4, 4096}, {"B", 2, 65536}, {"C", 4, 4096}, {"D", 3, 12345}, {"E", 8, 100}}
	ctx := context.Background()

	// Idle: each channel holds slots-1 messages nobody received; both
	// ends closed.
	c, err := gpushm.Dial(ctx, sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	leaveMessages(t, c, specs)
	for _, upgrade := range []bool{false, true, false} {
		d.Restart(t, upgrade)
		checkChannels(t, sock, specs, nil, nil)
	}
	takeLeftMessages(t, c, specs)

	// Streaming: new ends go on where the first ones stopped.
	tx := startChans(t, sock, "tx", specs)
	rx := startChans(t, sock, "rx", specs)
	txAt, rxAt := tx.progress(t, specs, nil, false), rx.progress(t, specs, nil, false)
	for _, spec := range specs {
		if first := rxAt[spec.name].first; first != uint64(spec.slots) {
			t.Fatalf("%s: the second consumer's first message is %d, want %d", spec.name, first, spec.slots)
		}
	}
	for i, upgrade := range []bool{false, true, false, false, true, false} {
		d.Restart(t, upgrade)
		txAt, rxAt = tx.progress(t, specs, txAt, !upgrade), rx.progress(t, specs, rxAt, !upgrade)
		if i%2 == 0 {
			checkChannels(t, sock, specs, tx, rx)
		}
	}
	sent := tx.counts(t, "stop")
	got := rx.counts(t, "wait")
	for _, spec := range specs {
		if s, g := sent[spec.name], got[spec.name]; s.first != g.first || s.next != g.next {
			t.Fatalf("%s: sent messages %d to %d, received %d to %d", spec.name, s.first, s.next-1, g.first, g.next-1)
		}
	}
	for _, p := range []*chanProc{tx, rx} {
		if err := p.cmd.Wait(); err != nil {
			t.Fatalf("%s: %v\n%s", p.role, err, p.errs.String())
		}
	}
	checkChannels(t, sock, specs, nil, nil)
	t.Logf("sent and received %v", got)
	d.Stop(t)
	checkDaemonLog(t, d.log.String())
}

// TestSurviveChannel: one stream, a producer process and a consumer
// process, through 10 kill -9 of the serving process and 3 upgrades: the
// consumer gets every message once, in order, each holding its own
// sequence number in every word, and then EOF after the producer closes.
func TestSurviveChannel(t *testing.T) {
	dir := testutil.SocketDir(t)
	sock := filepath.Join(dir, "gpushm.sock")
	d := Start(t, Options{Socket: sock, Args: []string{"--grace", "30s"}})
	specs := []chanSpec{{"stream", 4, 4096}}
	tx := startChans(t, sock, "tx", specs)
	rx := startChans(t, sock, "rx", specs)
	txAt, rxAt := tx.progress(t, specs, nil, false), rx.progress(t, specs, nil, false)
	kills, upgrades := 0, 0
	for i := range 13 {
		upgrade := i%4 == 3 // 3 upgrades among 10 kills
		d.Restart(t, upgrade)
		if upgrade {
			upgrades++
		} else {
			kills++
		}
		txAt, rxAt = tx.progress(t, specs, txAt, !upgrade), rx.progress(t, specs, rxAt, !upgrade)
	}
	checkChannels(t, sock, specs, tx, rx)
	sent, got := tx.counts(t, "stop")["stream"], rx.counts(t, "wait")["stream"]
	if got.first != 0 || sent.first != 0 || got.next != sent.next {
		t.Fatalf("sent messages %d to %d, received %d to %d", sent.first, sent.next-1, got.first, got.next-1)
	}
	if got.reconnects < kills || sent.reconnects < kills {
		t.Fatalf("connections made again: producer %d, consumer %d; want %d, one a kill", sent.reconnects, got.reconnects, kills)
	}
	for _, p := range []*chanProc{tx, rx} {
		if err := p.cmd.Wait(); err != nil {
			t.Fatalf("%s: %v\n%s", p.role, err, p.errs.String())
		}
	}
	t.Logf("%d kills, %d upgrades: %d messages sent and received", kills, upgrades, got.next)
	d.Stop(t)
	checkDaemonLog(t, d.log.String())
}

// TestSurviveSupervisorChannel: channels of different sizes stream while
// the supervisor and the serving process are killed in turn, and a
// replaced supervisor upgrades once. The new supervisor must hold each
// channel's control block beside its memory, since the serving process it
// starts after the next kill serves the channels from what it holds. A
// supervisor's death makes no end connect again.
func TestSurviveSupervisorChannel(t *testing.T) {
	dir := testutil.SocketDir(t)
	sock := filepath.Join(dir, "gpushm.sock")
	d := Start(t, Options{Socket: sock, Args: []string{"--grace", "30s"}})
	specs := []chanSpec{{"A", 4, 4096}, {"B", 2, 65536}, {"C", 3, 12345}}
	tx := startChans(t, sock, "tx", specs)
	rx := startChans(t, sock, "rx", specs)
	txAt, rxAt := tx.progress(t, specs, nil, false), rx.progress(t, specs, nil, false)
	for i := range 4 {
		d.KillSupervisor(t)
		for _, end := range []struct {
			p  *chanProc
			at *map[string]endCount
		}{{tx, &txAt}, {rx, &rxAt}} {
			now := end.p.progress(t, specs, *end.at, false)
			for _, spec := range specs {
				if was, c := (*end.at)[spec.name], now[spec.name]; c.reconnects != was.reconnects {
					t.Fatalf("%s %s: connected again (%d, was %d) when only the supervisor died", end.p.role, spec.name, c.reconnects, was.reconnects)
				}
			}
			*end.at = now
		}
		checkChannels(t, sock, specs, tx, rx)
		upgrade := i == 2
		d.Restart(t, upgrade)
		txAt, rxAt = tx.progress(t, specs, txAt, !upgrade), rx.progress(t, specs, rxAt, !upgrade)
		checkChannels(t, sock, specs, tx, rx)
	}
	sent, got := tx.counts(t, "stop"), rx.counts(t, "wait")
	for _, spec := range specs {
		if s, g := sent[spec.name], got[spec.name]; s.first != g.first || s.next != g.next {
			t.Fatalf("%s: sent messages %d to %d, received %d to %d", spec.name, s.first, s.next-1, g.first, g.next-1)
		}
	}
	for _, p := range []*chanProc{tx, rx} {
		if err := p.cmd.Wait(); err != nil {
			t.Fatalf("%s: %v\n%s", p.role, err, p.errs.String())
		}
	}
	checkChannels(t, sock, specs, nil, nil)
	t.Logf("sent and received %v", got)
	d.Stop(t)
	checkDaemonLog(t, d.log.String())
}
