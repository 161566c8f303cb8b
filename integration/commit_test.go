package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/layout"
	"github.com/gpushm/gpushm/internal/testutil"
)

// A writer killed at any moment leaves its name either gone or whole:
// 'gpushm put' of a file, of a directory and of standard input, and a
// client filling a segment it created uncommitted, each SIGKILLed at random
// moments, now and then with the serving process killed too.

const writerSize = 24 << 20

// writerMain is the client writer (GPUSHM_TEST_WRITER=NAME): it creates
// NAME uncommitted, fills it a MiB at a time with writerBytes, and
// commits it.
func writerMain(name string) error {
	ctx := context.Background()
	c, err := gpushm.Dial(ctx, os.Getenv("GPUSHM_SOCKET"))
	if err != nil {
		return err
	}
	defer c.Close()
	seg, err := c.Create(ctx, name, writerSize, &gpushm.CreateOptions{Uncommitted: true})
	if err != nil {
		return err
	}
	defer seg.Close()
	m, err := seg.Map()
	if err != nil {
		return err
	}
	data := writerBytes()
	for off := 0; off < len(data); off += 1 << 20 {
		if _, err := m.WriteAt(data[off:off+1<<20], int64(off)); err != nil {
			return err
		}
	}
	return seg.Commit(ctx)
}

func writerBytes() []byte {
	b := make([]byte, writerSize)
	rand.NewChaCha8([32]byte{'w'}).Read(b)
	return b
}

// killedWriter is one kind of writer the test kills.
type killedWriter struct {
	kind string
	cmd  func(name string) *exec.Cmd
}

