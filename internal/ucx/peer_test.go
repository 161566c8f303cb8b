package ucx

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) == "serve" {
		if err := serveChild(); err != nil {
			fmt.Fprintln(os.Stderr, "ucx serve child:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// pattern fills b, which starts at offset off of the served region, with
// words that say their own offset, so that a chunk read into the wrong
// place or from the wrong place shows.
func pattern(b []byte, off int) {
	for i := 0; i+8 <= len(b); i += 8 {
		binary.LittleEndian.PutUint64(b[i:], uint64(off+i)^0x9e3779b97f4a7c15)
	}
}

// serveChild is the serving process: it maps SIZE bytes outside Go's heap
// and a page past them that it does not register, fills them with pattern, prints "region-address rkey worker-address" (hex)
// on a line, and serves its worker until its standard input closes.
func serveChild() error {
	size, err := strconv.Atoi(os.Getenv("SIZE"))
	if err != nil {
		return err
	}
	all, err := unix.Mmap(-1, 0, size+4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return err
	}
	pattern(all, 0)
	b := all[:size]
	c, err := NewContext()
	if err != nil {
		return err
	}
	r, err := c.Map(b)
	if err != nil {
		return err
	}
	key, err := r.PackKey()
	if err != nil {
		return err
	}
	w, err := c.NewWorker()
	if err != nil {
		return err
	}
	addr, err := w.Address()
	if err != nil {
		return err
	}
	ctx, stop := context.WithCancel(context.Background())
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		stop()
	}()
	fmt.Printf("%x %x %x\n", r.Addr(), key, addr)
	if err := w.Serve(ctx); err != nil {
		return err
	}
	if err := w.Close(); err != nil {
		return err
	}
	if err := r.Free(); err != nil {
		return err
	}
	return c.Close()
}

// A peer is a serving process and what it printed.
type peer struct {
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	addr   uint64
	key    []byte
	worker []byte
}

// startPeer starts a serving process with size bytes, UCX on tcp over
// loopback, and stops it at the test's end.
func startPeer(t *testing.T, size int) *peer {
	t.Helper()
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), childEnv+"=serve", "SIZE="+strconv.Itoa(size), "UCX_TLS=tcp", "UCX_NET_DEVICES=lo")
	// UCX prints a backtrace when a bad request kills the child: shown
	// only if the test fails.
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &peer{cmd: cmd, stdin: stdin}
	t.Cleanup(func() {
		stdin.Close()
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			cmd.Process.Kill()
			<-done
			t.Error("serving process did not exit when its input closed")
		}
		if t.Failed() {
			t.Logf("serving process's standard error:\n%s", stderr.Bytes())
		}
	})
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		t.Fatalf("serving process: %v", err)
	}
	f := strings.Fields(line)
	if len(f) != 3 {
		t.Fatalf("serving process printed %q", line)
	}
	if p.addr, err = strconv.ParseUint(f[0], 16, 64); err != nil {
		t.Fatal(err)
	}
	if p.key, err = hex.DecodeString(f[1]); err != nil {
		t.Fatal(err)
	}
	if p.worker, err = hex.DecodeString(f[2]); err != nil {
		t.Fatal(err)
	}
	return p
}

// connect makes a context, a worker and an endpoint to p in this process,
// closed at the test's end.
func connect(t *testing.T, p *peer) *Endpoint {
	t.Helper()
	forceTCP(t)
	c, err := NewContext()
	if err != nil {
		t.Fatal(err)
	}
	w, err := c.NewWorker()
	if err != nil {
		t.Fatal(err)
	}
	ep, err := w.Connect(p.worker)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := ep.Close(); err != nil {
			t.Errorf("Endpoint.Close: %v", err)
		}
		if err := w.Close(); err != nil {
			t.Errorf("Worker.Close: %v", err)
		}
		if err := c.Close(); err != nil {
			t.Errorf("Context.Close: %v", err)
		}
	})
	return ep
}

// checkPattern reports the first word of b, read from offset off, that is
// not pattern's.
func checkPattern(t *testing.T, b []byte, off int) {
	t.Helper()
	want := make([]byte, len(b))
	pattern(want, off)
	for i := 0; i+8 <= len(b); i += 8 {
		if string(b[i:i+8]) != string(want[i:i+8]) {
			t.Fatalf("byte %d (offset %d of the region): got %x, want %x", i, off+i, b[i:i+8], want[i:i+8])
		}
	}
}

