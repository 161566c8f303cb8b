package xfer

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// TestResidency checks both ways of asking the page cache, on a file just
// written (cached) and after asking the kernel to drop it.
func TestResidency(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "f")
	const size = 4 << 20
	if err := os.WriteFile(path, make([]byte, size), 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var fs unix.Statfs_t
	if err := unix.Statfs(dir, &fs); err != nil {
		t.Fatal(err)
	}
	ways := map[string]func() residency{
		"mincore":   func() residency { return newMincore(f, size) },
		"cachestat": func() residency { return &cachestat{fd: int(f.Fd())} },
	}
	for name, ask := range ways {
		t.Run(name, func(t *testing.T) {
			if c, ok := ask().(*cachestat); ok && !c.ok() {
				t.Skip("no cachestat(2) in this kernel (Linux 6.5 and later)")
			}
			if _, err := f.Read(make([]byte, size)); err != nil { // into the cache
				t.Fatal(err)
			}
			f.Seek(0, 0)
			r := ask()
			if r == nil || !r.cached(0, size) || !r.cached(size-100, 100) {
				t.Fatalf("%s: a file just read is not seen in the page cache", name)
			}
			if fs.Type == unix.TMPFS_MAGIC {
				t.Skip("tmpfs pages are the file; they cannot be dropped")
			}
			if err := f.Sync(); err != nil {
				t.Fatal(err)
			}
			if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
				t.Fatal(err)
			}
			if r := ask(); r.cached(0, size) {
				t.Errorf("%s: the file is still seen in the page cache after FADV_DONTNEED", name)
			}
		})
	}
}

// A store into a file on tmpfs makes the file's pages ahead of its writes
// (allocateAhead): the bytes and the size are what the writes alone would
// leave, into a new file and into the middle of a longer one.
func TestStoreIntoTmpfs(t *testing.T) {
	dir := "/dev/shm"
	var fs unix.Statfs_t
	if unix.Statfs(dir, &fs) != nil || fs.Type != unix.TMPFS_MAGIC {
		t.Skip("no tmpfs at /dev/shm")
	}
	const size = 40 << 20
	src := make([]byte, size)
	for i := range src {
		src[i] = byte(i*7 + i>>16)
	}
	for _, c := range []struct {
		name       string
		before     int // the file's length before, of 0xAA
		off, at, n int64
		wantSize   int64
	}{
		{"new file", 0, 0, 0, size, size},
		{"at an offset of a new file", 0, 3 << 20, 1 << 20, 9 << 20, 12 << 20},
		{"inside a longer file", 30 << 20, 5 << 20, 2 << 20, 10 << 20, 30 << 20},
	} {
		t.Run(c.name, func(t *testing.T) {
			f, err := os.CreateTemp(dir, "gpushm-xfer-test-*")
			if err != nil {
				t.Fatal(err)
			}
			defer os.Remove(f.Name())
			defer f.Close()
			want := make([]byte, max(c.before, int(c.off+c.n)))
			for i := range c.before {
				want[i] = 0xAA
			}
			if _, err := f.Write(want[:c.before]); err != nil {
				t.Fatal(err)
			}
			copy(want[c.off:], src[c.at:c.at+c.n])
			r := []Range{{File: f, Off: c.off, Len: c.n, At: c.at}}
			if _, err := Store(context.Background(), Target{Host: src, Size: size}, r, &Options{Chunk: 1 << 20}); err != nil {
				t.Fatal(err)
			}
			got, err := os.ReadFile(f.Name())
			if err != nil {
				t.Fatal(err)
			}
			if int64(len(got)) != c.wantSize {
				t.Fatalf("file is %d bytes, want %d", len(got), c.wantSize)
			}
			if !bytes.Equal(got, want) {
				t.Fatal("the file's bytes differ from what was stored")
			}
		})
	}
}

func TestAllocateAhead(t *testing.T) {
	f, err := os.CreateTemp("/dev/shm", "gpushm-xfer-test-*")
	if err != nil {
		t.Skip("no /dev/shm")
	}
	defer os.Remove(f.Name())
	defer f.Close()
	var fs unix.Statfs_t
	if unix.Fstatfs(int(f.Fd()), &fs) != nil || fs.Type != unix.TMPFS_MAGIC {
		t.Skip("/dev/shm is not tmpfs")
	}
	stopped := make(chan struct{})
	close(stopped)
	allocateAhead(f, 0, 8<<20, stopped)
	if st, _ := f.Stat(); st.Size() != 0 {
		t.Fatalf("a stopped allocation made the file %d bytes", st.Size())
	}
	allocateAhead(f, 1<<20, 9<<20, make(chan struct{}))
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		t.Fatal(err)
	}
	if st.Size != 9<<20 || st.Blocks*512 < 8<<20 {
		t.Fatalf("after allocating [1 MiB, 9 MiB): %d bytes, %d allocated", st.Size, st.Blocks*512)
	}
}
