package disk

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

// mountTmpfs mounts a tmpfs with opts on a new directory, unmounted when
// the test ends; it skips, saying why, where it cannot.
func mountTmpfs(t *testing.T, opts string) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("mounting a small or read-only file system needs root")
	}
	dir := t.TempDir()
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, opts); err != nil {
		t.Skipf("mount -t tmpfs -o %s: %v", opts, err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
			t.Errorf("umount %s: %v", dir, err)
		}
	})
	return dir
}

// TestOpenRefuses gives Open directories it must refuse, each with an
// error that says what is wrong, and some it must take.
func TestOpenRefuses(t *testing.T) {
	for _, tc := range []struct {
		name string
		root bool // needs root
		make func(t *testing.T, base string) []string
		says string // in the error; "" for an Open that succeeds
	}{
		{"missing parent", false, func(t *testing.T, b string) []string { return []string{b + "/no/such"} }, "parent must exist"},
		{"missing, parent there: made", false, func(t *testing.T, b string) []string { return []string{b + "/new"} }, ""},
		{"a file", false, func(t *testing.T, b string) []string { return []string{mkfile(t, b+"/f")} }, "not a directory"},
		{"a symbolic link", false, func(t *testing.T, b string) []string {
			mkdir(t, b+"/real", 0o700)
			symlink(t, "real", b+"/link")
			return []string{b + "/link"}
		}, "symbolic link"},
		{"group-writable", false, func(t *testing.T, b string) []string { return []string{mkdir(t, b+"/d", 0o770)} }, "writable by others"},
		{"world-writable, sticky", false, func(t *testing.T, b string) []string { return []string{mkdir(t, b+"/d", 0o1777)} }, "writable by others"},
		{"readable by others: narrowed", false, func(t *testing.T, b string) []string { return []string{mkdir(t, b+"/d", 0o755)} }, ""},
		{"another user's", true, func(t *testing.T, b string) []string {
			d := mkdir(t, b+"/d", 0o700)
			if err := os.Chown(d, 65013, 65013); err != nil {
				t.Fatal(err)
			}
			return []string{d}
		}, "owned by uid 65013"},
		{"the same directory twice", false, func(t *testing.T, b string) []string {
			d := mkdir(t, b+"/d", 0o700)
			return []string{d, d + "/."}
		}, "same directory"},
		{"read-only file system", true, func(t *testing.T, b string) []string {
			return []string{mountTmpfs(t, "ro,size=1m,mode=0700")}
		}, "does not take writes"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.root && os.Geteuid() != 0 {
				t.Skip("needs root")
			}
			base := tempDirs(t, "/var/tmp", 1)[0]
			mkdir(t, base, 0o700)
			dirs := tc.make(t, base)
			s, err := Open(dirs, Options{Log: quiet})
			if tc.says == "" {
				if err != nil {
					t.Fatalf("Open = %v", err)
				}
				defer s.Close()
				if st, err := os.Stat(dirs[0]); err != nil || st.Mode().Perm() != 0o700 {
					t.Errorf("the directory's mode after Open: %v, %v; want 0700", st.Mode(), err)
				}
				return
			}
			if err == nil {
				s.Close()
				t.Fatalf("Open(%q) succeeded, want it refused (%s)", dirs, tc.says)
			}
			if !strings.Contains(err.Error(), tc.says) || !strings.Contains(err.Error(), filepath.Clean(dirs[len(dirs)-1])) {
				t.Errorf("Open = %v, want it to say %q and name the directory", err, tc.says)
			}
		})
	}
}

