package integration

import (
	"bytes"
	"context"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/exitcode"
	"github.com/gpushm/gpushm/internal/testutil"
)

// started is a CLI process running in the background.
type started struct {
	cmd    *exec.Cmd
	stderr bytes.Buffer
	done   chan struct{}
	code   int
}

func startCLI(t *testing.T, args ...string) *started {
	t.Helper()
	return startCmd(t, exec.Command(gpushmBin, args...))
}

// startCmd starts cmd (the CLI, set up as the test needs) in the
// background, its standard error kept, and kills it at cleanup if it is
// still running.
func startCmd(t *testing.T, cmd *exec.Cmd) *started {
	t.Helper()
	p := &started{cmd: cmd, done: make(chan struct{})}
	p.cmd.Stderr = &p.stderr
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		defer close(p.done)
		p.cmd.Wait()
		p.code = p.cmd.ProcessState.ExitCode()
	}()
	t.Cleanup(func() {
		p.cmd.Process.Signal(syscall.SIGCONT)
		p.cmd.Process.Kill()
		<-p.done
	})
	return p
}

func (p *started) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// interrupt stops p, and unless before says the moment has passed (the
// copy is over), sends it SIGINT and lets it go on. Stopped first, p
// handles the signal before it can take another step of its copy.
func (p *started) interrupt(t *testing.T, before func() bool) bool {
	t.Helper()
	p.cmd.Process.Signal(syscall.SIGSTOP)
	ok := before()
	if ok {
		p.cmd.Process.Signal(syscall.SIGINT)
	}
	p.cmd.Process.Signal(syscall.SIGCONT)
	<-p.done
	return ok
}

// TestInterruptGetIntoAPipe: get NAME - into a pipe whose reader is slow
// stops at SIGINT or SIGTERM (exit 130 or 143) instead of writing the
// whole segment; host memory, where the whole segment was one write.
func TestInterruptGetIntoAPipe(t *testing.T) {
	Start(t, Options{})
	mustRun(t, nil, "create", "pipe-big", "256M")
	for _, sig := range []syscall.Signal{syscall.SIGINT, syscall.SIGTERM} {
		t.Run(sig.String(), func(t *testing.T) {
			r, w, err := os.Pipe()
			if err != nil {
				t.Fatal(err)
			}
			defer r.Close()
			get := exec.Command(gpushmBin, "get", "pipe-big", "-")
			get.Stdout = w
			p := startCmd(t, get)
			w.Close()
			// The reader takes a little, then stops reading: the writer
			// blocks in the pipe, as under a slow consumer.
			buf := make([]byte, 1<<20)
			got := 0
			for got < 4<<20 {
				n, err := r.Read(buf)
				if err != nil {
					t.Fatalf("read after %d bytes: %v (%s)", got, err, p.stderr.String())
				}
				got += n
			}
			p.cmd.Process.Signal(sig)
			// Drain what the last piece holds, as a slow reader would.
			go io.Copy(io.Discard, r)
			select {
			case <-p.done:
			case <-time.After(20 * time.Second):
				p.cmd.Process.Kill()
				t.Fatalf("get into a pipe went on 20 s after %v", sig)
			}
			want := map[syscall.Signal]int{syscall.SIGINT: exitcode.Interrupted, syscall.SIGTERM: 128 + int(syscall.SIGTERM)}[sig]
			if p.code != want {
				t.Fatalf("after %v: exit %d, want %d; stderr:\n%s", sig, p.code, want, p.stderr.String())
			}
		})
	}
}

