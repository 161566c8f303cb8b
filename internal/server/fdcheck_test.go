package server

import (
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

// TestClientFileFlags opens one regular file with every access mode and
// the flags that matter, and checks what fill and dump make of each real
// descriptor: the access each needs, no O_PATH, no O_APPEND for dump.
func TestClientFileFlags(t *testing.T) {
	path := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(path, make([]byte, 4096), 0o644); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name           string
		flags          int
		fill, dump     error
		skipUnlessRoot bool
	}{
		{"O_RDONLY", unix.O_RDONLY, nil, syscall.EBADF, false},
		{"O_WRONLY", unix.O_WRONLY, syscall.EBADF, nil, false},
		{"O_RDWR", unix.O_RDWR, nil, nil, false},
		{"O_PATH", unix.O_PATH, syscall.EBADF, syscall.EBADF, false},
		{"O_PATH|O_RDWR", unix.O_PATH | unix.O_RDWR, syscall.EBADF, syscall.EBADF, false},
		{"O_PATH|O_NOFOLLOW", unix.O_PATH | unix.O_NOFOLLOW, syscall.EBADF, syscall.EBADF, false},
		{"O_RDONLY|O_DIRECT", unix.O_RDONLY | unix.O_DIRECT, nil, syscall.EBADF, false},
		{"O_RDONLY|O_NOATIME", unix.O_RDONLY | unix.O_NOATIME, nil, syscall.EBADF, false},
		{"O_WRONLY|O_APPEND", unix.O_WRONLY | unix.O_APPEND, syscall.EBADF, syscall.EINVAL, false},
		{"O_RDWR|O_APPEND", unix.O_RDWR | unix.O_APPEND, nil, syscall.EINVAL, false},
		{"O_WRONLY|O_SYNC", unix.O_WRONLY | unix.O_SYNC, syscall.EBADF, nil, false},
		{"O_RDWR|O_NONBLOCK", unix.O_RDWR | unix.O_NONBLOCK, nil, nil, false},
		// Access mode 3 gives neither reading nor writing (it is for
		// ioctls) and needs both permissions, or CAP_SYS_ADMIN, to open.
		{"access mode 3", unix.O_ACCMODE, syscall.EBADF, syscall.EBADF, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if tc.skipUnlessRoot && os.Geteuid() != 0 {
				t.Skip("needs root")
			}
			fd, err := unix.Open(path, tc.flags|unix.O_CLOEXEC, 0)
			if errors.Is(err, unix.EINVAL) && tc.flags&unix.O_DIRECT != 0 {
				t.Skip("no O_DIRECT on this file system")
			}
			if err != nil {
				t.Fatal(err)
			}
			f := os.NewFile(uintptr(fd), path)
			defer f.Close()
			if _, err := statClientFile(true, fd); !errors.Is(err, tc.fill) || (err == nil) != (tc.fill == nil) {
				t.Errorf("fill: %v, want %v", err, tc.fill)
			}
			if _, err := statClientFile(false, fd); !errors.Is(err, tc.dump) || (err == nil) != (tc.dump == nil) {
				t.Errorf("dump: %v, want %v", err, tc.dump)
			}
		})
	}
}

// TestClientFileKinds sends statClientFile real descriptors of everything
// that is not a regular file of a file system holding data, each opened
// with the access the copy needs: all are refused.
func TestClientFileKinds(t *testing.T) {
	dir := t.TempDir()
	fifo := filepath.Join(dir, "fifo")
	if err := unix.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	open := func(path string, flags int) func() (*os.File, error) {
		return func() (*os.File, error) { return os.OpenFile(path, flags, 0) }
	}
	socket := func() (*os.File, error) {
		fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return nil, err
		}
		unix.Close(fds[1])
		return os.NewFile(uintptr(fds[0]), "socket"), nil
	}
	eventfd := func() (*os.File, error) {
		fd, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
		return os.NewFile(uintptr(fd), "eventfd"), err
	}
	tests := []struct {
		name       string
		open       func() (*os.File, error)
		fill, dump error // nil: that side is not tried
		okDump     bool
	}{
		{"directory", open(dir, os.O_RDONLY), syscall.EINVAL, nil, false},
		{"FIFO", open(fifo, os.O_RDWR), syscall.EINVAL, syscall.EINVAL, false},
		{"socket", socket, syscall.EINVAL, syscall.EINVAL, false},
		{"eventfd", eventfd, syscall.EINVAL, syscall.EINVAL, false},
		{"/proc/self/oom_score_adj", open("/proc/self/oom_score_adj", os.O_RDWR), syscall.EINVAL, syscall.EINVAL, false},
		{"/proc/self/status", open("/proc/self/status", os.O_RDONLY), syscall.EINVAL, nil, false},
		{"sysfs", open("/sys/kernel/mm/transparent_hugepage/enabled", os.O_RDONLY), syscall.EINVAL, nil, false},
		{"/dev/urandom", open("/dev/urandom", os.O_RDWR), syscall.EINVAL, syscall.EINVAL, false},
		{"/dev/null", open(os.DevNull, os.O_RDWR), syscall.EINVAL, nil, true},
		{"/dev/zero", open("/dev/zero", os.O_WRONLY), nil, nil, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f, err := tc.open()
			if err != nil {
				t.Skipf("cannot open it here: %v", err)
			}
			defer f.Close()
			if tc.fill != nil {
				if _, err := statClientFile(true, int(f.Fd())); !errors.Is(err, tc.fill) {
					t.Errorf("fill: %v, want %v", err, tc.fill)
				}
			}
			if tc.dump != nil {
				if _, err := statClientFile(false, int(f.Fd())); !errors.Is(err, tc.dump) {
					t.Errorf("dump: %v, want %v", err, tc.dump)
				}
			}
			if tc.okDump {
				if _, err := statClientFile(false, int(f.Fd())); err != nil {
					t.Errorf("dump: %v, want it taken", err)
				}
			}
		})
	}
}