func mkdir(t *testing.T, path string, mode os.FileMode) string {
	t.Helper()
	if err := os.MkdirAll(path, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(path, mode); err != nil {
		t.Fatal(err)
	}
	return path
}

func mkfile(t *testing.T, path string) string {
	t.Helper()
	os.MkdirAll(filepath.Dir(path), 0o700)
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

func symlink(t *testing.T, target, path string) {
	t.Helper()
	if err := os.Symlink(target, path); err != nil {
		t.Fatal(err)
	}
}

// TestOneStoreADirectory: a second store, in this process or another,
// cannot open a directory in use: its recovery would remove the first's
// writes in flight.
func TestOneStoreADirectory(t *testing.T) {
	dirs := tempDirs(t, "/var/tmp", 2)
	open(t, dirs, Options{})
	_, err := Open(dirs[1:], Options{Log: quiet})
	if err == nil || !strings.Contains(err.Error(), "in use") {
		t.Errorf("second Open = %v, want the directory in use", err)
	}
}

// TestPlantedLinks plays someone who replaces a store's files with
// symbolic links (to the same bytes, elsewhere): nothing is followed.
func TestPlantedLinks(t *testing.T) {
	dirs := tempDirs(t, "/var/tmp", 1)
	s := open(t, dirs, Options{Chunk: testChunk})
	want := pattern(2*testChunk, 1)
	e := write(t, s, "k", want, "")
	elsewhere := t.TempDir()
	for _, f := range e.Files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		mkfileWith(t, filepath.Join(elsewhere, filepath.Base(f)), b)
		os.Remove(f)
		symlink(t, filepath.Join(elsewhere, filepath.Base(f)), f)
	}
	_, err := s.Read(context.Background(), "k", checkSink{t, want})
	if !errors.Is(err, syscall.ELOOP) || !strings.Contains(err.Error(), e.Files[1]) {
		t.Errorf("Read through a planted link = %v, want ELOOP naming %s", err, e.Files[1])
	}
	s.Close()
	// At Open: links are left alone, not taken for the copy, not removed.
	s = open(t, dirs, Options{Chunk: testChunk})
	if _, err := s.Stat("k"); !errors.Is(err, ErrNotExist) {
		t.Errorf("Stat of a copy whose files are links = %v, want ErrNotExist", err)
	}
	for _, f := range e.Files {
		if st, err := os.Lstat(f); err != nil || st.Mode()&os.ModeSymlink == 0 {
			t.Errorf("%s after Open: %v, %v; want the link left", f, st, err)
		}
	}
}

func mkfileWith(t *testing.T, path string, b []byte) {
	t.Helper()
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
}

// TestFilesOfAnotherUser: a data file that is not the daemon's uid's is
// not read.
func TestFilesOfAnotherUser(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("chown to another user needs root")
	}
	s := open(t, tempDirs(t, "/var/tmp", 1), Options{Chunk: testChunk})
	want := pattern(100, 1)
	e := write(t, s, "k", want, "")
	if err := os.Chown(e.Files[0], 65013, 65013); err != nil {
		t.Fatal(err)
	}
	_, err := s.Read(context.Background(), "k", checkSink{t, want})
	if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), "uid 65013") {
		t.Errorf("Read of another user's file = %v, want it refused", err)
	}
}

// TestDiskFull fills a small file system: the write that does not fit
// fails saying so, wrapping ENOSPC, leaves no file, and the key's
// previous copy reads back whole.
func TestDiskFull(t *testing.T) {
	root := mountTmpfs(t, "size=16m,mode=0700")
	dirs := []string{root + "/a", root + "/b"}
	s := open(t, dirs, Options{Chunk: testChunk})
	old := pattern(6*testChunk, 1)
	e := write(t, s, "k", old, "")
	for _, n := range []int64{12 * testChunk, 11*testChunk + 5} {
		_, err := s.Write(context.Background(), "k", n, nil, pattern(n, 2))
		if !errors.Is(err, syscall.ENOSPC) || !strings.Contains(err.Error(), "full") {
			t.Fatalf("Write of %d bytes on a 16 MiB disk holding 6 = %v, want ENOSPC", n, err)
		}
		for _, d := range dirs {
			assertOnly(t, d, e)
		}
		readBack(t, s, "k", old)
	}
	if used, _ := s.Usage(); used != e.Disk {
		t.Errorf("Usage = %d after failed writes, want %d", used, e.Disk)
	}
	// What fits still does.
	write(t, s, "k", pattern(7*testChunk, 3), "")
}