func TestPutKilled(t *testing.T) {
	rounds := 12
	if testing.Short() {
		rounds = 4
	}
	dir := testutil.SocketDir(t)
	sock := filepath.Join(dir, "gpushm.sock")
	d := Start(t, Options{Socket: sock, Args: []string{"--grace", "1s"}})
	t.Setenv("GPUSHM_SOCKET", sock)
	ctx := context.Background()
	c, err := gpushm.Dial(ctx, sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 5))
	for _, w := range killedWriters(t, dir, sock) {
		t.Run(w.kind, func(t *testing.T) { killWriters(t, d, c, w, rounds, rng) })
	}
	// Every name went or was removed: no memory is left behind.
	deadline := time.Now().Add(30 * time.Second)
	for {
		inf, err := c.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if inf.Usage.Segments == 0 && inf.Usage.Named == 0 {
			break
		}
		if time.Now().After(deadline) {
			l, _ := c.List(ctx)
			t.Fatalf("left behind: %+v: %+v", inf.Usage, l)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// killedWriters are TestPutKilled's writers of a file, a directory and
// standard input through the CLI, and of a client of the library, each of
// what it writes made in dir.
func killedWriters(t *testing.T, dir, sock string) []killedWriter {
	t.Helper()
	file := filepath.Join(dir, "blob.bin")
	if err := os.WriteFile(file, writerBytes()[:writerSize-12345], 0o644); err != nil {
		t.Fatal(err)
	}
	ckpt := filepath.Join(dir, "ckpt")
	os.Mkdir(ckpt, 0o755)
	testutil.WriteShard(t, filepath.Join(ckpt, "model-00001-of-00002.safetensors"), pt, testutil.NewTensor("a.weight", "U8", 14<<20), testutil.NewTensor("b.bias", "U8", 13))
	testutil.WriteShard(t, filepath.Join(ckpt, "model-00002-of-00002.safetensors"), pt, testutil.NewTensor("c.weight", "U8", 9<<20))
	os.WriteFile(filepath.Join(ckpt, "config.json"), []byte(`{"model_type":"llama","hidden_size":8}`), 0o644)
	os.WriteFile(filepath.Join(ckpt, "tokenizer.json"), bytes.Repeat([]byte("tok "), 5000), 0o644)

	// Under the race detector a process sleeps a second at exit: without
	// that, its life is the writer's, and random kills land in it.
	env := slices.Clip(append(os.Environ(), "GPUSHM_SOCKET="+sock, "GORACE=atexit_sleep_ms=0"))
	gpushmCmd := func(args ...string) *exec.Cmd {
		cmd := exec.Command(gpushmBin, args...)
		cmd.Env = env
		return cmd
	}
	return []killedWriter{
		{"file", func(name string) *exec.Cmd { return gpushmCmd("put", name, file) }},
		{"dir", func(name string) *exec.Cmd { return gpushmCmd("put", name, ckpt) }},
		{"stdin", func(name string) *exec.Cmd {
			cmd := gpushmCmd("put", name, "-")
			f, err := os.Open(file)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { f.Close() })
			cmd.Stdin = f
			return cmd
		}},
		{"client", func(name string) *exec.Cmd {
			cmd := exec.Command(os.Args[0])
			cmd.Env = append(env, "GPUSHM_TEST_WRITER="+name)
			return cmd
		}},
	}
}

// killWriters is TestPutKilled's test of one writer: rounds of it killed
// at a random moment of its life, the serving process killed too in every
// fourth, and what it wrote whole or gone after each.
func killWriters(t *testing.T, d *Daemon, c *gpushm.Client, w killedWriter, rounds int, rng *rand.Rand) {
	ctx := context.Background()
	// Writers left alone: how long one takes (the median of three),
	// and what a whole segment holds.
	var runs []time.Duration
	ref := "ref-" + w.kind
	for k := range 3 {
		start := time.Now()
		if out, err := w.cmd(fmt.Sprintf("%s-%d", ref, k)).CombinedOutput(); err != nil {
			t.Fatalf("%s writer: %v\n%s", w.kind, err, out)
		}
		runs = append(runs, time.Since(start))
	}
	slices.Sort(runs)
	took := runs[1]
	want, wantMeta := segmentBytes(t, c, ref+"-0")
	for k := range 3 {
		if got, _ := segmentBytes(t, c, fmt.Sprintf("%s-%d", ref, k)); !bytes.Equal(got, want) {
			t.Fatalf("two whole %s writes differ", w.kind)
		}
		if err := c.Unlink(ctx, fmt.Sprintf("%s-%d", ref, k)); err != nil {
			t.Fatal(err)
		}
	}
	var gone, whole, caught, restarts int
	for i := range rounds {
		name := fmt.Sprintf("%s-%d", w.kind, i)
		cmd := w.cmd(name)
		var errb bytes.Buffer
		cmd.Stderr = &errb
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		restart := i%4 == 3
		var serving int
		if restart {
			inf, err := d.info()
			if err != nil {
				t.Fatal(err)
			}
			serving = inf.PID
		}
		// A random moment of the writer's life, or just after it.
		time.Sleep(time.Duration(rng.Int64N(int64(took) * 3 / 2)))
		if restart && rng.IntN(2) == 0 {
			syscall.Kill(serving, syscall.SIGKILL)
		}
		cmd.Process.Signal(syscall.SIGKILL)
		if restart {
			syscall.Kill(serving, syscall.SIGKILL)
			d.waitServing(t, serving)
			restarts++
		}
		if err := cmd.Wait(); err == nil && !restart {
			// Finished before the kill: it must have committed.
			if st, err := c.Stat(ctx, name); err != nil || st.Uncommitted {
				t.Fatalf("%s: writer exited 0, stat = %+v, %v", name, st, err)
			}
		}
		switch checkWholeOrGone(t, c, name, want, wantMeta, &caught) {
		case true:
			whole++
			if err := c.Unlink(ctx, name); err != nil {
				t.Fatal(err)
			}
		case false:
			gone++
		}
	}
	t.Logf("%s: %d rounds (%d with the serving process killed too; a writer runs %s): %d whole, %d gone, %d seen while incomplete",
		w.kind, rounds, restarts, took.Round(time.Millisecond), whole, gone, caught)
}

// segmentBytes opens name and returns its bytes and meta.
func segmentBytes(t *testing.T, c *gpushm.Client, name string) ([]byte, json.RawMessage) {
	t.Helper()
	seg, err := c.Open(context.Background(), name, &gpushm.OpenOptions{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	defer seg.Close()
	m, err := seg.Map()
	if err != nil {
		t.Fatal(err)
	}
	b := make([]byte, seg.Size())
	if _, err := m.ReadAt(b, 0); err != nil {
		t.Fatal(err)
	}
	return b, seg.Info().Meta
}

// checkWholeOrGone waits until name is gone (false) or committed, and then
// checks that it holds want and wantMeta (true). Meanwhile it must be
// listed as incomplete and every open must be refused; caught counts
// names seen so.
func checkWholeOrGone(t *testing.T, c *gpushm.Client, name string, want []byte, wantMeta json.RawMessage, caught *int) bool {
	t.Helper()
	ctx := context.Background()
	deadline := time.Now().Add(60 * time.Second)
	seen := false
	for {
		seg, err := c.Open(ctx, name, &gpushm.OpenOptions{ReadOnly: true})
		switch {
		case errors.Is(err, syscall.ENOENT):
			return false
		case errors.Is(err, syscall.EAGAIN):
			if st, err := c.Stat(ctx, name); err == nil && !st.Uncommitted {
				continue // committed in between
			} else if err == nil && !seen {
				seen = true
				*caught++
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s still incomplete after 60s", name)
			}
			time.Sleep(10 * time.Millisecond)
			continue
		case err != nil:
			t.Fatalf("open %s: %v", name, err)
		}
		defer seg.Close()
		if seg.Info().Uncommitted {
			t.Fatalf("open %s gave an uncommitted segment", name)
		}
		m, err := seg.Map()
		if err != nil {
			t.Fatal(err)
		}
		got := make([]byte, seg.Size())
		if _, err := m.ReadAt(got, 0); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want) || !bytes.Equal(seg.Info().Meta, wantMeta) {
			bad := 0
			for i := range min(len(got), len(want)) {
				if got[i] != want[i] {
					bad++
				}
			}
			t.Fatalf("%s is served half made: %d bytes (want %d), %d differ; meta %s (want %s)", name, len(got), len(want), bad, seg.Info().Meta, wantMeta)
		}
		return true
	}
}

// TestPutIncomplete: what 'ls', 'stat' and 'get' say of a segment still
// being written, and 'get --wait' of one that is not there yet.
func TestPutIncomplete(t *testing.T) {
	d := Start(t, Options{})
	dir, sock := filepath.Dir(d.Socket()), d.Socket()
	ctx := context.Background()
	c, err := gpushm.Dial(ctx, sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	seg, err := c.Create(ctx, "half", 4096, &gpushm.CreateOptions{Uncommitted: true})
	if err != nil {
		t.Fatal(err)
	}
	if out := mustRun(t, nil, "ls"); !strings.Contains(out, "incomplete") {
		t.Fatalf("ls does not call it incomplete:\n%s", out)
	}
	if out := mustRun(t, nil, "stat", "half"); !strings.Contains(out, "incomplete:  still being written") {
		t.Fatalf("stat does not call it incomplete:\n%s", out)
	}
	mustFail(t, "is still being written", "get", "half", filepath.Join(dir, "out"))
	if _, err := os.Stat(filepath.Join(dir, "out")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("a refused get wrote its file: %v", err)
	}
	mustFail(t, "not committed within", "get", "--wait", "200ms", "half", filepath.Join(dir, "out"))
	seg.Close()

	// Readers started before the writer, each waiting; with stderr sent
	// to a pipe, not a terminal.
	src := filepath.Join(dir, "src.bin")
	data := writerBytes()[:3<<20]
	os.WriteFile(src, data, 0o644)
	var gets []*exec.Cmd
	for k := range 3 {
		cmd := exec.Command(gpushmBin, "get", "--wait", "5m", "late", filepath.Join(dir, fmt.Sprintf("late-%d", k)))
		var errb bytes.Buffer
		cmd.Stderr = &errb
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
		gets = append(gets, cmd)
		defer func() {
			if t.Failed() {
				t.Logf("get %d: %s", k, errb.String())
			}
		}()
	}
	mustRun(t, nil, "put", "late", src)
	for k, cmd := range gets {
		if err := cmd.Wait(); err != nil {
			t.Fatalf("get --wait %d: %v", k, err)
		}
		if got, err := os.ReadFile(filepath.Join(dir, fmt.Sprintf("late-%d", k))); err != nil || !bytes.Equal(got, data) {
			t.Fatalf("get --wait %d wrote %d bytes (want the %d put), %v", k, len(got), len(data), err)
		}
	}
}

// TestWaitAcrossRestarts: opens waiting for a commit keep waiting through
// an upgrade of the serving process (the request goes to the successor)
// and through its crash (the clients ask again), and get the segment.
func TestWaitAcrossRestarts(t *testing.T) {
	dir := testutil.SocketDir(t)
	sock := filepath.Join(dir, "gpushm.sock")
	d := Start(t, Options{Socket: sock, Args: []string{"--grace", "1s", "--log-level", "debug"}})
	t.Setenv("GPUSHM_SOCKET", sock)
	waits := func(n int) {
		t.Helper()
		deadline := time.Now().Add(60 * time.Second)
		for strings.Count(d.log.String(), "open waits for a commit") < n {
			if time.Now().After(deadline) {
				t.Fatalf("fewer than %d waits for a commit logged:\n%s", n, d.log.String())
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	const readers = 3
	var gets []*exec.Cmd
	var errs []*bytes.Buffer
	for k := range readers {
		cmd := exec.Command(gpushmBin, "get", "--wait", "5m", "late", filepath.Join(dir, fmt.Sprintf("late-%d", k)))
		var errb bytes.Buffer
		cmd.Stderr = &errb
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
		gets, errs = append(gets, cmd), append(errs, &errb)
	}
	waits(readers)

	inf, err := d.info()
	if err != nil {
		t.Fatal(err)
	}
	d.cmd.Process.Signal(syscall.SIGHUP)
	inf = d.waitServing(t, inf.PID)
	waits(2 * readers) // the successor waits out what is left
	syscall.Kill(inf.PID, syscall.SIGKILL)
	d.waitServing(t, inf.PID)
	waits(3 * readers) // asked again on new connections

	src := filepath.Join(dir, "src.bin")
	data := writerBytes()[:5<<20]
	os.WriteFile(src, data, 0o644)
	mustRun(t, nil, "put", "late", src)
	for k, cmd := range gets {
		if err := cmd.Wait(); err != nil {
			t.Fatalf("get --wait %d: %v\n%s", k, err, errs[k].String())
		}
		if got, err := os.ReadFile(filepath.Join(dir, fmt.Sprintf("late-%d", k))); err != nil || !bytes.Equal(got, data) {
			t.Fatalf("get --wait %d wrote %d bytes (want the %d put), %v", k, len(got), len(data), err)
		}
	}
}

// TestSurviveCommitMeta: the meta a commit carried is journaled with the
// commit, so a bundle keeps its origin when the serving process is killed.
func TestSurviveCommitMeta(t *testing.T) {
	dir := testutil.SocketDir(t)
	sock := filepath.Join(dir, "gpushm.sock")
	d := Start(t, Options{Socket: sock})
	t.Setenv("GPUSHM_SOCKET", sock)
	path := filepath.Join(dir, "model.safetensors")
	os.WriteFile(path, testutil.SafetensorsFile(goodHeader, make([]byte, 22)), 0o644)
	mustRun(t, nil, "put", "model", path)
	before := stated(t, "model").Meta
	if o := bundleOrigin(t, before); o == nil || len(o.Files) != 1 {
		t.Fatalf("meta %s before the restart: no origin", before)
	}
	d.Crash(t)
	c := dialOnce(t, sock)
	defer c.Close()
	st, err := c.Stat(context.Background(), "model")
	if err != nil {
		t.Fatal(err)
	}
	if string(st.Meta) != string(before) {
		t.Fatalf("meta after a kill -9 of the serving process:\n%s\nwant\n%s", st.Meta, before)
	}
	d.Stop(t)
}

// stated is what stat says of name (list leaves meta out).
func stated(t *testing.T, name string) gpushm.SegmentInfo {
	t.Helper()
	c := dialOnce(t, os.Getenv("GPUSHM_SOCKET"))
	defer c.Close()
	st, err := c.Stat(context.Background(), name)
	if err != nil {
		t.Fatal(err)
	}
	return *st
}

// bundleOrigin reads a bundle meta's origin.
func bundleOrigin(t *testing.T, meta json.RawMessage) *layout.Origin {
	t.Helper()
	var m layout.Meta
	if err := json.Unmarshal(meta, &m); err != nil {
		t.Fatalf("meta %s: %v", meta, err)
	}
	return m.Origin
}

const goodHeader = `{"__metadata__":{"format":"pt"},"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},"b":{"dtype":"BF16","shape":[3],"data_offsets":[16,22]},"e":{"dtype":"F4","shape":[0],"data_offsets":[22,22]}}   `

// pt is the metadata PyTorch's safetensors writer leaves in a shard.
var pt = map[string]string{"format": "pt"}
