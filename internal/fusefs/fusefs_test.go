package fusefs_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/backend"
	"github.com/gpushm/gpushm/internal/fusefs"
	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/server"
	"github.com/gpushm/gpushm/internal/testdaemon"
)

// requireFUSE skips, saying why, where a real mount cannot be made: these
// tests mount directly, which needs root and /dev/fuse.
func requireFUSE(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("FUSE tests mount without fusermount: they need root")
	}
	if _, err := os.Stat("/dev/fuse"); err != nil {
		t.Skipf("FUSE tests need /dev/fuse: %v", err)
	}
}

type env struct {
	dir    string
	socket string
	c      *gpushm.Client
	srv    *fusefs.Server
}

func (e *env) path(name string) string { return filepath.Join(e.dir, name) }

// mount runs a daemon (socket and FUSE view over one registry) for the
// test, and a socket client.
func mount(t *testing.T, backendName string) *env {
	t.Helper()
	return mountWith(t, backendName, nil)
}

// mountWith is mount with setup run on the daemon before it serves.
func mountWith(t *testing.T, backendName string, setup func(*server.Server, backend.Backend)) *env {
	t.Helper()
	requireFUSE(t)
	d := testdaemon.StartWith(t, backendName, setup)
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	// statfs asks a backend about its devices; a second handle on the same
	// devices answers as the daemon's would.
	b, err := backend.Open(backendName, "all", log)
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(t.TempDir(), "mnt")
	srv, err := fusefs.Mount(dir, d.Server.Registry(), b, log)
	if err != nil {
		t.Fatal(err)
	}
	c, err := gpushm.Dial(context.Background(), d.Socket)
	if err != nil {
		t.Fatal(err)
	}
	// Cleanups run last first: the client and the mount go before the
	// daemon closes the registry.
	t.Cleanup(func() {
		c.Close()
		if err := srv.Unmount(); err != nil {
			t.Errorf("Unmount: %v", err)
		}
		b.Close()
	})
	return &env{dir: dir, socket: d.Socket, c: c, srv: srv}
}

func forEachBackend(t *testing.T, fn func(t *testing.T, e *env)) {
	for _, b := range testdaemon.Backends() {
		t.Run(b, func(t *testing.T) { fn(t, mount(t, b)) })
	}
}

func random(seed uint64, n int) []byte {
	b := make([]byte, n)
	rand.NewChaCha8([32]byte{byte(seed), byte(seed >> 8), byte(n)}).Read(b)
	return b
}

