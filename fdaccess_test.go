package gpushm_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/testdaemon"
)

// openError is a copy op's file that the client could not open itself,
// printed as its result ("open-EACCES").
type openError struct{ errno syscall.Errno }

func (e *openError) Error() string { return "open-" + errnoName(e.errno) }

func errnoName(e syscall.Errno) string {
	if n := unix.ErrnoName(e); n != "" {
		return n
	}
	return strconv.Itoa(int(e))
}

// openFlags reads "O_WRONLY|O_APPEND".
var openFlags = map[string]int{
	"O_RDONLY": unix.O_RDONLY, "O_WRONLY": unix.O_WRONLY, "O_RDWR": unix.O_RDWR,
	"O_PATH": unix.O_PATH, "O_APPEND": unix.O_APPEND, "O_NOFOLLOW": unix.O_NOFOLLOW,
}

// copyOp is the client's side of TestFillDumpAccess, run by opsChild as
// another user: "fill-path:SEG,PATH,FLAGS" and "dump-path:SEG,PATH,FLAGS"
// open PATH themselves with FLAGS; "fill-fd:SEG,N" and "dump-fd:SEG,N" send
// descriptor N, passed on by the process that started this one. Each copies
// 4096 bytes between the file at 0 and segment SEG at 0.
func copyOp(ctx context.Context, c *gpushm.Client, verb, arg string) error {
	args := strings.Split(arg, ",")
	var f *os.File
	switch {
	case strings.HasSuffix(verb, "-path") && len(args) == 3:
		flags := 0
		for _, n := range strings.Split(args[2], "|") {
			fl, ok := openFlags[n]
			if !ok {
				return fmt.Errorf("unknown open flag %q", n)
			}
			flags |= fl
		}
		fd, err := unix.Open(args[1], flags|unix.O_CLOEXEC, 0)
		if err != nil {
			return &openError{err.(syscall.Errno)}
		}
		f = os.NewFile(uintptr(fd), args[1])
	case strings.HasSuffix(verb, "-fd") && len(args) == 2:
		n, err := strconv.Atoi(args[1])
		if err != nil {
			return err
		}
		f = os.NewFile(uintptr(n), "passed on")
	default:
		return fmt.Errorf("bad copy op %s:%s", verb, arg)
	}
	defer f.Close()
	s, err := c.Open(ctx, args[0], nil)
	if err != nil {
		return err
	}
	defer s.Close()
	if strings.HasPrefix(verb, "fill") {
		_, err = s.Fill(ctx, f, 0, 0, 4096)
	} else {
		_, err = s.Dump(ctx, f, 0, 0, 4096)
	}
	return err
}