// TestInterruptGet: Ctrl-C during get leaves the file as it was (or none),
// removes what it wrote, and exits 130, whoever copies.
func TestInterruptGet(t *testing.T) {
	d := Start(t, Options{})
	dir := filepath.Dir(d.Socket())
	mustRun(t, nil, "create", "big", "1G") // four of the daemon's steps

	const before = "the file as it was\n"
	for _, copier := range []string{"daemon", "client"} {
		t.Run(copier, func(t *testing.T) {
			out := filepath.Join(dir, "out-"+copier)
			temps := filepath.Join(dir, ".out-"+copier+".gpushm-get-*")
			for attempt := 1; ; attempt++ {
				os.WriteFile(out, []byte(before), 0o640)
				p := startCLI(t, "get", "--copier", copier, "big", out)
				// The temporary file appears as the copy starts.
				for !p.exited() {
					if m, _ := filepath.Glob(temps); len(m) > 0 {
						break
					}
					time.Sleep(time.Millisecond)
				}
				interrupted := p.interrupt(t, func() bool {
					b, _ := os.ReadFile(out)
					return string(b) == before // not renamed over yet
				})
				if !interrupted && attempt < 5 {
					t.Logf("attempt %d: get ended before it was stopped (exit %d); again", attempt, p.code)
					continue
				}
				if !interrupted {
					t.Fatalf("get ended before it could be interrupted, %d times", attempt)
				}
				if p.code != exitcode.Interrupted || p.stderr.String() != "gpushm: get big: interrupted\n" {
					t.Errorf("get interrupted: exit %d, stderr %q; want %d and %q", p.code, p.stderr.String(), exitcode.Interrupted, "gpushm: get big: interrupted\n")
				}
				break
			}
			if b, err := os.ReadFile(out); string(b) != before {
				t.Errorf("after an interrupted get, %s holds %d bytes (%v), want what it held before", out, len(b), err)
			}
			if st, err := os.Stat(out); err != nil || st.Mode().Perm() != 0o640 {
				t.Errorf("after an interrupted get: %v, %v; want mode 0640 kept", st.Mode(), err)
			}
			if m, _ := filepath.Glob(temps); len(m) > 0 {
				t.Errorf("an interrupted get left %s", m)
			}
		})
	}
	// Uninterrupted, the file is replaced, keeping its mode.
	out := filepath.Join(dir, "out-daemon")
	mustRun(t, nil, "get", "big", out)
	if st, err := os.Stat(out); err != nil || st.Size() != 1<<30 || st.Mode().Perm() != 0o640 {
		t.Errorf("get over a file: %v; want 1 GiB, mode 0640", st)
	}
}

// TestInterruptPut: Ctrl-C during put, from a file or a pipe, leaves no
// segment and exits 130.
func TestInterruptPut(t *testing.T) {
	d := Start(t, Options{})
	dir, sock := filepath.Dir(d.Socket()), d.Socket()
	ctx := context.Background()
	c, err := gpushm.Dial(ctx, sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	names := func() []gpushm.SegmentInfo {
		segs, err := c.List(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return segs
	}
	// gone waits until name is no more: the daemon ends an uncommitted
	// segment with its writer's connection, once the step of the copy it
	// was making is done.
	gone := func(name string) bool {
		for range 1200 {
			if !slices.ContainsFunc(names(), func(s gpushm.SegmentInfo) bool { return s.Name == name }) {
				return true
			}
			time.Sleep(100 * time.Millisecond)
		}
		return false
	}

	// From a pipe whose writer lives on: put is reading it when the
	// signal comes, and ends at once.
	t.Run("stdin", func(t *testing.T) {
		cmd := exec.Command(gpushmBin, "put", "piped", "-")
		in, err := cmd.StdinPipe()
		if err != nil {
			t.Fatal(err)
		}
		defer in.Close()
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		// A write larger than a pipe holds returns once put has read
		// most of it.
		if _, err := in.Write(make([]byte, 4<<20)); err != nil {
			t.Fatal(err)
		}
		cmd.Process.Signal(syscall.SIGINT)
		cmd.Wait()
		if code := cmd.ProcessState.ExitCode(); code != exitcode.Interrupted || stderr.String() != "gpushm: put piped: interrupted\n" {
			t.Errorf("put - interrupted: exit %d, stderr %q; want %d", code, stderr.String(), exitcode.Interrupted)
		}
		if !gone("piped") {
			t.Error("an interrupted put - left its segment")
		}
	})

	src := filepath.Join(dir, "big.bin")
	testutil.SparseFile(t, src, nil, 1<<30)
	for _, copier := range []string{"daemon", "client"} {
		t.Run(copier, func(t *testing.T) {
			name := "big-" + copier
			for attempt := 1; ; attempt++ {
				p := startCLI(t, "put", "--copier", copier, name, src)
				uncommitted := func() bool {
					return slices.ContainsFunc(names(), func(s gpushm.SegmentInfo) bool { return s.Name == name && s.Uncommitted })
				}
				for !p.exited() && !uncommitted() {
					time.Sleep(time.Millisecond)
				}
				if p.interrupt(t, uncommitted) {
					if p.code != exitcode.Interrupted || p.stderr.String() != "gpushm: put "+name+": interrupted\n" {
						t.Errorf("put interrupted: exit %d, stderr %q; want %d", p.code, p.stderr.String(), exitcode.Interrupted)
					}
					break
				}
				if attempt == 5 {
					t.Fatalf("put ended before it could be interrupted, %d times", attempt)
				}
				t.Logf("attempt %d: put ended before it was stopped (exit %d); again", attempt, p.code)
				mustRun(t, nil, "rm", "-f", name)
			}
			if !gone(name) {
				t.Errorf("an interrupted put left %s: %+v", name, names())
			}
		})
	}
	for _, s := range names() {
		t.Errorf("segment %s left", s.Name)
	}
}