// segmentBytes reads a segment through the socket: open, map, copy out.
func (e *env) segmentBytes(t *testing.T, name string) []byte {
	t.Helper()
	seg, err := e.c.Open(context.Background(), name, &gpushm.OpenOptions{ReadOnly: true})
	if err != nil {
		t.Fatalf("socket open %q: %v", name, err)
	}
	defer seg.Close()
	m, err := seg.Map()
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	if _, err := m.WriteTo(&buf); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func TestFileIsSegment(t *testing.T) {
	forEachBackend(t, func(t *testing.T, e *env) {
		for _, size := range []int{1, 4095, 4096, 1<<20 + 1, 3<<20 + 17} {
			name := fmt.Sprint("f", size)
			data := random(1, size)
			if err := os.WriteFile(e.path(name), data, 0o640); err != nil {
				t.Fatal(err)
			}
			got, err := os.ReadFile(e.path(name))
			if err != nil || !bytes.Equal(got, data) {
				t.Fatalf("read back %d bytes: %d bytes, %v; equal %v", size, len(got), err, bytes.Equal(got, data))
			}
			if got := e.segmentBytes(t, name); !bytes.Equal(got, data) {
				t.Fatalf("socket client read %d bytes, not what was written (%d bytes)", len(got), size)
			}
			inf, err := e.c.Stat(context.Background(), name)
			if err != nil {
				t.Fatal(err)
			}
			if inf.Size != int64(size) || inf.Mode != 0o640 || inf.AllocSize < inf.Size {
				t.Fatalf("stat %s = %+v", name, inf)
			}
			st, err := os.Stat(e.path(name))
			if err != nil || st.Size() != int64(size) || st.Mode() != 0o640 {
				t.Fatalf("os.Stat = %v, %v", st, err)
			}
			if ino := st.Sys().(*syscall.Stat_t).Ino; ino != inf.ID {
				t.Fatalf("inode %d, segment id %d", ino, inf.ID)
			}
		}
	})
}

func TestSegmentIsFile(t *testing.T) {
	forEachBackend(t, func(t *testing.T, e *env) {
		ctx := context.Background()
		data := random(2, 5<<20+3)
		seg, err := e.c.Create(ctx, "made-by-socket", int64(len(data)), &gpushm.CreateOptions{Meta: []byte(`{"dtype":"u8"}`)})
		if err != nil {
			t.Fatal(err)
		}
		m, err := seg.Map()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := m.ReadFrom(bytes.NewReader(data)); err != nil {
			t.Fatal(err)
		}
		seg.Close()
		got, err := os.ReadFile(e.path("made-by-socket"))
		if err != nil || !bytes.Equal(got, data) {
			t.Fatalf("read through FUSE: %d bytes, %v", len(got), err)
		}
		ents, err := os.ReadDir(e.dir)
		if err != nil || len(ents) != 1 || ents[0].Name() != "made-by-socket" {
			t.Fatalf("ReadDir = %v, %v", ents, err)
		}
	})
}

func TestEmptyFile(t *testing.T) {
	forEachBackend(t, func(t *testing.T, e *env) {
		ctx := context.Background()
		f, err := os.Create(e.path("empty"))
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if st, _ := f.Stat(); st.Size() != 0 {
			t.Fatalf("new file has size %d", st.Size())
		}
		if _, err := e.c.Open(ctx, "empty", nil); !errors.Is(err, syscall.EINVAL) {
			t.Fatalf("socket open of an empty file = %v, want EINVAL", err)
		}
		if inf, err := e.c.Stat(ctx, "empty"); err != nil || inf.Size != 0 || inf.AllocSize != 0 {
			t.Fatalf("socket stat = %+v, %v", inf, err)
		}
		if err := f.Truncate(10); err != nil {
			t.Fatal(err)
		}
		if got := e.segmentBytes(t, "empty"); !bytes.Equal(got, make([]byte, 10)) {
			t.Fatalf("after truncate: %q", got)
		}
	})
}

func TestTruncate(t *testing.T) {
	forEachBackend(t, func(t *testing.T, e *env) {
		data := random(3, 3<<20)
		p := e.path("t")
		if err := os.WriteFile(p, data, 0o600); err != nil {
			t.Fatal(err)
		}
		for _, size := range []int{5 << 20, 1000, 0, 7, 4 << 20} {
			if err := os.Truncate(p, int64(size)); err != nil {
				t.Fatalf("truncate %d: %v", size, err)
			}
			want := make([]byte, size)
			copy(want, data[:min(len(data), size)])
			got, err := os.ReadFile(p)
			if err != nil || !bytes.Equal(got, want) {
				t.Fatalf("after truncate to %d: %d bytes, %v", size, len(got), err)
			}
			data = want
		}
		// A write far past the end leaves zeros between.
		f, _ := os.OpenFile(p, os.O_WRONLY, 0)
		if _, err := f.WriteAt([]byte("end"), 9<<20); err != nil {
			t.Fatal(err)
		}
		f.Close()
		got, _ := os.ReadFile(p)
		if len(got) != 9<<20+3 || !bytes.Equal(got[4<<20:9<<20], make([]byte, 5<<20)) || string(got[9<<20:]) != "end" {
			t.Fatal("write past the end did not zero the gap")
		}
		// fallocate extends with zeros.
		f, _ = os.OpenFile(p, os.O_RDWR, 0)
		defer f.Close()
		if err := unix.Fallocate(int(f.Fd()), 0, 0, 10<<20); err != nil {
			t.Fatal(err)
		}
		if st, _ := f.Stat(); st.Size() != 10<<20 {
			t.Fatalf("after fallocate: size %d", st.Size())
		}
	})
}

// TestWriteWhileOpenElsewhere: a socket client maps a file that is being
// written. Writes within the file land in the memory the client maps;
// growing it is refused while the client holds it.
func TestWriteWhileOpenElsewhere(t *testing.T) {
	forEachBackend(t, func(t *testing.T, e *env) {
		f, err := os.OpenFile(e.path("w"), os.O_CREATE|os.O_RDWR, 0o600)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if _, err := f.Write(random(4, 2<<20)); err != nil {
			t.Fatal(err)
		}
		seg, err := e.c.Open(context.Background(), "w", nil)
		if err != nil {
			t.Fatal(err)
		}
		m, err := seg.Map()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := f.WriteAt([]byte("seen by the client"), 1<<20); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, 18)
		if _, err := m.ReadAt(got, 1<<20); err != nil || string(got) != "seen by the client" {
			t.Fatalf("client reads %q, %v", got, err)
		}
		if _, err := m.WriteAt([]byte("written by client"), 0); err != nil {
			t.Fatal(err)
		}
		back := make([]byte, 17)
		if _, err := f.ReadAt(back, 0); err != nil || string(back) != "written by client" {
			t.Fatalf("FUSE reads %q, %v", back, err)
		}
		if _, err := f.WriteAt([]byte("x"), 2<<20); !errors.Is(err, syscall.EBUSY) {
			t.Fatalf("growing write while open elsewhere = %v, want EBUSY", err)
		}
		if err := f.Truncate(1); !errors.Is(err, syscall.EBUSY) {
			t.Fatalf("truncate while open elsewhere = %v, want EBUSY", err)
		}
		seg.Close()
		if _, err := f.WriteAt([]byte("x"), 2<<20); err != nil {
			t.Fatalf("growing write after the client closed = %v", err)
		}
	})
}

