package xfer

import (
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
