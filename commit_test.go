package gpushm_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/testdaemon"
	"github.com/gpushm/gpushm/internal/testutil"
	"github.com/gpushm/gpushm/internal/wire"
)

// wantCode checks that rep failed with code.
func wantCode(t *testing.T, what string, rep *wire.Reply, code string) {
	t.Helper()
	if rep.Error == nil || rep.Error.Code != code {
		t.Fatalf("%s = %+v, want %s", what, rep.Error, code)
	}
}

func readAll(t *testing.T, seg *gpushm.Segment) []byte {
	t.Helper()
	m, err := seg.Map()
	if err != nil {
		t.Fatal(err)
	}
	b := make([]byte, seg.Size())
	if _, err := m.ReadAt(b, 0); err != nil {
		t.Fatal(err)
	}
	return b
}

func TestUncommitted(t *testing.T) {
	d := testdaemon.Start(t, "host")
	ctx := context.Background()
	w, r := dial(t, d.Socket), dial(t, d.Socket)
	data := pattern(7, 1<<20+5)

	seg, err := w.Create(ctx, "model", int64(len(data)), &gpushm.CreateOptions{Uncommitted: true, Mode: ptr(uint32(0o644))})
	if err != nil {
		t.Fatal(err)
	}
	if !seg.Info().Uncommitted {
		t.Fatalf("created uncommitted, info says %+v", seg.Info())
	}
	// Listed and stat'ed as uncommitted; not openable, by name or by the
	// FUSE-like paths; its name is taken.
	if st, err := r.Stat(ctx, "model"); err != nil || !st.Uncommitted {
		t.Fatalf("Stat = %+v, %v; want uncommitted", st, err)
	}
	if l, err := r.List(ctx); err != nil || len(l) != 1 || !l[0].Uncommitted {
		t.Fatalf("List = %+v, %v", l, err)
	}
	if _, err := r.Open(ctx, "model", &gpushm.OpenOptions{ReadOnly: true}); !errors.Is(err, syscall.EAGAIN) {
		t.Fatalf("Open of an uncommitted segment = %v, want EAGAIN", err)
	}
	if _, err := r.Create(ctx, "model", 4096, nil); !errors.Is(err, syscall.EEXIST) {
		t.Fatalf("Create over an uncommitted segment = %v, want EEXIST", err)
	}
	if _, err := r.Create(ctx, "model", int64(len(data)), &gpushm.CreateOptions{ExistOK: true}); !errors.Is(err, syscall.EAGAIN) {
		t.Fatalf("Create exist_ok of an uncommitted segment = %v, want EAGAIN", err)
	}
	if err := w.Rename(ctx, "model", "other"); !errors.Is(err, syscall.EBUSY) {
		t.Fatalf("Rename of an uncommitted segment = %v, want EBUSY", err)
	}
	raw := testutil.DialRaw(t, d.Socket)
	raw.Hello()
	wantCode(t, "commit by another client", raw.Do(fmt.Sprintf(`{"op":"commit","segment":%d}`, seg.ID())), "EPERM")
	wantCode(t, "reclaim by another client", raw.Do(fmt.Sprintf(`{"op":"reclaim","segment":%d,"readonly":true}`, seg.ID())), "EAGAIN")

	// A reader waiting for it gets it once it is committed, whole.
	got := make(chan error, 1)
	go func() {
		rs, err := r.Open(ctx, "model", &gpushm.OpenOptions{ReadOnly: true, Wait: time.Minute})
		if err == nil {
			if b := readAll(t, rs); !bytes.Equal(b, data) {
				err = errors.New("the waiting reader got other bytes")
			}
			rs.Close()
		}
		got <- err
	}()
	m, err := seg.Map()
	if err != nil {
		t.Fatal(err)
	}
	half := len(data) / 2
	if _, err := m.WriteAt(data[:half], 0); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-got:
		t.Fatalf("the reader returned before the commit: %v", err)
	default:
	}
	if _, err := m.WriteAt(data[half:], int64(half)); err != nil {
		t.Fatal(err)
	}
	if err := seg.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-got; err != nil {
		t.Fatal(err)
	}
	if st, err := r.Stat(ctx, "model"); err != nil || st.Uncommitted {
		t.Fatalf("Stat after commit = %+v, %v", st, err)
	}
	if err := seg.Commit(ctx); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("second Commit = %v, want EINVAL", err)
	}
	wantCode(t, "commit of a committed segment by another", raw.Do(fmt.Sprintf(`{"op":"commit","segment":%d}`, seg.ID())), "EINVAL")
	wantCode(t, "commit of no segment", raw.Do(`{"op":"commit","segment":999999}`), "ENOENT")
	// The creator's own reopen is served from its cache after the commit.
	again, err := w.Open(ctx, "model", nil)
	if err != nil || again.ID() != seg.ID() {
		t.Fatalf("creator's Open after commit = %v, %v", again, err)
	}
	again.Close()
	// Committed, it outlives its creator like any segment.
	seg.Close()
	w.Close()
	if _, err := r.Stat(ctx, "model"); err != nil {
		t.Fatalf("a committed segment went with its creator: %v", err)
	}
	if err := r.Unlink(ctx, "model"); err != nil {
		t.Fatal(err)
	}
	if u := usage(t, r); u.Segments != 0 {
		t.Fatalf("left behind: %+v", u)
	}
}

