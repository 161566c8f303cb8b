package gpushm_test

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/cuda"
	"github.com/gpushm/gpushm/internal/testdaemon"
)

// Tests that need a second process run this test binary again with
// GPUSHM_TEST_CHILD naming what to do.
func TestMain(m *testing.M) {
	if mode := os.Getenv("GPUSHM_TEST_CHILD"); mode != "" {
		if err := childMain(mode); err != nil {
			fmt.Fprintf(os.Stderr, "child %s: %v\n", mode, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	// The examples find their daemon as programs do, at $GPUSHM_SOCKET:
	// one on the host backend, in this process. Tests start their own.
	testdaemon.RunExamples(m)
}

func pattern(seed uint64, n int64) []byte {
	b := make([]byte, n)
	rand.NewChaCha8([32]byte{byte(seed), byte(seed >> 8)}).Read(b)
	return b
}

func childMain(mode string) error {
	switch mode {
	case "raw":
		return rawChild()
	case "attacker": // squat_test.go
		return attackerChild()
	case "dial":
		return dialChild()
	}
	ctx := context.Background()
	c, err := gpushm.Dial(ctx, os.Getenv("GPUSHM_SOCKET"))
	if err != nil {
		return err
	}
	defer c.Close()
	switch mode {
	case "ops":
		return opsChild(ctx, c)
	case "next-version":
		return nextVersionChild(ctx, c)
	case "wait-read":
		return waitReadChild(ctx, c)
	case "uncommitted":
		return uncommittedChild(ctx, c)
	case "verify-and-write":
		// Open by name, check the creator's bytes, write our own.
		seg, err := c.Open(ctx, os.Getenv("NAME"), nil)
		if err != nil {
			return err
		}
		defer seg.Close()
		m, err := seg.Map()
		if err != nil {
			return err
		}
		got := make([]byte, m.Size())
		if _, err := m.ReadAt(got, 0); err != nil {
			return err
		}
		if !bytes.Equal(got, pattern(1, m.Size())) {
			return errors.New("segment does not hold the creator's bytes")
		}
		_, err = m.WriteAt(pattern(2, m.Size()), 0)
		return err
	case "publish":
		// Publish a memfd holding pattern 3, then exit.
		fd, err := unix.MemfdCreate("pub", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		unix.Ftruncate(fd, 8192)
		unix.Pwrite(fd, pattern(3, 8192), 0)
		_, err = c.Publish(ctx, os.Getenv("NAME"), fd, 8192, &gpushm.CreateOptions{
			Meta: []byte(`{"kind":"tensor","dtype":"uint8","shape":[4096],"offset":4096}`)})
		return err
	case "publish-cuda":
		return publishCUDAChild(ctx, c)
	case "read-on-gpu0":
		return readOnGPU0Child(ctx, c)
	case "temporary":
		// Create a segment bound to this connection, then wait to be killed.
		if _, _, err := c.CreateOnly(ctx, os.Getenv("NAME"), 4096, &gpushm.CreateOptions{Temporary: true}); err != nil {
			return err
		}
		fmt.Println("ready")
		time.Sleep(time.Hour)
	case "hold":
		// Take leases on every name given, then wait to be killed.
		for _, name := range strings.Fields(os.Getenv("NAMES")) {
			seg, err := c.Open(ctx, name, nil)
			if err != nil {
				return err
			}
			if _, err := seg.Map(); err != nil {
				return err
			}
		}
		fmt.Println("ready")
		time.Sleep(time.Hour)
	case "chan-producer", "chan-consumer", "chan-hold", "chan-unwritten":
		return channelChild(ctx, c, mode)
	case "readonly":
		seg, err := c.Open(ctx, os.Getenv("NAME"), &gpushm.OpenOptions{ReadOnly: true})
		if err != nil {
			return err
		}
		defer seg.Close()
		_, err = seg.Map()
		return err
	}
	return fmt.Errorf("unknown child mode %q", mode)
}

// publishCUDAChild allocates on GPU 0 itself, fills the allocation with
// pattern 3, publishes it as NAME and returns.
func publishCUDAChild(ctx context.Context, c *gpushm.Client) error {
	d, err := cuda.GetDevice(0)
	if err != nil {
		return err
	}
	g, _ := d.Granularity()
	h, err := d.Create(g)
	if err != nil {
		return err
	}
	defer d.Release(h)
	ptr, err := d.Map(h, g, false, d)
	if err != nil {
		return err
	}
	defer d.Unmap(ptr, g)
	if err := d.CopyHtoD(ptr, pattern(3, g)); err != nil {
		return err
	}
	fd, err := d.ExportFD(h)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	_, err = c.Publish(ctx, os.Getenv("NAME"), fd, g, nil)
	return err
}

// readOnGPU0Child opens NAME, a GPU 1 segment, with access for GPU 0
// only; copies it with a GPU 0 stream into GPU 0 memory, then to the
// host, and compares. A GPU that does not exist gets a clear error, not
// a crash.
func readOnGPU0Child(ctx context.Context, c *gpushm.Client) error {
	seg, err := c.Open(ctx, os.Getenv("NAME"), &gpushm.OpenOptions{Devices: []int{0}})
	if err != nil {
		return err
	}
	defer seg.Close()
	m, err := seg.Map()
	if err != nil {
		return err
	}
	d0, err := cuda.GetDevice(0)
	if err != nil {
		return err
	}
	n := seg.Info().AllocSize
	h, err := d0.Create(n)
	if err != nil {
		return err
	}
	defer d0.Release(h)
	local, err := d0.Map(h, n, false, d0)
	if err != nil {
		return err
	}
	defer d0.Unmap(local, n)
	s0, err := d0.NewStream()
	if err != nil {
		return err
	}
	defer s0.Close()
	if err := s0.CopyDtoDAsync(local, m.DevicePtr(), n); err != nil {
		return err
	}
	if err := s0.Synchronize(); err != nil {
		return err
	}
	got := make([]byte, seg.Size())
	if err := d0.CopyDtoH(got, local); err != nil {
		return err
	}
	if !bytes.Equal(got, pattern(5, seg.Size())) {
		return errors.New("GPU 0 read other bytes than GPU 1 holds")
	}
	// A GPU that does not exist gets a clear error, not a crash.
	bad, err := c.Open(ctx, os.Getenv("NAME"), &gpushm.OpenOptions{Devices: []int{7}})
	if err == nil {
		_, err = bad.Map()
		bad.Close()
	}
	if err == nil {
		return errors.New("mapping with access for GPU 7 succeeded")
	}
	return nil
}

func child(t *testing.T, socket, mode string, env ...string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "GPUSHM_TEST_CHILD="+mode, "GPUSHM_SOCKET="+socket)
	cmd.Env = append(cmd.Env, env...)
	cmd.Stderr = os.Stderr
	return cmd
}

func dial(t *testing.T, socket string) *gpushm.Client {
	t.Helper()
	c, err := gpushm.Dial(context.Background(), socket)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func usage(t *testing.T, c *gpushm.Client) gpushm.Usage {
	t.Helper()
	inf, err := c.Info(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return inf.Usage
}

func TestSecondProcessSharesBytes(t *testing.T) {
	for _, backend := range testdaemon.Backends() {
		for _, size := range []int64{1, 4096, 3<<20 + 17} {
			t.Run(fmt.Sprintf("%s/%d", backend, size), func(t *testing.T) {
				d := testdaemon.Start(t, backend)
				ctx := context.Background()
				c := dial(t, d.Socket)
				before, _ := c.Info(ctx)
				seg, err := c.Create(ctx, "shared", size, nil)
				if err != nil {
					t.Fatal(err)
				}
				m, err := seg.Map()
				if err != nil {
					t.Fatal(err)
				}
				if _, err := m.WriteAt(pattern(1, size), 0); err != nil {
					t.Fatal(err)
				}
				if err := child(t, d.Socket, "verify-and-write", "NAME=shared").Run(); err != nil {
					t.Fatalf("second process: %v", err)
				}
				got := make([]byte, size)
				if _, err := m.ReadAt(got, 0); err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(got, pattern(2, size)) {
					t.Fatal("creator does not see the second process's write")
				}
				if err := c.Unlink(ctx, "shared"); err != nil {
					t.Fatal(err)
				}
				if u := usage(t, c); u.Segments != 1 || u.Named != 0 {
					t.Fatalf("after unlink with a lease held: %+v, want 1 segment, 0 named", u)
				}
				if err := seg.Close(); err != nil {
					t.Fatal(err)
				}
				if u := usage(t, c); u.Segments != 0 || u.Bytes != 0 {
					t.Fatalf("after last close: %+v, want nothing held", u)
				}
				if backend == "cuda" {
					// The memory goes back once the supervisor has closed
					// its copy of the descriptor, which the serving
					// process's journal message makes it do after the
					// close's reply.
					var delta int64
					for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
						after, err := c.Info(ctx)
						if err != nil {
							t.Fatal(err)
						}
						delta = int64(before.Devices[0].FreeBytes) - int64(after.Devices[0].FreeBytes)
						if delta <= 64<<20 || time.Now().After(deadline) {
							break
						}
					}
					if delta > 64<<20 {
						t.Fatalf("GPU free memory %d bytes below its level before create, 5 s after the last close", delta)
					}
				}
			})
		}
	}
}

func TestKilledClientReleasesLeases(t *testing.T) {
	for _, backend := range testdaemon.Backends() {
		t.Run(backend, func(t *testing.T) {
			d := testdaemon.Start(t, backend)
			ctx := context.Background()
			c := dial(t, d.Socket)
			names := []string{"k1", "k2", "k3"}
			for _, n := range names {
				if _, _, err := c.CreateOnly(ctx, n, 1<<20, nil); err != nil {
					t.Fatal(err)
				}
			}
			cmd := child(t, d.Socket, "hold", "NAMES="+strings.Join(names, " "))
			out, _ := cmd.StdoutPipe()
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			defer cmd.Process.Kill()
			line, err := bufio.NewReader(out).ReadString('\n')
			if err != nil || line != "ready\n" {
				t.Fatalf("child said %q, %v", line, err)
			}
			for _, n := range names {
				if err := c.Unlink(ctx, n); err != nil {
					t.Fatal(err)
				}
			}
			if u := usage(t, c); u.Segments != 3 || u.Opens != 3 {
				t.Fatalf("with the child holding leases: %+v, want 3 segments, 3 opens", u)
			}
			cmd.Process.Signal(syscall.SIGKILL)
			cmd.Wait()
			deadline := time.Now().Add(10 * time.Second)
			for {
				u := usage(t, c)
				if u.Segments == 0 && u.Opens == 0 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("10s after SIGKILL the daemon still holds %+v", u)
				}
				time.Sleep(10 * time.Millisecond)
			}
		})
	}
}

func TestConcurrentClients(t *testing.T) {
	d := testdaemon.Start(t, "host")
	ctx := context.Background()
	const clients, rounds = 64, 20
	var wg sync.WaitGroup
	for i := range clients {
		wg.Go(func() {
			c, err := gpushm.Dial(ctx, d.Socket)
			if err != nil {
				t.Error(err)
				return
			}
			defer c.Close()
			for r := range rounds {
				// A name shared by all: open-or-create must give one
				// allocation; a name of our own: create, write, check, unlink.
				shared, err := c.Create(ctx, fmt.Sprint("shared-", r%4), 8192, &gpushm.CreateOptions{ExistOK: true})
				if err != nil {
					t.Errorf("client %d: %v", i, err)
					return
				}
				own := fmt.Sprintf("own-%d-%d", i, r)
				seg, err := c.Create(ctx, own, 4096, nil)
				if err != nil {
					t.Errorf("client %d: %v", i, err)
					return
				}
				m, err := seg.Map()
				if err == nil {
					m.Bytes()[0] = byte(i)
					again, err2 := c.Open(ctx, own, nil)
					if err2 == nil {
						m2, _ := again.Map()
						if m2.Bytes()[0] != byte(i) {
							t.Errorf("client %d: reopen sees %d", i, m2.Bytes()[0])
						}
						again.Close()
					}
					err = err2
				}
				if err == nil {
					err = c.Unlink(ctx, own)
				}
				seg.Close()
				shared.Close()
				if err != nil {
					t.Errorf("client %d: %v", i, err)
					return
				}
			}
		})
	}
	wg.Wait()
	c := dial(t, d.Socket)
	list, err := c.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(list) != 4 {
		t.Fatalf("%d segments left, want the 4 shared ones: %v", len(list), list)
	}
	for _, s := range list {
		if s.Opens != 0 {
			t.Errorf("%s still has %d opens", s.Name, s.Opens)
		}
		c.Unlink(ctx, s.Name)
	}
	if u := usage(t, c); u.Segments != 0 {
		t.Fatalf("daemon holds %+v after everything was closed and unlinked", u)
	}
}

func TestReopenReusesMappingUntilNameChanges(t *testing.T) {
	d := testdaemon.Start(t, "host")
	ctx := context.Background()
	c, other := dial(t, d.Socket), dial(t, d.Socket)
	a, err := c.Create(ctx, "r", 4096, nil)
	if err != nil {
		t.Fatal(err)
	}
	m1, _ := a.Map()
	b, err := c.Open(ctx, "r", nil)
	if err != nil {
		t.Fatal(err)
	}
	m2, _ := b.Map()
	if m1 != m2 {
		t.Fatal("second open of a mapped segment made a new mapping")
	}
	if st, _ := c.Stat(ctx, "r"); st.Opens != 1 {
		t.Fatalf("daemon counts %d opens, want 1 shared lease", st.Opens)
	}
	// Another process replaces the name: the cache must not hand back the
	// old segment.
	if err := other.Unlink(ctx, "r"); err != nil {
		t.Fatal(err)
	}
	if _, _, err := other.CreateOnly(ctx, "r", 4096, nil); err != nil {
		t.Fatal(err)
	}
	c3, err := c.Open(ctx, "r", nil)
	if err != nil {
		t.Fatal(err)
	}
	if c3.ID() == a.ID() {
		t.Fatal("open after unlink and re-create returned the old segment")
	}
	for _, s := range []*gpushm.Segment{a, b, c3} {
		if err := s.Close(); err != nil {
			t.Fatal(err)
		}
	}
	if u := usage(t, c); u.Segments != 1 || u.Opens != 0 {
		t.Fatalf("after closing all: %+v, want only the new segment, unopened", u)
	}
}

func TestReadOnly(t *testing.T) {
	for _, backend := range testdaemon.Backends() {
		t.Run(backend, func(t *testing.T) {
			d := testdaemon.Start(t, backend)
			ctx := context.Background()
			c := dial(t, d.Socket)
			mode := uint32(0o644)
			if _, _, err := c.CreateOnly(ctx, "ro", 4096, &gpushm.CreateOptions{Mode: &mode}); err != nil {
				t.Fatal(err)
			}
			seg, err := c.Open(ctx, "ro", &gpushm.OpenOptions{ReadOnly: true})
			if err != nil {
				t.Fatal(err)
			}
			defer seg.Close()
			m, err := seg.Map()
			if err != nil {
				t.Fatal(err)
			}
			if _, err := m.WriteAt([]byte{1}, 0); err == nil {
				t.Fatal("write to a read-only mapping succeeded")
			}
			if err := child(t, d.Socket, "readonly", "NAME=ro").Run(); err != nil {
				t.Fatalf("read-only open in a second process: %v", err)
			}
		})
	}
}

func TestErrors(t *testing.T) {
	d := testdaemon.Start(t, "host")
	ctx := context.Background()
	c := dial(t, d.Socket)
	if _, err := c.Open(ctx, "missing", nil); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("Open(missing) = %v, want fs.ErrNotExist", err)
	}
	if _, _, err := c.CreateOnly(ctx, "x", 1, nil); err != nil {
		t.Fatal(err)
	}
	if _, _, err := c.CreateOnly(ctx, "x", 1, nil); !errors.Is(err, fs.ErrExist) {
		t.Fatalf("second Create = %v, want fs.ErrExist", err)
	}
	if _, _, err := c.CreateOnly(ctx, "y", 1<<62, nil); !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("Create(1<<62) = %v, want ENOSPC (more than the device holds)", err)
	}
	dev := 5
	if _, _, err := c.CreateOnly(ctx, "y", 1, &gpushm.CreateOptions{Device: &dev}); !errors.Is(err, syscall.ENODEV) {
		t.Fatalf("Create(device 5) = %v, want ENODEV", err)
	}
	if err := c.Unlink(ctx, "a/b"); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("Unlink(a/b) = %v, want EINVAL", err)
	}
	if _, err := gpushm.Dial(ctx, d.Socket+".nope"); err == nil || !strings.Contains(err.Error(), "is 'gpushm daemon' running?") {
		t.Fatalf("Dial(nowhere) = %v", err)
	}
}

