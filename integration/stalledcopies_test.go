package integration

import (
	"context"
	"crypto/rand"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/testutil"
)

// The daemon copies (fill, dump) for as long as a file's reads take, and a
// user can make them take for ever: a FUSE file whose server holds the
// reads. These tests play such users, as other uids, against a daemon
// process, with `gpushm put` as they would run it; the file system is
// served by the test (a user's own FUSE mount serves the same), so that it
// can end the stalls when the test ends.

// stallFS serves the attackers' files: stallN, whose reads past the first
// page (the put's look at the file's header) wait until release, for ever
// as far as the daemon knows; and slow, whose reads each take readDelay.
type stallFS struct {
	fs.Inode
	release chan struct{}

	mu      sync.Mutex
	stalled map[string]int // reads waiting, by file
	// slowBytes are the bytes of slow read past its first MiB: the
	// daemon's copy, not the put's look at the header.
	slowBytes atomic.Int64
}

const (
	stallFiles = 12
	stallSize  = 64 << 20
	slowSize   = 256 << 20 // one step of put's (xfer.MinStep)
	readDelay  = 50 * time.Millisecond
)

func (s *stallFS) OnAdd(ctx context.Context) {
	for i := range stallFiles {
		name := fmt.Sprint("stall", i)
		s.AddChild(name, s.NewPersistentInode(ctx, &stallFile{fs: s, name: name, size: stallSize}, fs.StableAttr{Mode: syscall.S_IFREG}), false)
	}
	s.AddChild("slow", s.NewPersistentInode(ctx, &stallFile{fs: s, name: "slow", size: slowSize}, fs.StableAttr{Mode: syscall.S_IFREG}), false)
}

type stallFile struct {
	fs.Inode
	fs   *stallFS
	name string
	size int64
}

var (
	_ fs.NodeGetattrer = (*stallFile)(nil)
	_ fs.NodeOpener    = (*stallFile)(nil)
	_ fs.NodeReader    = (*stallFile)(nil)
)

func (f *stallFile) Getattr(ctx context.Context, fh fs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	out.Mode = syscall.S_IFREG | 0o444
	out.Size = uint64(f.size)
	return 0
}

// Open reads past the page cache (FOPEN_DIRECT_IO): every read of the
// daemon's comes here, none is answered from pages an earlier read left.
func (f *stallFile) Open(ctx context.Context, flags uint32) (fs.FileHandle, uint32, syscall.Errno) {
	return nil, fuse.FOPEN_DIRECT_IO, 0
}

func (f *stallFile) Read(ctx context.Context, fh fs.FileHandle, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	n := max(0, min(int64(len(dest)), f.size-off))
	if f.name == "slow" {
		time.Sleep(readDelay)
		if off >= 1<<20 {
			f.fs.slowBytes.Add(n)
		}
		return fuse.ReadResultData(make([]byte, n)), 0
	}
	if off < 4096 {
		return fuse.ReadResultData(make([]byte, n)), 0
	}
	f.fs.mu.Lock()
	f.fs.stalled[f.name]++
	f.fs.mu.Unlock()
	defer func() {
		f.fs.mu.Lock()
		f.fs.stalled[f.name]--
		f.fs.mu.Unlock()
	}()
	// The kernel's interrupt (ctx) is not heeded: a hostile server
	// answers when it likes.
	<-f.fs.release
	return nil, syscall.EIO
}

// stalledIn waits up to d for a read of file name to wait in stallFS.
func (s *stallFS) stalledIn(name string, d time.Duration) bool {
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		s.mu.Lock()
		n := s.stalled[name]
		s.mu.Unlock()
		if n > 0 {
			return true
		}
		time.Sleep(20 * time.Millisecond)
	}
	return false
}