// TestFillDumpAccess: a client running as another user has the daemon
// (root) copy only what its descriptor allows it, on a disk file system and
// on tmpfs. Every descriptor of a root-only file without the access the
// copy needs is refused with EBADF, opened by the client itself (O_PATH,
// O_WRONLY for fill; O_RDONLY, O_PATH for dump) or passed on to it by a
// root process; nothing is copied (the segment and the files keep their
// bytes). A descriptor with the access works, whoever opened it.
func TestFillDumpAccess(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("running clients as other users needs root")
	}
	d := testdaemon.Start(t, "host")
	ctx := context.Background()
	c := dial(t, d.Socket)
	const n, nobody = 4096, 65534
	mode := uint32(0o666)
	target, err := c.Create(ctx, "target", n, &gpushm.CreateOptions{Mode: &mode})
	if err != nil {
		t.Fatal(err)
	}
	defer target.Close()
	m, err := target.Map()
	if err != nil {
		t.Fatal(err)
	}
	segBytes := pattern(1, n)
	copy(m.Bytes(), segBytes)
	if _, _, err := c.CreateOnly(ctx, "landing", n, &gpushm.CreateOptions{Mode: &mode}); err != nil {
		t.Fatal(err)
	}
	landing, err := c.Open(ctx, "landing", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer landing.Close()
	lm, err := landing.Map()
	if err != nil {
		t.Fatal(err)
	}

	for _, place := range fileSystems(t) {
		var fs unix.Statfs_t
		if err := unix.Statfs(place, &fs); err != nil {
			t.Fatal(err)
		}
		t.Run(fsName(fs.Type), func(t *testing.T) {
			dir, err := os.MkdirTemp(place, "gpushm-fdaccess-")
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { os.RemoveAll(dir) })
			os.Chmod(dir, 0o755)
			// Root's files: secret (0600) none may read or write,
			// writeonly (0622) others may write but not read, readonly
			// (0644) others may read but not write, drop (0622) the
			// target of a dump that must work, public (0644) the source
			// of a fill that must work.
			files := map[string]struct {
				perm os.FileMode
				seed uint64
			}{"secret": {0o600, 2}, "writeonly": {0o622, 3}, "readonly": {0o644, 4}, "drop": {0o622, 5}, "public": {0o644, 6}}
			path := func(name string) string { return filepath.Join(dir, name) }
			for name, f := range files {
				if err := os.WriteFile(path(name), pattern(f.seed, n), f.perm); err != nil {
					t.Fatal(err)
				}
				os.Chmod(path(name), f.perm)
				dropCache(t, path(name))
			}
			// Descriptors a root process opened and passes on (3, 4, ...).
			var passed []*os.File
			pass := func(name string, flags int) string {
				fd, err := unix.Open(path(name), flags|unix.O_CLOEXEC, 0)
				if err != nil {
					t.Fatal(err)
				}
				f := os.NewFile(uintptr(fd), name)
				t.Cleanup(func() { f.Close() })
				passed = append(passed, f)
				return strconv.Itoa(2 + len(passed))
			}
			tests := fdAccessCases(path, pass)
			ops := make([]string, len(tests))
			for i, tc := range tests {
				ops[i] = tc.op
			}
			got := asUserFiles(t, d.Socket, nobody, nobody, passed, ops...)
			if len(got) != len(tests) {
				t.Fatalf("client answered %q to %d ops", got, len(tests))
			}
			for i, tc := range tests {
				if got[i] != tc.want {
					t.Errorf("%s as uid %d = %s, want %s", strings.ReplaceAll(tc.op, dir+"/", ""), nobody, got[i], tc.want)
				}
			}

			if !bytes.Equal(m.Bytes()[:n], segBytes) {
				t.Error("a refused fill changed the segment")
			}
			for name, f := range files {
				want := pattern(f.seed, n)
				if name == "drop" {
					want = segBytes
				}
				if b, err := os.ReadFile(path(name)); err != nil || !bytes.Equal(b, want) {
					t.Errorf("%s after the copies: %d bytes (%v), want %d, its own", name, len(b), err, n)
				}
			}
			if !bytes.Equal(lm.Bytes()[:n], pattern(files["public"].seed, n)) {
				t.Error("the fill from a readable descriptor did not copy the file")
			}
			clear(lm.Bytes())

			checkFillDirect(t, landing, lm, path("public"), pattern(files["public"].seed, n), fs.Type == unix.EXT4_SUPER_MAGIC)
		})
	}
}