func TestListPages(t *testing.T) {
	d := testdaemon.Start(t, "host")
	ctx := context.Background()
	c := dial(t, d.Socket)
	// Long names force pages smaller than the count limit.
	const n = 700
	for i := range n {
		name := fmt.Sprintf("%04d-%s", i, strings.Repeat("n", 240))
		if _, _, err := c.CreateOnly(ctx, name, 1, nil); err != nil {
			t.Fatal(err)
		}
	}
	list, err := c.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(list) != n {
		t.Fatalf("List returned %d segments, want %d", len(list), n)
	}
	for i, s := range list {
		if !strings.HasPrefix(s.Name, fmt.Sprintf("%04d-", i)) {
			t.Fatalf("List[%d] = %.8s..., out of order", i, s.Name)
		}
	}
}

var _ = strconv.Itoa

func waitGone(t *testing.T, c *gpushm.Client, name string, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		_, err := c.Stat(context.Background(), name)
		if errors.Is(err, fs.ErrNotExist) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s still there after %v (stat: %v)", name, within, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func TestTemporarySegmentsEndWithTheirCreator(t *testing.T) {
	d := testdaemon.Start(t, "host")
	ctx := context.Background()
	c := dial(t, d.Socket)

	// A clean close.
	creator := dial(t, d.Socket)
	if _, _, err := creator.CreateOnly(ctx, "tmp", 4096, &gpushm.CreateOptions{Temporary: true}); err != nil {
		t.Fatal(err)
	}
	if st, err := c.Stat(ctx, "tmp"); err != nil || st.Lifetime != "connection" {
		t.Fatalf("Stat(tmp) = %+v, %v; want lifetime connection", st, err)
	}
	creator.Close()
	waitGone(t, c, "tmp", 5*time.Second)

	// A creator killed with SIGKILL; someone else holding it open keeps
	// the memory, not the name.
	cmd := child(t, d.Socket, "temporary", "NAME=tmp2")
	out, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	if line, err := bufio.NewReader(out).ReadString('\n'); err != nil || line != "ready\n" {
		t.Fatalf("child said %q, %v", line, err)
	}
	held, err := c.Open(ctx, "tmp2", nil)
	if err != nil {
		t.Fatal(err)
	}
	cmd.Process.Signal(syscall.SIGKILL)
	cmd.Wait()
	waitGone(t, c, "tmp2", 5*time.Second)
	if u := usage(t, c); u.Segments != 1 || u.Named != 0 {
		t.Fatalf("with the segment still open: %+v", u)
	}
	held.Close()
	if u := usage(t, c); u.Segments != 0 {
		t.Fatalf("after the last close: %+v", u)
	}
}