func ptr[T any](v T) *T { return &v }

func TestUncommittedEnds(t *testing.T) {
	d := testdaemon.Start(t, "host")
	ctx := context.Background()
	r := dial(t, d.Socket)

	// Closed before the commit: gone, and a reader waiting for it is told.
	w := dial(t, d.Socket)
	seg, err := w.Create(ctx, "a", 4096, &gpushm.CreateOptions{Uncommitted: true})
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan error, 1)
	go func() {
		_, err := r.Open(ctx, "a", &gpushm.OpenOptions{Wait: time.Minute})
		got <- err
	}()
	waitWaiting(t, d, 1)
	seg.Close()
	if err := <-got; !errors.Is(err, syscall.ENOENT) {
		t.Fatalf("Open waiting for a writer that gave up = %v, want ENOENT", err)
	}
	waitGone(t, r, "a", 10*time.Second)

	// The writer's connection ends (a crash, as far as the daemon sees).
	_, err = w.Create(ctx, "b", 4096, &gpushm.CreateOptions{Uncommitted: true})
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		_, err := r.Open(ctx, "b", &gpushm.OpenOptions{Wait: time.Minute})
		got <- err
	}()
	waitWaiting(t, d, 1)
	w.Close()
	if err := <-got; !errors.Is(err, syscall.ENOENT) {
		t.Fatalf("Open waiting for a writer that died = %v, want ENOENT", err)
	}
	waitGone(t, r, "b", 10*time.Second)

	// A writer killed with SIGKILL, in another process.
	cmd := child(t, d.Socket, "uncommitted", "NAME=c")
	out, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	if b := make([]byte, 6); func() bool { n, _ := out.Read(b); return string(b[:n]) != "ready\n" }() {
		t.Fatal("child did not get ready")
	}
	if _, err := r.Open(ctx, "c", nil); !errors.Is(err, syscall.EAGAIN) {
		t.Fatalf("Open of the child's uncommitted segment = %v, want EAGAIN", err)
	}
	cmd.Process.Signal(syscall.SIGKILL)
	cmd.Wait()
	waitGone(t, r, "c", 10*time.Second)
	if u := usage(t, r); u.Segments != 0 {
		t.Fatalf("left behind: %+v", u)
	}

	// A reader killed while it waits: its wait ends with it.
	cmd = child(t, d.Socket, "wait-read", "NAME=never", "SEED=1")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	waitWaiting(t, d, 1)
	cmd.Process.Signal(syscall.SIGKILL)
	cmd.Wait()
	deadline := time.Now().Add(30 * time.Second)
	for d.Server.Waiting() != 0 {
		if time.Now().After(deadline) {
			t.Fatal("the wait of a killed reader goes on")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// waitWaiting waits until n opens wait for a commit in the daemon.
func waitWaiting(t *testing.T, d *testdaemon.Daemon, n int) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for d.Server.Waiting() < n {
		if time.Now().After(deadline) {
			t.Fatalf("%d opens waiting for a commit, want %d", d.Server.Waiting(), n)
		}
		time.Sleep(time.Millisecond)
	}
}

func TestUncommittedBadInput(t *testing.T) {
	d := testdaemon.Start(t, "host")
	ctx := context.Background()
	c := dial(t, d.Socket)
	raw := testutil.DialRaw(t, d.Socket)
	raw.Hello()

	for _, tc := range []struct{ name, req, code string }{
		{"negative wait", `{"op":"open","name":"x","wait":-1}`, "EINVAL"},
		{"wait over an hour", `{"op":"open","name":"x","wait":3601}`, "EINVAL"},
		{"huge wait", `{"op":"open","name":"x","wait":1e300}`, "EINVAL"},
		{"wait as a string", `{"op":"open","name":"x","wait":"1"}`, "EPROTO"},
		{"uncommitted without open", `{"op":"create","name":"x","size":4096,"uncommitted":true}`, "EINVAL"},
		{"uncommitted with exist_ok", `{"op":"create","name":"x","size":4096,"open":true,"exist_ok":true,"uncommitted":true}`, "EINVAL"},
		{"uncommitted channel", `{"op":"create","name":"x","slots":2,"slot_bytes":64,"open":true,"uncommitted":true}`, "EINVAL"},
		{"commit of nothing", `{"op":"commit"}`, "ENOENT"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			wantCode(t, tc.req, raw.Do(tc.req), tc.code)
		})
	}
	if _, _, err := c.CreateOnly(ctx, "x", 4096, &gpushm.CreateOptions{Uncommitted: true}); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("CreateOnly uncommitted = %v, want EINVAL", err)
	}
	if _, err := c.Stat(ctx, "x"); !errors.Is(err, syscall.ENOENT) {
		t.Fatalf("a refused create left %q: %v", "x", err)
	}

	// A wait that runs out, on a name that never comes and on one that is
	// never committed.
	start := time.Now()
	if _, err := c.Open(ctx, "never", &gpushm.OpenOptions{Wait: 300 * time.Millisecond}); !errors.Is(err, syscall.ETIMEDOUT) {
		t.Fatalf("Open with a wait for nothing = %v, want ETIMEDOUT", err)
	}
	if d := time.Since(start); d < 300*time.Millisecond {
		t.Fatalf("the wait ended after %s, before its 300ms", d)
	}
	w := dial(t, d.Socket)
	seg, err := w.Create(ctx, "slow", 4096, &gpushm.CreateOptions{Uncommitted: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Open(ctx, "slow", &gpushm.OpenOptions{Wait: 200 * time.Millisecond}); !errors.Is(err, syscall.ETIMEDOUT) {
		t.Fatalf("Open with a wait for an uncommitted segment = %v, want ETIMEDOUT", err)
	}
	// The client is still usable after a wait that ran out.
	if _, err := c.Stat(ctx, "slow"); err != nil {
		t.Fatal(err)
	}

	// Removed before the commit: ENOENT; the name taken by another
	// segment meanwhile: EEXIST. Either way nothing is named by it.
	if err := c.Unlink(ctx, "slow"); err != nil {
		t.Fatal(err)
	}
	if err := seg.Commit(ctx); !errors.Is(err, syscall.ENOENT) {
		t.Fatalf("Commit of a removed segment = %v, want ENOENT", err)
	}
	other, err := c.Create(ctx, "slow", 4096, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := seg.Commit(ctx); !errors.Is(err, syscall.EEXIST) {
		t.Fatalf("Commit of a segment whose name is taken = %v, want EEXIST", err)
	}
	if st, err := c.Stat(ctx, "slow"); err != nil || st.ID != other.ID() {
		t.Fatalf("Stat(slow) = %+v, %v; want the other segment %d", st, err, other.ID())
	}
	seg.Close()
	other.Close()
	if err := c.Unlink(ctx, "slow"); err != nil {
		t.Fatal(err)
	}
	if u := usage(t, c); u.Segments != 0 {
		t.Fatalf("left behind: %+v", u)
	}
}

// TestWaitingReaders starts reader processes before the writer: each
// opens with a wait, and each gets the whole segment once it is committed.
func TestWaitingReaders(t *testing.T) {
	d := testdaemon.Start(t, "host")
	const readers = 4
	var cmds []*exec.Cmd
	var outs []*bytes.Buffer
	for range readers {
		cmd := child(t, d.Socket, "wait-read", "NAME=weights", "SEED=11")
		var out bytes.Buffer
		cmd.Stdout = &out
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cmd.Process.Kill() })
		cmds, outs = append(cmds, cmd), append(outs, &out)
	}
	waitWaiting(t, d, readers)
	ctx := context.Background()
	w := dial(t, d.Socket)
	data := pattern(11, 3<<20+1)
	seg, err := w.Create(ctx, "weights", int64(len(data)), &gpushm.CreateOptions{Uncommitted: true, Mode: ptr(uint32(0o644))})
	if err != nil {
		t.Fatal(err)
	}
	m, err := seg.Map()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m.WriteAt(data, 0); err != nil {
		t.Fatal(err)
	}
	if err := seg.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	for k, cmd := range cmds {
		if err := cmd.Wait(); err != nil {
			t.Fatalf("reader %d: %v", k, err)
		}
		if got := outs[k].String(); got != "ok\n" {
			t.Fatalf("reader %d said %q", k, got)
		}
	}
}

// waitReadChild opens NAME with a wait and checks it holds pattern SEED.
func waitReadChild(ctx context.Context, c *gpushm.Client) error {
	seg, err := c.Open(ctx, os.Getenv("NAME"), &gpushm.OpenOptions{ReadOnly: true, Wait: 5 * time.Minute})
	if err != nil {
		return err
	}
	defer seg.Close()
	m, err := seg.Map()
	if err != nil {
		return err
	}
	var seed uint64
	json.Unmarshal([]byte(os.Getenv("SEED")), &seed)
	got := make([]byte, m.Size())
	if _, err := m.ReadAt(got, 0); err != nil {
		return err
	}
	if !bytes.Equal(got, pattern(seed, m.Size())) {
		return errors.New("the segment does not hold the writer's bytes")
	}
	fmt.Println("ok")
	return nil
}

// uncommittedChild creates NAME uncommitted, says ready, and waits to be
// killed.
func uncommittedChild(ctx context.Context, c *gpushm.Client) error {
	seg, err := c.Create(ctx, os.Getenv("NAME"), 4096, &gpushm.CreateOptions{Uncommitted: true})
	if err != nil {
		return err
	}
	defer seg.Close()
	fmt.Println("ready")
	select {}
}