// TestPeerGet reads a 64 MiB region of another process over tcp, all of it
// in chunks, then a range in its middle that starts and ends off a chunk's
// boundary.
func TestPeerGet(t *testing.T) {
	requireUCX(t)
	const size = 64 << 20
	p := startPeer(t, size)
	ep := connect(t, p)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dst := make([]byte, size)
	start := time.Now()
	if err := ep.Get(ctx, dst, p.addr, p.key); err != nil {
		t.Fatal(err)
	}
	d := time.Since(start)
	checkPattern(t, dst, 0)
	t.Logf("64 MiB in %v (%.2f GB/s, UCX %s on tcp, loopback)", d, size/d.Seconds()/1e9, Version())

	const off, n = 20<<20 + 4096 + 8, 3<<20 + 40
	mid := make([]byte, n)
	if err := ep.Get(ctx, mid, p.addr+off, p.key); err != nil {
		t.Fatal(err)
	}
	checkPattern(t, mid, off)
}

// TestPeerGetSmallChunks reads through many small chunks, several in
// flight, to see them land in order whatever order they finish in.
func TestPeerGetSmallChunks(t *testing.T) {
	requireUCX(t)
	chunk, depth := getChunk, getDepth
	getChunk, getDepth = 4096+8, 5
	t.Cleanup(func() { getChunk, getDepth = chunk, depth })
	const size = 1 << 20
	p := startPeer(t, size)
	ep := connect(t, p)
	dst := make([]byte, size-16)
	if err := ep.Get(context.Background(), dst, p.addr+16, p.key); err != nil {
		t.Fatal(err)
	}
	checkPattern(t, dst, 16)
}

// TestPeerBadRequests sends what a careless or hostile peer might. Over
// tcp UCX emulates a get with messages that the serving process answers
// with a plain copy from the address it is given, checking neither the key
// nor the range: the serving process is the trust boundary (docs/
// architecture.md, "Peers: the data path"). What this side must do is
// fail with an error, never crash or hang.
func TestPeerBadRequests(t *testing.T) {
	requireUCX(t)
	p := startPeer(t, 1<<20)
	ep := connect(t, p)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dst := make([]byte, 4096)
	if err := ep.Get(ctx, dst, p.addr, nil); err == nil {
		t.Error("Get with no remote key succeeded")
	}
	if err := ep.Get(ctx, dst, p.addr, p.key); err != nil {
		t.Fatalf("Get after a refused one: %v", err)
	}
	// An address the serving process never mapped: over tcp it dies
	// of SIGSEGV (UCX's handler prints a backtrace on its standard error);
	// here the Get, and every later one, fails.
	start := time.Now()
	err := ep.Get(ctx, dst, 4096, p.key)
	if err == nil {
		t.Fatal("Get of an unmapped address succeeded")
	}
	t.Logf("Get of an unmapped address, after %v: %v", time.Since(start), err)
	if err := ep.Get(ctx, dst, p.addr, p.key); err == nil {
		t.Error("Get on a failed endpoint succeeded")
	} else if ctx.Err() != nil {
		t.Errorf("Get on a failed endpoint waited for its context: %v", err)
	}
}

// TestPeerPut writes into the serving process's region and reads it back;
// then it writes to the page past the region, which was never registered:
// over tcp UCX checks no range for puts either, which is why a lender runs
// as a process of its own, as nobody (docs/architecture.md, "Peers: the
// data path").
func TestPeerPut(t *testing.T) {
	requireUCX(t)
	const size = 1 << 20
	p := startPeer(t, size)
	ep := connect(t, p)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, off := range []uint64{64, size - 8, size + 64} {
		word := binary.LittleEndian.AppendUint64(nil, 0xfeedface0000+off)
		if err := ep.Put(ctx, word, p.addr+off, p.key); err != nil {
			t.Fatalf("Put at %d: %v", off, err)
		}
		got := make([]byte, 8)
		if err := ep.Get(ctx, got, p.addr+off, p.key); err != nil {
			t.Fatalf("Get at %d: %v", off, err)
		}
		if !bytes.Equal(got, word) {
			t.Errorf("at offset %d of a region of %d: read back %x after a put of %x", off, size, got, word)
		} else if off >= size {
			t.Logf("a put %d bytes past the registered region landed: tcp checks no range", off-size)
		}
	}
	before := make([]byte, 8)
	pattern(before, 56)
	got := make([]byte, 8)
	if err := ep.Get(ctx, got, p.addr+56, p.key); err != nil || !bytes.Equal(got, before) {
		t.Errorf("the word before the put: %x (%v), want %x untouched", got, err, before)
	}
}