func TestTTLExpiry(t *testing.T) {
	d := testdaemon.Start(t, "host")
	ctx := context.Background()
	c := dial(t, d.Socket)
	if _, _, err := c.CreateOnly(ctx, "short", 4096, &gpushm.CreateOptions{TTL: 600 * time.Millisecond}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := c.CreateOnly(ctx, "kept", 4096, nil); err != nil {
		t.Fatal(err)
	}
	// Open, it does not expire, however long it stays open.
	seg, err := c.Open(ctx, "short", nil)
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(1500 * time.Millisecond)
	if _, err := c.Stat(ctx, "short"); err != nil {
		t.Fatalf("an open segment expired: %v", err)
	}
	seg.Close()
	waitGone(t, c, "short", 3*time.Second)
	if _, err := c.Stat(ctx, "kept"); err != nil {
		t.Fatalf("a segment without a TTL went: %v", err)
	}
}

func TestPublishOutlivesThePublisher(t *testing.T) {
	d := testdaemon.Start(t, "host")
	ctx := context.Background()
	c := dial(t, d.Socket)
	if err := child(t, d.Socket, "publish", "NAME=pub").Run(); err != nil {
		t.Fatalf("publisher: %v", err)
	}
	// The publisher is gone; the name and the bytes are not.
	seg, err := c.Open(ctx, "pub", &gpushm.OpenOptions{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	defer seg.Close()
	if st := seg.Info(); st.Size != 8192 || !strings.Contains(string(st.Meta), `"offset":4096`) {
		t.Fatalf("published segment = %+v", st)
	}
	m, err := seg.Map()
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(m.Bytes(), pattern(3, 8192)) {
		t.Fatal("published bytes differ")
	}
	// The daemon sealed it: nobody can shrink it under this mapping.
	if u := usage(t, c); u.Segments != 1 || u.Bytes != 8192 {
		t.Fatalf("usage = %+v", u)
	}

	// What is not a valid publish changes nothing.
	p, w, _ := os.Pipe()
	defer p.Close()
	defer w.Close()
	if _, err := c.Publish(ctx, "pipe", int(p.Fd()), 4096, nil); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("publish of a pipe = %v, want EINVAL", err)
	}
	fd, _ := unix.MemfdCreate("small", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	defer unix.Close(fd)
	unix.Ftruncate(fd, 4096)
	if _, err := c.Publish(ctx, "small", fd, 8192, nil); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("publish of 8192 bytes of a 4096-byte memfd = %v, want EINVAL", err)
	}
	if _, err := c.Publish(ctx, "pub", fd, 4096, nil); !errors.Is(err, fs.ErrExist) {
		t.Fatalf("publish over an existing name = %v, want EEXIST", err)
	}
	opath, err := unix.Open(fmt.Sprintf("/proc/self/fd/%d", fd), unix.O_PATH|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(opath)
	if _, err := c.Publish(ctx, "opath", opath, 4096, nil); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("publish of an O_PATH descriptor = %v, want EINVAL", err)
	}
	// A regular file, open read-write, shorter than a page: refused before
	// the daemon grows it to one.
	plain, err := os.OpenFile(filepath.Join(t.TempDir(), "plain"), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer plain.Close()
	plain.Write(make([]byte, 100))
	if _, err := c.Publish(ctx, "plain", int(plain.Fd()), 100, nil); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("publish of a regular file = %v, want EINVAL", err)
	}
	if st, err := plain.Stat(); err != nil || st.Size() != 100 {
		t.Fatalf("a refused publish changed the file it was sent: %v, %v", st.Size(), err)
	}
	if u := usage(t, c); u.Segments != 1 {
		t.Fatalf("failed publishes left %+v", u)
	}
}

func TestPublishCUDA(t *testing.T) {
	d := testdaemon.Start(t, "cuda") // skips without a GPU
	ctx := context.Background()
	c := dial(t, d.Socket)
	if err := child(t, d.Socket, "publish-cuda", "NAME=gpub").Run(); err != nil {
		t.Fatalf("publisher: %v", err)
	}
	seg, err := c.Open(ctx, "gpub", nil)
	if err != nil {
		t.Fatal(err)
	}
	m, err := seg.Map()
	if err != nil {
		t.Fatal(err)
	}
	got := make([]byte, m.Size())
	if _, err := m.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, pattern(3, m.Size())) {
		t.Fatal("bytes published from GPU memory by an exited process differ")
	}
	seg.Close()
	if err := c.Unlink(ctx, "gpub"); err != nil {
		t.Fatal(err)
	}
	if u := usage(t, c); u.Segments != 0 {
		t.Fatalf("after unlink: %+v", u)
	}
	// A host memfd is not a CUDA allocation.
	fd, _ := unix.MemfdCreate("x", unix.MFD_CLOEXEC)
	defer unix.Close(fd)
	unix.Ftruncate(fd, 2<<20)
	if _, err := c.Publish(ctx, "bad", fd, 2<<20, nil); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("publish of a memfd to a cuda daemon = %v, want EINVAL", err)
	}
}