// FuzzCheckClientFile checks checkClientFile's rules over any flags, mode,
// device and file system: it allows only what the copy may do through the
// descriptor, and refuses everything else with EBADF or EINVAL. The seeds
// run with every go test.
func FuzzCheckClientFile(f *testing.F) {
	mem := uint64(unix.Mkdev(1, 3))
	for _, s := range []struct {
		fill  bool
		flags int
		mode  uint32
		rdev  uint64
		fs    int64
	}{
		{true, unix.O_RDONLY, unix.S_IFREG | 0o600, 0, unix.EXT4_SUPER_MAGIC},
		{true, unix.O_WRONLY, unix.S_IFREG | 0o622, 0, unix.TMPFS_MAGIC},
		{true, unix.O_PATH, unix.S_IFREG | 0o600, 0, unix.EXT4_SUPER_MAGIC},
		{false, unix.O_RDONLY, unix.S_IFREG | 0o644, 0, unix.EXT4_SUPER_MAGIC},
		{false, unix.O_WRONLY | unix.O_APPEND, unix.S_IFREG | 0o644, 0, unix.XFS_SUPER_MAGIC},
		{false, unix.O_WRONLY, unix.S_IFCHR | 0o666, mem, unix.TMPFS_MAGIC},
		{false, unix.O_WRONLY, unix.S_IFCHR | 0o620, uint64(unix.Mkdev(136, 0)), unix.DEVPTS_SUPER_MAGIC},
		{true, unix.O_RDWR, unix.S_IFDIR | 0o755, 0, unix.EXT4_SUPER_MAGIC},
		{false, unix.O_RDWR, unix.S_IFIFO | 0o600, 0, unix.PIPEFS_MAGIC},
		{false, unix.O_RDWR, unix.S_IFREG | 0o644, 0, unix.PROC_SUPER_MAGIC},
		{true, unix.O_RDONLY | unix.O_DIRECT, unix.S_IFREG | 0o444, 0, unix.FUSE_SUPER_MAGIC},
		{true, unix.O_ACCMODE, unix.S_IFREG | 0o666, 0, unix.EXT4_SUPER_MAGIC},
		{false, unix.O_RDWR, 0o600, 0, unix.ANON_INODE_FS_MAGIC},
	} {
		f.Add(s.fill, s.flags, s.mode, s.rdev, s.fs)
	}
	f.Fuzz(func(t *testing.T, fill bool, flags int, mode uint32, rdev uint64, fs int64) {
		err := checkClientFile(fill, flags, mode, rdev, fs)
		if err != nil {
			if !errors.Is(err, syscall.EBADF) && !errors.Is(err, syscall.EINVAL) {
				t.Fatalf("checkClientFile(%v, %#x, %#o, %#x, %#x) = %v, want EBADF or EINVAL", fill, flags, mode, rdev, fs, err)
			}
			if flags&unix.O_PATH != 0 && !errors.Is(err, syscall.EBADF) {
				t.Fatalf("O_PATH (flags %#x): %v, want EBADF", flags, err)
			}
			return
		}
		acc := flags & unix.O_ACCMODE
		switch {
		case flags&unix.O_PATH != 0:
			t.Fatalf("an O_PATH descriptor (flags %#x) allowed", flags)
		case fill && acc != unix.O_RDONLY && acc != unix.O_RDWR:
			t.Fatalf("fill allowed a descriptor not open for reading (flags %#x)", flags)
		case !fill && acc != unix.O_WRONLY && acc != unix.O_RDWR:
			t.Fatalf("dump allowed a descriptor not open for writing (flags %#x)", flags)
		case !fill && flags&unix.O_APPEND != 0:
			t.Fatalf("dump allowed O_APPEND (flags %#x)", flags)
		}
		switch mode & unix.S_IFMT {
		case unix.S_IFREG:
			if _, ok := kernelFS[fs]; ok {
				t.Fatalf("a file on %s allowed", kernelFS[fs])
			}
		case unix.S_IFCHR:
			if maj, min := unix.Major(rdev), unix.Minor(rdev); fill || maj != 1 || min != 3 && min != 5 && min != 7 {
				t.Fatalf("device %d:%d allowed (fill %v)", unix.Major(rdev), unix.Minor(rdev), fill)
			}
		default:
			t.Fatalf("file type %#o allowed", mode&unix.S_IFMT)
		}
	})
}