func TestUnlinkWhileOpen(t *testing.T) {
	forEachBackend(t, func(t *testing.T, e *env) {
		ctx := context.Background()
		data := random(5, 3<<20)
		if err := os.WriteFile(e.path("u"), data, 0o600); err != nil {
			t.Fatal(err)
		}
		f, err := os.Open(e.path("u"))
		if err != nil {
			t.Fatal(err)
		}
		seg, err := e.c.Open(ctx, "u", &gpushm.OpenOptions{ReadOnly: true})
		if err != nil {
			t.Fatal(err)
		}
		m, _ := seg.Map()
		if err := os.Remove(e.path("u")); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(e.path("u")); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("stat after rm = %v", err)
		}
		got, err := io.ReadAll(f)
		if err != nil || !bytes.Equal(got, data) {
			t.Fatalf("read of the unlinked file: %d bytes, %v", len(got), err)
		}
		var buf bytes.Buffer
		m.WriteTo(&buf)
		if !bytes.Equal(buf.Bytes(), data) {
			t.Fatal("client lost the bytes of the unlinked file")
		}
		f.Close()
		info, _ := e.c.Info(ctx)
		if info.Usage.Segments != 1 || info.Usage.Named != 0 {
			t.Fatalf("usage with the client's lease = %+v", info.Usage)
		}
		seg.Close()
		// The kernel sends RELEASE after close(2) has returned.
		waitFor(t, "memory freed after the last close", func() bool {
			info, _ = e.c.Info(ctx)
			return info.Usage.Segments == 0 && info.Usage.Bytes == 0
		})
	})
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("gave up waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

func TestRename(t *testing.T) {
	forEachBackend(t, func(t *testing.T, e *env) {
		ctx := context.Background()
		os.WriteFile(e.path("a"), []byte("aaaa"), 0o600)
		os.WriteFile(e.path("b"), []byte("bb"), 0o600)
		// The client caches the open of a; the rename must make it ask again.
		seg, err := e.c.Open(ctx, "a", &gpushm.OpenOptions{ReadOnly: true})
		if err != nil {
			t.Fatal(err)
		}
		seg.Close()
		if err := unix.Renameat2(unix.AT_FDCWD, e.path("a"), unix.AT_FDCWD, e.path("b"), unix.RENAME_NOREPLACE); !errors.Is(err, syscall.EEXIST) {
			t.Fatalf("rename NOREPLACE = %v, want EEXIST", err)
		}
		if err := unix.Renameat2(unix.AT_FDCWD, e.path("a"), unix.AT_FDCWD, e.path("b"), unix.RENAME_EXCHANGE); err != nil {
			t.Fatal(err)
		}
		if got, _ := os.ReadFile(e.path("a")); string(got) != "bb" {
			t.Fatalf("a after exchange = %q", got)
		}
		if err := os.Rename(e.path("a"), e.path("c")); err != nil {
			t.Fatal(err)
		}
		if _, err := e.c.Stat(ctx, "a"); !errors.Is(err, syscall.ENOENT) {
			t.Fatalf("socket stat of the old name = %v", err)
		}
		if got := e.segmentBytes(t, "c"); string(got) != "bb" {
			t.Fatalf("socket read of the new name = %q", got)
		}
		if got := e.segmentBytes(t, "b"); string(got) != "aaaa" {
			t.Fatalf("socket read of b = %q", got)
		}
		if err := os.Rename(e.path("c"), e.path("b")); err != nil {
			t.Fatal(err)
		}
		if ents, _ := os.ReadDir(e.dir); len(ents) != 1 {
			t.Fatalf("after renaming over b: %v", ents)
		}
	})
}

func TestChmodChown(t *testing.T) {
	forEachBackend(t, func(t *testing.T, e *env) {
		ctx := context.Background()
		p := e.path("m")
		os.WriteFile(p, []byte("m"), 0o600)
		if err := os.Chmod(p, 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Chown(p, 1234, 5678); err != nil {
			t.Fatal(err)
		}
		inf, _ := e.c.Stat(ctx, "m")
		if inf.Mode != 0o644 || inf.UID != 1234 || inf.GID != 5678 {
			t.Fatalf("socket stat after chmod/chown = %+v", inf)
		}
		st, _ := os.Stat(p)
		if s := st.Sys().(*syscall.Stat_t); st.Mode() != 0o644 || s.Uid != 1234 || s.Gid != 5678 {
			t.Fatalf("stat = %v %d:%d", st.Mode(), s.Uid, s.Gid)
		}
		if err := os.Chmod(p, 0o000); err != nil {
			t.Fatal(err)
		}
		if st, _ := os.Stat(p); st.Mode() != 0 {
			t.Fatalf("mode 0 shows as %v", st.Mode())
		}
		if err := unix.Chmod(p, 0o4755); !errors.Is(err, syscall.EINVAL) {
			t.Fatalf("chmod setuid = %v, want EINVAL", err)
		}
	})
}

func TestXattrs(t *testing.T) {
	forEachBackend(t, func(t *testing.T, e *env) {
		ctx := context.Background()
		p := e.path("x")
		os.WriteFile(p, random(6, 100), 0o600)
		inf, _ := e.c.Stat(ctx, "x")
		get := func(name string) (string, error) {
			b := make([]byte, 256)
			n, err := unix.Getxattr(p, name, b)
			if err != nil {
				return "", err
			}
			return string(b[:n]), nil
		}
		want := map[string]string{
			"user.gpushm.id":          strconv.FormatUint(inf.ID, 10),
			"user.gpushm.device":      strconv.Itoa(inf.Device),
			"user.gpushm.alloc_size":  strconv.FormatInt(inf.AllocSize, 10),
			"user.allocation_size":    strconv.FormatInt(inf.AllocSize, 10),
			"user.gpushm.handle_type": inf.HandleType,
		}
		for k, v := range want {
			if got, err := get(k); got != v || err != nil {
				t.Errorf("%s = %q, %v; want %q", k, got, err, v)
			}
		}
		if _, err := get("user.gpushm.meta"); !errors.Is(err, unix.ENODATA) {
			t.Fatalf("meta of a file without = %v, want ENODATA", err)
		}
		if _, err := get("user.fabric_handle"); !errors.Is(err, unix.ENODATA) {
			t.Fatalf("fabric handle = %v, want ENODATA (POSIX fd handles only)", err)
		}
		if err := unix.Setxattr(p, "user.gpushm.meta", []byte(`{"dtype":"f32","shape":[25]}`), 0); err != nil {
			t.Fatal(err)
		}
		if inf, _ := e.c.Stat(ctx, "x"); string(inf.Meta) != `{"dtype":"f32","shape":[25]}` {
			t.Fatalf("socket meta = %s", inf.Meta)
		}
		if err := unix.Setxattr(p, "user.gpushm.id", []byte("7"), 0); !errors.Is(err, syscall.EPERM) {
			t.Fatalf("setting the id = %v, want EPERM", err)
		}
		if err := unix.Setxattr(p, "user.gpushm.meta", []byte(`{`), 0); !errors.Is(err, syscall.EINVAL) {
			t.Fatalf("bad meta = %v, want EINVAL", err)
		}
		b := make([]byte, 1024)
		n, err := unix.Listxattr(p, b)
		if err != nil {
			t.Fatal(err)
		}
		if got := string(b[:n]); got != "user.gpushm.id\x00user.gpushm.device\x00user.gpushm.alloc_size\x00user.gpushm.handle_type\x00user.allocation_size\x00user.gpushm.meta\x00" {
			t.Fatalf("listxattr = %q", got)
		}
		if err := unix.Removexattr(p, "user.gpushm.meta"); err != nil {
			t.Fatal(err)
		}
		if inf, _ := e.c.Stat(ctx, "x"); len(inf.Meta) != 0 {
			t.Fatalf("meta after removexattr = %s", inf.Meta)
		}
	})
}

func TestStatfs(t *testing.T) {
	forEachBackend(t, func(t *testing.T, e *env) {
		info, err := e.c.Info(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		var st unix.Statfs_t
		if err := unix.Statfs(e.dir, &st); err != nil {
			t.Fatal(err)
		}
		total := st.Blocks * uint64(st.Bsize)
		if want := info.Devices[0].TotalBytes; total > want || want-total >= uint64(st.Bsize) {
			t.Fatalf("statfs total %d, device %d", total, want)
		}
		if st.Bfree == 0 || st.Bfree > st.Blocks || st.Namelen != 255 {
			t.Fatalf("statfs = %+v", st)
		}
	})
}

func TestPermissionsInMount(t *testing.T) {
	forEachBackend(t, func(t *testing.T, e *env) {
		if err := os.Mkdir(e.path("d"), 0o755); !errors.Is(err, syscall.EPERM) {
			t.Fatalf("mkdir = %v, want EPERM", err)
		}
		if err := os.Symlink("x", e.path("l")); !errors.Is(err, syscall.EPERM) {
			t.Fatalf("symlink = %v, want EPERM", err)
		}
		st, err := os.Stat(e.dir)
		if err != nil || st.Mode()&os.ModePerm != 0o777 || st.Mode()&os.ModeSticky == 0 {
			t.Fatalf("root dir mode %v, %v; want drwxrwxrwt", st.Mode(), err)
		}
		// Open checks the registry's mode even for root's view of it: mode
		// 0 is still readable by root, but not executable.
		os.WriteFile(e.path("p"), []byte("p"), 0o000)
		if err := unix.Access(e.path("p"), unix.X_OK); !errors.Is(err, syscall.EACCES) {
			t.Fatalf("access X of mode 0 = %v, want EACCES", err)
		}
		if err := unix.Access(e.path("p"), unix.R_OK|unix.W_OK); err != nil {
			t.Fatalf("root access RW = %v", err)
		}
	})
}

// TestConcurrent runs, at once: writers and readers each on their own
// file, several writers on disjoint stripes of one shared file through
// separate descriptors, readers of that file, and socket clients opening
// the shared file while it is written. Run with -race.
func TestConcurrent(t *testing.T) {
	forEachBackend(t, func(t *testing.T, e *env) {
		const stripe, stripes = 256 << 10, 6
		shared := e.path("shared")
		if err := os.WriteFile(shared, make([]byte, stripe*stripes), 0o666); err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		for w := range 4 {
			wg.Go(func() {
				name := e.path(fmt.Sprint("own", w))
				for round := range 3 {
					data := random(uint64(10*w+round), 2<<20+w*4099)
					f, err := os.Create(name)
					if err != nil {
						t.Error(err)
						return
					}
					for off := 0; off < len(data); off += 128 << 10 {
						if _, err := f.Write(data[off:min(len(data), off+128<<10)]); err != nil {
							t.Error(err)
						}
					}
					f.Close()
					if got, err := os.ReadFile(name); err != nil || !bytes.Equal(got, data) {
						t.Errorf("file %d round %d: %d bytes back, %v", w, round, len(got), err)
					}
				}
			})
		}
		for w := range stripes {
			wg.Go(func() {
				f, err := os.OpenFile(shared, os.O_RDWR, 0)
				if err != nil {
					t.Error(err)
					return
				}
				defer f.Close()
				got := make([]byte, stripe)
				for round := range 4 {
					data := bytes.Repeat([]byte{byte(w*16 + round)}, stripe)
					if _, err := f.WriteAt(data, int64(w*stripe)); err != nil {
						t.Error(err)
						return
					}
					if _, err := f.ReadAt(got, int64(w*stripe)); err != nil || !bytes.Equal(got, data) {
						t.Errorf("stripe %d round %d: read back differs (%v)", w, round, err)
						return
					}
				}
			})
		}
		wg.Go(func() {
			for range 20 {
				if got, err := os.ReadFile(shared); err != nil || len(got) != stripe*stripes {
					t.Errorf("reader: %d bytes, %v", len(got), err)
					return
				}
			}
		})
		wg.Go(func() {
			c, err := gpushm.Dial(context.Background(), e.socket)
			if err != nil {
				t.Error(err)
				return
			}
			defer c.Close()
			for range 20 {
				seg, err := c.Open(context.Background(), "shared", &gpushm.OpenOptions{ReadOnly: true})
				if err != nil {
					t.Errorf("socket open while written: %v", err)
					return
				}
				if m, err := seg.Map(); err != nil || m.Size() != stripe*stripes {
					t.Errorf("map: %v", err)
				}
				seg.Close()
			}
		})
		wg.Wait()
		got, _ := os.ReadFile(shared)
		for w := range stripes {
			if want := bytes.Repeat([]byte{byte(w*16 + 3)}, stripe); !bytes.Equal(got[w*stripe:(w+1)*stripe], want) {
				t.Fatalf("stripe %d does not hold its last write", w)
			}
		}
	})
}

// TestStaleMount: a mount whose daemon died (here: its FUSE connection
// aborted) is cleaned when the next daemon mounts there.
func TestStaleMount(t *testing.T) {
	requireFUSE(t)
	d := testdaemon.Start(t, "host")
	b, _ := backend.Open("host", "all", nil)
	dir := filepath.Join(t.TempDir(), "mnt")
	first, err := fusefs.Mount(dir, d.Server.Registry(), b, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { first.Unmount() })
	if _, err := fusefs.Mount(dir, d.Server.Registry(), b, nil); err == nil {
		t.Fatal("a second mount over a live view succeeded")
	}
	abortConnection(t, dir)
	if _, err := os.Stat(dir); !errors.Is(err, syscall.ENOTCONN) {
		t.Fatalf("stat of the dead mount = %v, want ENOTCONN", err)
	}
	srv, err := fusefs.Mount(dir, d.Server.Registry(), b, nil)
	if err != nil {
		t.Fatalf("mount over a stale mount: %v", err)
	}
	defer srv.Unmount()
	if err := os.WriteFile(filepath.Join(dir, "alive"), []byte("y"), 0o600); err != nil {
		t.Fatal(err)
	}
}

// abortConnection kills the FUSE connection of the mount at dir through
// /sys/fs/fuse/connections, as the death of its daemon would.
func abortConnection(t *testing.T, dir string) {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		t.Fatal(err)
	}
	abort := fmt.Sprintf("/sys/fs/fuse/connections/%d/abort", unix.Minor(st.Dev))
	if _, err := os.Stat(abort); errors.Is(err, os.ErrNotExist) {
		// fusectl is not mounted; mount it (it is one per kernel).
		unix.Mount("fusectl", "/sys/fs/fuse/connections", "fusectl", 0, "")
	}
	if _, err := os.Stat(abort); err != nil {
		t.Skipf("cannot abort the FUSE connection (no fusectl): %v", err)
	}
	if err := os.WriteFile(abort, []byte("1"), 0o200); err != nil {
		t.Fatal(err)
	}
}

// TestEvictedFile: a segment evicted to host memory is read and written
// through the FUSE view where it lies, its host copy, without coming back
// to its device; a write past its end grows it there. The next open
// through the socket brings back what the files said.
func TestEvictedFile(t *testing.T) {
	forEachBackend(t, func(t *testing.T, e *env) {
		ctx := context.Background()
		data := random(7, 3<<20+5)
		if err := os.WriteFile(e.path("w"), data, 0o600); err != nil {
			t.Fatal(err)
		}
		tier := func() string {
			t.Helper()
			inf, err := e.c.Stat(ctx, "w")
			if err != nil {
				t.Fatal(err)
			}
			return inf.Tier
		}
		// The kernel releases the file written above a moment after
		// close: until then the daemon holds it, and it may not move.
		var err error
		waitFor(t, "the view to let go of the file", func() bool {
			_, err = e.c.Evict(ctx, "w")
			return !errors.Is(err, syscall.EBUSY)
		})
		if err != nil || tier() != "host" {
			t.Fatalf("evict: %v, tier %q", err, tier())
		}
		got, err := os.ReadFile(e.path("w"))
		if err != nil || !bytes.Equal(got, data) || tier() != "host" {
			t.Fatalf("read through the view: equal %v, %v; tier %q after", bytes.Equal(got, data), err, tier())
		}
		f, err := os.OpenFile(e.path("w"), os.O_WRONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		patch := random(8, 1000)
		if _, err := f.WriteAt(patch, 4096); err != nil {
			t.Fatal(err)
		}
		tail := random(9, 1<<20)
		if _, err := f.WriteAt(tail, int64(len(data))); err != nil {
			t.Fatal(err)
		}
		if err := f.Close(); err != nil {
			t.Fatal(err)
		}
		copy(data[4096:], patch)
		data = append(data, tail...)
		if tier() != "host" {
			t.Fatalf("a write through the view moved it: tier %q", tier())
		}
		if got := e.segmentBytes(t, "w"); !bytes.Equal(got[:len(data)], data) || tier() != "gpu" {
			t.Fatalf("open after the writes: equal %v, tier %q", bytes.Equal(got[:len(data)], data), tier())
		}
	})
}

// TestCopyUnderBudget: a file copied into the view grows under the
// device's budget as a create would: the least recently opened segment
// goes to host memory to make room, and the device never holds more than
// its budget, counting the old memory and the new while a growing file's
// bytes are copied over (on GPU memory), or what it grows by (host memory
// grows in place): 6 MiB grows from 4 to 8 MiB with both held, 10 MiB
// from 8 to 16 in place, either too much beside the 8 MiB already there.
func TestCopyUnderBudget(t *testing.T) {
	const budget = 16 << 20
	for _, b := range testdaemon.Backends() {
		t.Run(b, func(t *testing.T) {
			var reg *segment.Registry
			e := mountWith(t, b, func(srv *server.Server, be backend.Backend) {
				host, err := backend.NewHost()
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { host.Close() })
				reg = srv.Registry()
				reg.SetTiers(segment.Tiers{Budgets: map[int]int64{0: budget}, HostBudget: 1 << 30,
					Spill: backend.NewSpill(host, 0), Mover: be.(segment.Mover)})
			})
			ctx := context.Background()
			old := random(10, 8<<20)
			s, err := e.c.Create(ctx, "old", int64(len(old)), nil)
			if err != nil {
				t.Fatal(err)
			}
			m, err := s.Map()
			if err == nil {
				_, err = m.WriteAt(old, 0)
			}
			s.Close()
			if err != nil {
				t.Fatal(err)
			}
			size := 6<<20 + 3
			if b == "host" {
				size = 10<<20 + 3
			}
			data := random(11, size)
			if err := os.WriteFile(e.path("new"), data, 0o600); err != nil {
				t.Fatalf("copy into the view: %v", err)
			}
			inf, err := e.c.Stat(ctx, "old")
			if err != nil || inf.Tier != "host" {
				t.Fatalf("the segment the copy made room with: %+v, %v; want it on host", inf, err)
			}
			if st := reg.TierStats(); st.Devices[0].Peak > budget {
				t.Fatalf("the device held %d bytes at its peak, over its budget of %d", st.Devices[0].Peak, budget)
			}
			if got := e.segmentBytes(t, "new"); !bytes.Equal(got[:len(data)], data) {
				t.Fatal("the copied file's bytes differ")
			}
			if got := e.segmentBytes(t, "old"); !bytes.Equal(got[:len(old)], old) {
				t.Fatal("the evicted segment's bytes differ")
			}
		})
	}
}