func TestMultiGPUOpen(t *testing.T) {
	testdaemon.RequireBackend(t, "cuda")
	if n, _ := cuda.DeviceCount(); n < 2 {
		t.Skipf("needs two GPUs, this machine has %d", n)
	}
	d := testdaemon.Start(t, "cuda")
	ctx := context.Background()
	c := dial(t, d.Socket)
	inf, _ := c.Info(ctx)
	if len(inf.Devices) < 2 || inf.Devices[1].UUID == "" || inf.Devices[0].Name == "" {
		t.Fatalf("info lists %+v, want two GPUs with UUIDs and names", inf.Devices)
	}
	one := 1
	const size = 3<<20 + 5
	seg, err := c.Create(ctx, "on-gpu1", size, &gpushm.CreateOptions{Device: &one})
	if err != nil {
		t.Fatal(err)
	}
	defer seg.Close()
	m, err := seg.Map()
	if err != nil {
		t.Fatal(err)
	}
	if m.Device() != 1 {
		t.Fatalf("mapping on device %d, want 1", m.Device())
	}
	if _, err := m.WriteAt(pattern(5, size), 0); err != nil {
		t.Fatal(err)
	}
	if err := child(t, d.Socket, "read-on-gpu0", "NAME=on-gpu1").Run(); err != nil {
		t.Fatalf("GPU 0 reader: %v", err)
	}
}