// mountStallFS mounts a stallFS where every user may read it, and
// returns it and its directory. At the test's end (before the daemon's,
// whose copies would otherwise hold their reads) it answers the reads
// waiting and unmounts. It skips the test where FUSE cannot be mounted.
func mountStallFS(t *testing.T) (*stallFS, string) {
	t.Helper()
	if f, err := os.OpenFile("/dev/fuse", os.O_RDWR, 0); err != nil {
		t.Skipf("no FUSE here: %v", err)
	} else {
		f.Close()
	}
	dir, err := os.MkdirTemp("", "gpushm-stall-")
	if err != nil {
		t.Fatal(err)
	}
	os.Chmod(dir, 0o755)
	s := &stallFS{release: make(chan struct{}), stalled: map[string]int{}}
	srv, err := fs.Mount(dir, s, &fs.Options{MountOptions: fuse.MountOptions{
		AllowOther: true, DirectMount: true, FsName: "stall", Name: "stall"}})
	if err != nil {
		os.Remove(dir)
		t.Skipf("cannot mount FUSE: %v", err)
	}
	closeOnExecFUSE()
	t.Cleanup(func() {
		close(s.release)
		for i := 0; srv.Unmount() != nil; i++ {
			if i == 100 {
				unix.Unmount(dir, unix.MNT_DETACH)
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
		os.Remove(dir)
	})
	return s, dir
}

// closeOnExecFUSE keeps the FUSE device out of the processes the test
// starts: go-fuse opens it without O_CLOEXEC to mount directly, and a
// client stuck on this file system that held it would keep the file
// system up after the test.
func closeOnExecFUSE() {
	ents, _ := os.ReadDir("/proc/self/fd")
	for _, e := range ents {
		if target, _ := os.Readlink("/proc/self/fd/" + e.Name()); target == "/dev/fuse" {
			if fd, err := strconv.Atoi(e.Name()); err == nil {
				unix.CloseOnExec(fd)
			}
		}
	}
}

// startAs runs bin (the CLI) with args as uid (root: 0), in the
// background, with the daemon at sock.
func startAs(t *testing.T, bin, sock string, uid int, args ...string) *started {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), "GPUSHM_SOCKET="+sock)
	if uid != 0 {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uint32(uid), Gid: uint32(uid)}}
	}
	return startCmd(t, cmd)
}

// endsWithin reports whether p exited within d.
func (p *started) endsWithin(d time.Duration) bool {
	select {
	case <-p.done:
		return true
	case <-time.After(d):
		return false
	}
}

// putAs has uid put path as name, and fails the test unless the put ends
// well within d.
func putAs(t *testing.T, bin, sock string, uid int, name, path string, d time.Duration) {
	t.Helper()
	start := time.Now()
	p := startAs(t, bin, sock, uid, "put", "--copier", "daemon", name, path)
	if !p.endsWithin(d) {
		t.Fatalf("uid %d's put of %s did not end within %v", uid, path, d)
	}
	if p.code != 0 {
		t.Fatalf("uid %d's put of %s: exit %d: %s", uid, path, p.code, p.stderr.String())
	}
	t.Logf("uid %d's put of %s took %v", uid, path, time.Since(start).Round(time.Millisecond))
}

// copiesDaemon starts a daemon (host backend, or $GPUSHM_TEST_BACKEND)
// that other users reach, the stall file system, a copy of the test
// binary that they can run, and a file of 16 MiB that anyone may read;
// it returns them all.
func copiesDaemon(t *testing.T) (sock string, sfs *stallFS, mnt, bin, plain string) {
	t.Helper()
	requireUsers(t)
	dir := testutil.SocketDir(t)
	os.Chmod(dir, 0o755)
	sock = filepath.Join(dir, "gpushm.sock")
	Start(t, Options{Socket: sock, Args: testBackend()})
	sfs, mnt = mountStallFS(t)
	bin = binaryForOthers(t)
	plain = filepath.Join(dir, "plain")
	data := make([]byte, 16<<20)
	rand.Read(data)
	if err := os.WriteFile(plain, data, 0o644); err != nil {
		t.Fatal(err)
	}
	return sock, sfs, mnt, bin, plain
}

