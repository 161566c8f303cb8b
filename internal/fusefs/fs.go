package fusefs

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"

	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/wire"
)

// Backend is what the view needs of the daemon's backend besides the
// registry: where new files go, and how much memory there is (statfs).
type Backend interface {
	Devices() ([]wire.Device, error)
	DefaultDevice() int
}

// MaxIO is the largest read or write the kernel sends in one request.
const MaxIO = 1 << 20

// rootIno keeps the root directory's inode number clear of segment IDs,
// which count up from 1.
const rootIno = 1<<63 - 1

// FS is the state the nodes share.
type FS struct {
	reg     *segment.Registry
	backend Backend
	log     *slog.Logger
	start   time.Time
	uid     uint32 // the root directory's owner: the daemon's
	gid     uint32

	mu      sync.Mutex
	writers map[*segment.Segment]int // writable handles open, per segment

	// lend: reads of memory that can lend it are replies made of it
	// (Registry.Lend); false only in tests, to read ahead on host memory.
	lend bool

	// Read-ahead (readahead.go): the memory it holds, and its goroutines.
	raMu     sync.Mutex
	raBytes  int      // in chunks
	raKept   int      // in chunks and raFree
	raFree   [][]byte // buffers for reuse
	bgMu     sync.Mutex
	bgDone   bool // unmounting: no more goroutines
	bg       sync.WaitGroup
	raServed atomic.Int64 // requests answered from bytes read ahead
}

// lendReads is FS.lend for views mounted from now on (export_test.go).
var lendReads = true

// Server is a mounted view.
type Server struct {
	dir string
	srv *fuse.Server
	fs  *FS
}

// Dir is the mount point.
func (s *Server) Dir() string { return s.dir }

// Mount serves reg at dir until Unmount. dir is created if missing; a
// stale mount of a dead daemon there is cleaned first, and a live one is an
// error. As root it mounts directly (no fusermount) and allow_other;
// otherwise it needs fusermount3 (or fusermount).
func Mount(dir string, reg *segment.Registry, b Backend, log *slog.Logger) (*Server, error) {
	if log == nil {
		log = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	if err := prepare(dir, log); err != nil {
		return nil, err
	}
	f := &FS{
		reg:     reg,
		backend: b,
		log:     log,
		start:   time.Now(),
		uid:     uint32(os.Geteuid()),
		gid:     uint32(os.Getegid()),
		writers: make(map[*segment.Segment]int),
		lend:    lendReads,
	}
	var zero time.Duration
	root := os.Geteuid() == 0
	opts := &fs.Options{
		MountOptions: fuse.MountOptions{
			FsName:       "gpushm",
			Name:         "gpushm",
			MaxWrite:     MaxIO,
			MaxReadAhead: MaxIO,
			DirectMount:  root,
			AllowOther:   root,
			// Reads and writes are the requests that matter; let enough
			// of them run at once.
			MaxBackground: 64,
			// mmap of a file opened for direct I/O (Linux 6.6 and
			// later; older kernels answer ENODEV): a shared mapping goes
			// through the page cache, read from the segment as pages
			// are touched and written back on msync, munmap or
			// writeback, while read and write stay direct.
			ExtraCapabilities: fuse.CAP_DIRECT_IO_ALLOW_MMAP,
			// Replies are bytes in memory, never a descriptor to splice
			// from; splicing them through a pipe only costs.
			DisableSplice: true,
			Logger:        slog.NewLogLogger(log.Handler(), slog.LevelWarn),
			// Every request and reply, on stderr: for finding out what the
			// kernel asked.
			Debug: os.Getenv("GPUSHM_FUSE_DEBUG") != "",
		},
		EntryTimeout:    &zero,
		AttrTimeout:     &zero,
		NegativeTimeout: &zero,
		// A file of mode 0 must show as 0, not as go-fuse's default 0644.
		NullPermissions: true,
		RootStableAttr:  &fs.StableAttr{Ino: rootIno},
	}
	srv, err := fs.Mount(dir, &rootNode{fs: f}, opts)
	if err != nil {
		return nil, fmt.Errorf("mount FUSE view at %s: %w", dir, err)
	}
	return &Server{dir: dir, srv: srv, fs: f}, nil
}

// Unmount unmounts the view and waits for its requests to finish. A mount
// kept busy (a process with its working directory or a file open in it) is
// detached lazily instead, so that the daemon can still exit; such a
// process then sees ENOTCONN.
func (s *Server) Unmount() error {
	defer s.fs.waitBackground()
	if err := s.srv.Unmount(); err != nil {
		if lerr := lazyUnmount(s.dir); lerr != nil {
			return fmt.Errorf("unmount %s: %w (lazy unmount: %v)", s.dir, err, lerr)
		}
		return nil
	}
	s.srv.Wait()
	return nil
}

func (f *FS) addWriter(s *segment.Segment) {
	f.mu.Lock()
	f.writers[s]++
	f.mu.Unlock()
}

// dropWriter reports whether h was the last writable handle of s.
func (f *FS) dropWriter(s *segment.Segment) (last bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.writers[s]--
	if f.writers[s] > 0 {
		return false
	}
	delete(f.writers, s)
	return true
}

func (f *FS) writerCount(s *segment.Segment) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.writers[s]
}

// cred is the caller of a FUSE request. A request without one (none comes
// from the kernel that way) gets an identity that owns nothing.
func cred(ctx context.Context) segment.Cred {
	if c, ok := fuse.FromContext(ctx); ok {
		return segment.Cred{UID: c.Uid, GID: c.Gid}
	}
	return segment.Cred{UID: ^uint32(0), GID: ^uint32(0)}
}

// errno translates a registry error for the kernel; what has no errno is
// logged, since the kernel will only say EIO.
func (f *FS) errno(op string, err error) syscall.Errno {
	if err == nil {
		return 0
	}
	var e syscall.Errno
	if errors.As(err, &e) && e != syscall.EIO {
		return e
	}
	f.log.Error("fuse "+op, "err", err)
	return syscall.EIO
}

// spaceErrno is errno for operations that allocate: a device out of memory
// is a full file system to a program writing a file.
func (f *FS) spaceErrno(op string, err error) syscall.Errno {
	e := f.errno(op, err)
	if e == syscall.ENOMEM {
		return syscall.ENOSPC
	}
	return e
}

func fillAttr(a *fuse.Attr, inf segment.Info) {
	a.Ino = inf.ID
	a.Size = uint64(inf.Size)
	a.Blocks = uint64(inf.AllocSize+511) / 512
	// cp sizes its buffer by st_blksize: ask for requests as large as the
	// kernel will send.
	a.Blksize = MaxIO
	a.Mode = syscall.S_IFREG | inf.Mode
	a.Nlink = 0
	if inf.Linked {
		a.Nlink = 1
	}
	a.Owner = fuse.Owner{Uid: inf.UID, Gid: inf.GID}
	m := inf.Modified
	a.SetTimes(&m, &m, &m)
}