// TestCUDAByUUID maps a cuda segment from processes that number the GPUs
// their own way: CUDA_VISIBLE_DEVICES set to the segment's GPU by UUID (its
// ordinal there is 0 whatever the daemon's), each GPU's UUID on a machine
// with several (the daemon's device n becomes the child's 0), and a GPU
// list that leaves the segment's GPU out, which must fail saying so.
func TestCUDAByUUID(t *testing.T) {
	d := testdaemon.Start(t, "cuda")
	ctx := context.Background()
	c := dial(t, d.Socket)
	inf, err := c.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, dev := range inf.Devices {
		if dev.UUID == "" {
			t.Fatalf("device %d has no UUID in info", dev.Index)
		}
		name := fmt.Sprintf("by-uuid-%d", dev.Index)
		seg, err := c.Create(ctx, name, 4<<20, &gpushm.CreateOptions{Device: &dev.Index})
		if err != nil {
			t.Fatal(err)
		}
		defer seg.Close()
		if seg.Info().UUID != dev.UUID {
			t.Fatalf("segment on device %d says GPU %q, want %q", dev.Index, seg.Info().UUID, dev.UUID)
		}
		m, err := seg.Map()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := m.WriteAt(pattern(1, m.Size()), 0); err != nil {
			t.Fatal(err)
		}
		cmd := child(t, d.Socket, "verify-and-write", "NAME="+name, "CUDA_VISIBLE_DEVICES="+dev.UUID)
		if err := cmd.Run(); err != nil {
			t.Fatalf("a process that sees only %s as its GPU 0: %v", dev.UUID, err)
		}
		got := make([]byte, m.Size())
		m.ReadAt(got, 0)
		if !bytes.Equal(got, pattern(2, m.Size())) {
			t.Fatalf("device %d: the second process's write is not in the segment", dev.Index)
		}
		var others []string
		for _, o := range inf.Devices {
			if o.Index != dev.Index {
				others = append(others, o.UUID)
			}
		}
		if len(others) == 0 {
			continue
		}
		cmd = child(t, d.Socket, "verify-and-write", "NAME="+name, "CUDA_VISIBLE_DEVICES="+strings.Join(others, ","))
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		if err := cmd.Run(); err == nil || !strings.Contains(stderr.String(), "is not among the") {
			t.Fatalf("a process that cannot see %s: %v, stderr %q; want an error naming the GPU", dev.UUID, err, stderr.String())
		}
	}
}

// TestCloseWaitsForWrites: a write from pageable memory returns once the
// driver has staged the bytes, before its DMA lands; a close that unmapped
// at once left that DMA to fault, and the fault poisoned the process's
// context for every later call (cuCtxSynchronize: LAUNCH_FAILED).
func TestCloseWaitsForWrites(t *testing.T) {
	d := testdaemon.Start(t, "cuda") // skips without a GPU
	ctx := context.Background()
	c := dial(t, d.Socket)
	dev, err := cuda.GetDevice(0)
	if err != nil {
		t.Fatal(err)
	}
	for _, size := range []int64{4096, 3<<20 + 17, 64 << 20} {
		data := pattern(7, size)
		for i := range 16 {
			name := fmt.Sprintf("w%d", i)
			seg, err := c.Create(ctx, name, size, nil)
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
			if err := seg.Close(); err != nil {
				t.Fatalf("close after a write of %d bytes: %v", size, err)
			}
			if err := c.Unlink(ctx, name); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := dev.Synchronize(); err != nil {
		t.Fatalf("the context after writes and closes: %v", err)
	}
}