// TestHostileStalledCopies: four users put files whose reads never
// return, two each (the first three get their two, the fourth's second
// waits: fair shares), holding the copies the daemon shares. Root's put
// and another user's still run at once (root and users running no copy
// always get one); a user with a copy stuck waits for a second, and gets
// it when the stalling clients are killed (their copies leave the shared
// pool, though their reads still wait); what a killed client's stuck
// copies still hold is its own user's limit, whose next put is refused at
// once (docs/security.md, "Resources"). The daemon before this hung every
// put after the first eight.
func TestHostileStalledCopies(t *testing.T) {
	sock, sfs, mnt, bin, plain := copiesDaemon(t)
	attackers := []int{4301, 4302, 4303, 4304}
	var puts []*started
	file := 0
	for _, uid := range attackers {
		for range 2 {
			name := fmt.Sprint("stall", file)
			puts = append(puts, startAs(t, bin, sock, uid, "put", "--copier", "daemon", fmt.Sprint("s", file), filepath.Join(mnt, name)))
			stuck := sfs.stalledIn(name, 5*time.Second)
			t.Logf("uid %d: put of %s: copy stuck in a read: %v", uid, name, stuck)
			if !stuck && file < 7 {
				t.Fatalf("uid %d's put of %s never read its file: %s", uid, name, puts[file].stderr.String())
			}
			file++
		}
	}

	t.Run("root", func(t *testing.T) {
		putAs(t, bin, sock, 0, "root-put", plain, 20*time.Second)
	})
	t.Run("another user", func(t *testing.T) {
		putAs(t, bin, sock, 4305, "user-put", plain, 20*time.Second)
	})
	t.Run("stalling clients killed", func(t *testing.T) {
		// uid 4306 runs one copy that stalls; its second waits, the daemon
		// being full.
		startAs(t, bin, sock, 4306, "put", "--copier", "daemon", "f1", filepath.Join(mnt, "stall8"))
		if !sfs.stalledIn("stall8", 20*time.Second) {
			t.Fatal("a user running no copy did not get one")
		}
		second := startAs(t, bin, sock, 4306, "put", "--copier", "daemon", "f2", plain)
		if second.endsWithin(3 * time.Second) {
			t.Fatalf("a second copy ran with the daemon's copies taken (exit %d: %s)", second.code, second.stderr.String())
		}
		for _, p := range puts {
			p.cmd.Process.Kill()
		}
		if !second.endsWithin(15 * time.Second) {
			t.Fatal("the stalling clients were killed, and a waiting copy still did not run")
		}
		if second.code != 0 {
			t.Fatalf("the waiting put: exit %d: %s", second.code, second.stderr.String())
		}
		// Their reads still wait: those copies count against their users
		// until they return, and no further.
		again := startAs(t, bin, sock, attackers[0], "put", "--copier", "daemon", "again", plain)
		if !again.endsWithin(10 * time.Second) {
			t.Fatal("a user whose killed clients left two copies stuck waited for a third")
		}
		if msg := again.stderr.String(); again.code == 0 || !strings.Contains(msg, "copies per user: uid 4301 runs 2 copies, limit 2") {
			t.Fatalf("a user whose killed clients left two copies stuck: exit %d: %s; want the limit of copies per user", again.code, msg)
		}
	})
}

// TestHostileCopyKilled: a client killed while the daemon copies a large
// file for it (a file of 256 MiB that reads at some MB/s) stops the copy
// at its copiers' next chunk: the file's reads stop, the segment it was
// filling, uncommitted, is gone, and the user's copies are free again. The
// daemon before this copied the whole file for nobody.
func TestHostileCopyKilled(t *testing.T) {
	sock, sfs, mnt, bin, plain := copiesDaemon(t)
	const uid = 4307
	ctx := context.Background()
	root, err := gpushm.Dial(ctx, sock)
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	p := startAs(t, bin, sock, uid, "put", "--copier", "daemon", "big", filepath.Join(mnt, "slow"))
	waitUntil(t, 30*time.Second, "the daemon's copy to start", func() bool { return sfs.slowBytes.Load() >= 4<<20 })
	if segs := segmentsOf(t, root, uid); segs != 1 {
		t.Fatalf("uid %d holds %d segments while it puts, want 1", uid, segs)
	}
	p.cmd.Process.Kill()
	<-p.done
	killed := sfs.slowBytes.Load()
	// The copiers end the chunks they are on (8 MiB each), no more.
	most := killed + int64(min(16, runtime.NumCPU())+1)*8<<20
	last, still := killed, time.Now()
	waitUntil(t, 60*time.Second, "the copy's reads to stop", func() bool {
		if n := sfs.slowBytes.Load(); n != last {
			last, still = n, time.Now()
		}
		return time.Since(still) > 2*time.Second
	})
	t.Logf("read %d MiB of %d before the kill, %d MiB in all", killed>>20, slowSize>>20, last>>20)
	if last > most {
		t.Fatalf("the daemon read %d MiB of %d for a client killed after %d MiB (want at most %d MiB: each copier's chunk)", last>>20, slowSize>>20, killed>>20, most>>20)
	}
	waitUntil(t, 10*time.Second, "the uncommitted segment to go", func() bool { return segmentsOf(t, root, uid) == 0 })
	// Both of the user's copies are free: one stuck, one that runs.
	startAs(t, bin, sock, uid, "put", "--copier", "daemon", "stuck", filepath.Join(mnt, "stall9"))
	if !sfs.stalledIn("stall9", 20*time.Second) {
		t.Fatal("the user's first copy after the kill did not start")
	}
	putAs(t, bin, sock, uid, "after", plain, 20*time.Second)
}

// segmentsOf is how many segments uid holds, as info says.
func segmentsOf(t *testing.T, c *gpushm.Client, uid int) int {
	t.Helper()
	inf, err := c.Info(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, u := range inf.Users {
		if u.UID == uint32(uid) {
			n += u.Segments
		}
	}
	return n
}

// waitUntil polls ok until it holds, and fails the test after d.
func waitUntil(t *testing.T, d time.Duration, what string, ok func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !ok() {
		if time.Now().After(deadline) {
			t.Fatalf("waited %v for %s", d, what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