// fdAccessCases are TestFillDumpAccess's copies, each with what the
// client running as nobody answers: path names a file of root's, pass
// passes one on opened by root and gives its descriptor's number.
func fdAccessCases(path func(string) string, pass func(string, int) string) []struct{ op, want string } {
	return []struct{ op, want string }{
		// The client is who it says: it cannot open these itself.
		{"fill-path:target," + path("secret") + ",O_RDONLY", "open-EACCES"},
		{"fill-path:target," + path("writeonly") + ",O_RDONLY", "open-EACCES"},
		{"dump-path:target," + path("readonly") + ",O_WRONLY", "open-EACCES"},
		// fill: whatever the client could open of files it may not read.
		{"fill-path:target," + path("secret") + ",O_PATH", "EBADF"},
		{"fill-path:target," + path("secret") + ",O_PATH|O_NOFOLLOW", "EBADF"},
		{"fill-path:target," + path("writeonly") + ",O_PATH", "EBADF"},
		{"fill-path:target," + path("writeonly") + ",O_WRONLY", "EBADF"},
		{"fill-path:target," + path("writeonly") + ",O_WRONLY|O_APPEND", "EBADF"},
		// dump: whatever the client could open of files it may not write.
		{"dump-path:target," + path("secret") + ",O_PATH", "EBADF"},
		{"dump-path:target," + path("readonly") + ",O_PATH", "EBADF"},
		{"dump-path:target," + path("readonly") + ",O_RDONLY", "EBADF"},
		{"dump-path:target," + path("readonly") + ",O_RDONLY|O_APPEND", "EBADF"},
		// Passed on by root: the descriptor's access, not root's.
		{"fill-fd:target," + pass("secret", unix.O_PATH), "EBADF"},
		{"fill-fd:target," + pass("secret", unix.O_WRONLY), "EBADF"},
		{"dump-fd:target," + pass("secret", unix.O_PATH), "EBADF"},
		{"dump-fd:target," + pass("secret", unix.O_RDONLY), "EBADF"},
		// What a descriptor allows, it allows.
		{"dump-path:target," + path("drop") + ",O_WRONLY|O_APPEND", "EINVAL"},
		{"dump-path:target," + path("drop") + ",O_WRONLY", "OK"},
		{"fill-path:landing," + path("public") + ",O_RDONLY", "OK"},
	}
}

// checkFillDirect: a client that opened its file with O_DIRECT has the
// daemon read it with O_DIRECT, through that descriptor (on ext4, every
// byte); where the file system has no O_DIRECT, there is nothing to see.
func checkFillDirect(t *testing.T, landing *gpushm.Segment, lm *gpushm.Mapping, file string, want []byte, ext4 bool) {
	t.Helper()
	n := int64(len(want))
	dropCache(t, file)
	fd, err := unix.Open(file, unix.O_RDONLY|unix.O_DIRECT|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.EINVAL) {
		return // no O_DIRECT on this file system
	}
	if err != nil {
		t.Fatal(err)
	}
	direct := os.NewFile(uintptr(fd), "public")
	defer direct.Close()
	st, err := landing.Fill(context.Background(), direct, 0, 0, n)
	if err != nil {
		t.Fatalf("fill from an O_DIRECT descriptor: %v", err)
	}
	if !bytes.Equal(lm.Bytes()[:n], want) {
		t.Error("the fill from an O_DIRECT descriptor did not copy the file")
	}
	if ext4 && st.Direct != n {
		t.Errorf("fill from an O_DIRECT descriptor on ext4: %d bytes read with O_DIRECT, want %d", st.Direct, n)
	}
	clear(lm.Bytes())
}

// dropCache has the kernel forget the file's pages, where it can (not on
// tmpfs): a copy engine that reads what the page cache lacks with O_DIRECT
// then takes that way.
func dropCache(t *testing.T, path string) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED)
}

// fileSystems returns a directory on the disk holding the temporary
// directory, and one on tmpfs (/dev/shm, or a tmpfs mounted for the test).
func fileSystems(t *testing.T) []string {
	t.Helper()
	places := []string{os.TempDir()}
	var fs unix.Statfs_t
	if unix.Statfs("/dev/shm", &fs) == nil && fs.Type == unix.TMPFS_MAGIC {
		return append(places, "/dev/shm")
	}
	dir := t.TempDir()
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, "size=1m,mode=1777"); err != nil {
		t.Fatalf("no tmpfs at /dev/shm, and mounting one: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
	return append(places, dir)
}

func fsName(magic int64) string {
	switch magic {
	case unix.EXT4_SUPER_MAGIC:
		return "ext4"
	case unix.TMPFS_MAGIC:
		return "tmpfs"
	case unix.XFS_SUPER_MAGIC:
		return "xfs"
	case unix.BTRFS_SUPER_MAGIC:
		return "btrfs"
	case unix.OVERLAYFS_SUPER_MAGIC:
		return "overlay"
	}
	return fmt.Sprintf("fs-%#x", magic)
}