// TestPeerDies kills the serving process while Gets of its region are in
// flight: the Get fails with UCX's error, well before its context ends.
func TestPeerDies(t *testing.T) {
	requireUCX(t)
	const size = 64 << 20
	p := startPeer(t, size)
	ep := connect(t, p)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dst := make([]byte, size)
	if err := ep.Get(ctx, dst, p.addr, p.key); err != nil {
		t.Fatal(err)
	}
	failed := make(chan error, 1)
	go func() {
		for {
			if err := ep.Get(ctx, dst, p.addr, p.key); err != nil {
				failed <- err
				return
			}
		}
	}()
	time.Sleep(100 * time.Millisecond)
	killed := time.Now()
	if err := p.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-failed:
		t.Logf("Get failed %v after the kill: %v", time.Since(killed), err)
		if ctx.Err() != nil {
			t.Errorf("the Get ended only with its context: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Get still running 30 s after its peer was killed")
	}
}

// TestPeerStoppedCancel stops the serving process (SIGSTOP) so that its
// Gets can finish neither way, and cancels one: Get returns the context's
// error within the cancellation's grace, once it has closed the endpoint
// by force, and the endpoint refuses later Gets.
func TestPeerStoppedCancel(t *testing.T) {
	requireUCX(t)
	const size = 16 << 20
	p := startPeer(t, size)
	ep := connect(t, p)
	dst := make([]byte, size)
	if err := ep.Get(context.Background(), dst, p.addr, p.key); err != nil {
		t.Fatal(err)
	}
	if err := p.cmd.Process.Signal(unix.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.cmd.Process.Signal(unix.SIGCONT) })
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	err := ep.Get(ctx, dst, p.addr, p.key)
	d := time.Since(start)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Get from a stopped peer = %v, want the context's deadline", err)
	}
	if limit := 200*time.Millisecond + cancelGrace + 5*time.Second; d > limit {
		t.Errorf("cancelled Get took %v, want under %v", d, limit)
	}
	t.Logf("cancelled Get returned after %v: %v", d, err)
	if err := ep.Get(context.Background(), dst[:4096], p.addr, p.key); err == nil {
		t.Error("Get on an endpoint closed by force succeeded")
	}
}

// TestPeerCloseEndsGets closes an endpoint under a Get from a stopped
// peer: the Get returns ErrClosed, and Close returns.
func TestPeerCloseEndsGets(t *testing.T) {
	requireUCX(t)
	p := startPeer(t, 16<<20)
	forceTCP(t)
	c, err := NewContext()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	w, err := c.NewWorker()
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	ep, err := w.Connect(p.worker)
	if err != nil {
		t.Fatal(err)
	}
	dst := make([]byte, 16<<20)
	if err := ep.Get(context.Background(), dst[:4096], p.addr, p.key); err != nil {
		t.Fatal(err)
	}
	if err := p.cmd.Process.Signal(unix.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.cmd.Process.Signal(unix.SIGCONT) })
	got := make(chan error, 1)
	go func() { got <- ep.Get(context.Background(), dst, p.addr, p.key) }()
	time.Sleep(100 * time.Millisecond)
	if err := w.Close(); err == nil {
		t.Error("Worker.Close with an endpoint open succeeded")
	}
	if err := ep.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
	select {
	case err := <-got:
		if !errors.Is(err, ErrClosed) {
			t.Errorf("Get under Close = %v, want ErrClosed", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Get still running 10 s after Close returned")
	}
	if err := ep.Close(); !errors.Is(err, ErrClosed) {
		t.Errorf("second Close = %v, want ErrClosed", err)
	}
}

// TestPeerSpeed times Gets of GPUSHM_UCX_SPEED MiB from another process
// over tcp on loopback: a diagnostic for the record, skipped unless set.
func TestPeerSpeed(t *testing.T) {
	mib, _ := strconv.Atoi(os.Getenv("GPUSHM_UCX_SPEED"))
	if mib <= 0 {
		t.Skip("a diagnostic: set GPUSHM_UCX_SPEED to a size in MiB")
	}
	requireUCX(t)
	p := startPeer(t, mib<<20)
	ep := connect(t, p)
	dst := make([]byte, mib<<20)
	fmt.Printf("UCX %s, tcp on loopback, %d MiB a Get, %d KiB chunks, %d in flight\n", Version(), mib, getChunk>>10, getDepth)
	for i := range 5 {
		start := time.Now()
		if err := ep.Get(context.Background(), dst, p.addr, p.key); err != nil {
			t.Fatal(err)
		}
		d := time.Since(start)
		fmt.Printf("get %d: %8.1f ms %6.2f GB/s\n", i, d.Seconds()*1e3, float64(mib<<20)/d.Seconds()/1e9)
	}
	checkPattern(t, dst, 0)
}
