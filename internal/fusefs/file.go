package fusefs

import (
	"context"
	"errors"
	"io"
	"sync/atomic"
	"syscall"

	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"

	"github.com/gpushm/gpushm/internal/segment"
)

// fileNode is a segment seen as a file.
type fileNode struct {
	fs.Inode
	fs  *FS
	seg *segment.Segment
}

var (
	_ fs.NodeOpener        = (*fileNode)(nil)
	_ fs.NodeGetattrer     = (*fileNode)(nil)
	_ fs.NodeSetattrer     = (*fileNode)(nil)
	_ fs.NodeAccesser      = (*fileNode)(nil)
	_ fs.NodeGetxattrer    = (*fileNode)(nil)
	_ fs.NodeListxattrer   = (*fileNode)(nil)
	_ fs.NodeSetxattrer    = (*fileNode)(nil)
	_ fs.NodeRemovexattrer = (*fileNode)(nil)
)

// want is the registry access an open with flags needs.
func want(flags uint32) uint32 {
	var w uint32
	switch flags & syscall.O_ACCMODE {
	case syscall.O_RDONLY:
		w = segment.Read
	case syscall.O_WRONLY:
		w = segment.Write
	default:
		w = segment.Read | segment.Write
	}
	if flags&syscall.O_TRUNC != 0 {
		w |= segment.Write
	}
	return w
}

// open checks the caller's access, pins s for a new handle and applies
// O_TRUNC.
func (f *FS) open(ctx context.Context, s *segment.Segment, flags uint32) (*handle, syscall.Errno) {
	if err := f.reg.Pin(cred(ctx), s, want(flags)); err != nil {
		return nil, f.errno("open", err)
	}
	if flags&syscall.O_TRUNC != 0 {
		if err := f.reg.Resize(s, 0); err != nil {
			f.reg.Unpin(s)
			return nil, f.spaceErrno("open", err)
		}
	}
	return f.newHandle(s, flags), 0
}

// newHandle makes the handle for a segment the caller has pinned.
func (f *FS) newHandle(s *segment.Segment, flags uint32) *handle {
	h := &handle{fs: f, seg: s, writable: flags&syscall.O_ACCMODE != syscall.O_RDONLY}
	if flags&syscall.O_ACCMODE != syscall.O_WRONLY {
		h.ra = &readAhead{fs: f, seg: s}
	}
	if h.writable {
		f.addWriter(s)
	}
	return h
}

// Open implements fs.NodeOpener. Files are direct I/O: every read and
// write reaches the segment's memory, which socket clients share.
func (n *fileNode) Open(ctx context.Context, flags uint32) (fs.FileHandle, uint32, syscall.Errno) {
	h, errno := n.fs.open(ctx, n.seg, flags)
	if errno != 0 {
		return nil, 0, errno
	}
	return h, fuse.FOPEN_DIRECT_IO, 0
}

// Getattr implements fs.NodeGetattrer.
func (n *fileNode) Getattr(ctx context.Context, _ fs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	fillAttr(&out.Attr, n.fs.reg.Info(n.seg))
	return 0
}

// Setattr implements fs.NodeSetattrer: chmod, chown, truncate and utimes.
func (n *fileNode) Setattr(ctx context.Context, fh fs.FileHandle, in *fuse.SetAttrIn, out *fuse.AttrOut) syscall.Errno {
	c, reg := cred(ctx), n.fs.reg
	if mode, ok := in.GetMode(); ok {
		if err := reg.SetMode(c, n.seg, mode&0o7777); err != nil {
			return n.fs.errno("chmod", err)
		}
	}
	uid, uok := in.GetUID()
	gid, gok := in.GetGID()
	if uok || gok {
		u, g := int64(-1), int64(-1)
		if uok {
			u = int64(uid)
		}
		if gok {
			g = int64(gid)
		}
		if err := reg.SetOwner(c, n.seg, u, g); err != nil {
			return n.fs.errno("chown", err)
		}
	}
	if size, ok := in.GetSize(); ok {
		// ftruncate of a file opened for writing is allowed whatever the
		// mode says now; truncate by name needs write permission.
		if h, ok := fh.(*handle); !ok || !h.writable {
			if err := reg.Access(c, n.seg, segment.Write); err != nil {
				return n.fs.errno("truncate", err)
			}
		}
		if size > 1<<62 {
			return syscall.EFBIG
		}
		if err := reg.Resize(n.seg, int64(size)); err != nil {
			return n.fs.spaceErrno("truncate", err)
		}
	}
	if mtime, ok := in.GetMTime(); ok {
		if err := reg.SetTimes(c, n.seg, mtime, in.Valid&fuse.FATTR_MTIME_NOW != 0); err != nil {
			return n.fs.errno("utimes", err)
		}
	} else if _, ok := in.GetATime(); ok {
		// Access times are not kept; check the permission all the same.
		if err := reg.Access(c, n.seg, segment.Write); err != nil && in.Valid&fuse.FATTR_ATIME_NOW == 0 {
			return n.fs.errno("utimes", err)
		}
	}
	fillAttr(&out.Attr, reg.Info(n.seg))
	return 0
}

// Access implements fs.NodeAccesser.
func (n *fileNode) Access(ctx context.Context, mask uint32) syscall.Errno {
	return n.fs.errno("access", n.fs.reg.Access(cred(ctx), n.seg, mask&7))
}

// handle is an open file: one pin on the segment.
type handle struct {
	fs       *FS
	seg      *segment.Segment
	writable bool
	ra       *readAhead // nil for a handle not open for reading
	released atomic.Bool
}

var (
	_ fs.FileReader    = (*handle)(nil)
	_ fs.FileWriter    = (*handle)(nil)
	_ fs.FileFlusher   = (*handle)(nil)
	_ fs.FileFsyncer   = (*handle)(nil)
	_ fs.FileReleaser  = (*handle)(nil)
	_ fs.FileAllocater = (*handle)(nil)
)

// Read implements fs.FileReader. Host memory is lent: the reply is written
// from the daemon's own mapping of the memfd, with no copy in the daemon.
// Other memory is copied (on cuda, through a pinned buffer) into the
// request's buffer, or was, ahead of a sequential reader (readahead.go).
func (h *handle) Read(ctx context.Context, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	if h.fs.lend {
		b, done, err := h.fs.reg.Lend(h.seg, off, len(dest))
		switch {
		case err == nil || errors.Is(err, io.EOF):
			if len(b) == 0 {
				// go-fuse does not call Done for an empty reply.
				done()
				return fuse.ReadResultData(nil), 0
			}
			return &lentBytes{b: b, done: done}, 0
		case !errors.Is(err, segment.ErrNoData):
			return nil, h.fs.errno("read", err)
		}
	}
	if h.ra != nil {
		if rr, ok := h.ra.serve(off, len(dest)); ok {
			return rr, 0
		}
	}
	n, err := h.fs.reg.ReadAt(h.seg, dest, off)
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, h.fs.errno("read", err)
	}
	if h.ra != nil {
		h.ra.after(off, n, len(dest))
	}
	return fuse.ReadResultData(dest[:n]), 0
}

// lentBytes is a reply made of a segment's own bytes (Registry.Lend),
// given back once the reply is written.
type lentBytes struct {
	b    []byte
	done func()
}

func (l *lentBytes) Size() int                          { return len(l.b) }
func (l *lentBytes) Bytes([]byte) ([]byte, fuse.Status) { return l.b, fuse.OK }

// Slices makes go-fuse write the reply from the bytes themselves (writev).
func (l *lentBytes) Slices() ([][]byte, fuse.Status) { return [][]byte{l.b}, fuse.OK }
func (l *lentBytes) Done()                           { l.done() }

// Write implements fs.FileWriter. The bytes are in the segment's memory,
// visible to every process mapping it, when it returns.
func (h *handle) Write(ctx context.Context, data []byte, off int64) (uint32, syscall.Errno) {
	if !h.writable {
		return 0, syscall.EBADF
	}
	n, err := h.fs.reg.WriteAt(h.seg, data, off)
	if err != nil {
		return 0, h.fs.spaceErrno("write", err)
	}
	return uint32(n), 0
}

// Flush implements fs.FileFlusher; close(2) waits for it. The last
// writable handle gives back the slack of growing writes here, so that by
// the time cp exits the segment is the size a socket client expects.
func (h *handle) Flush(ctx context.Context) syscall.Errno {
	if h.writable && h.fs.writerCount(h.seg) == 1 {
		h.trim()
	}
	return h.fs.errno("flush", h.fs.reg.Sync(h.seg))
}

func (h *handle) trim() {
	err := h.fs.reg.Trim(h.seg)
	if err != nil && !errors.Is(err, segment.ErrNotFound) {
		// The slack stays until the next trim; nothing is lost.
		h.fs.log.Warn("fuse: trim after write", "err", err)
	}
}

// Fsync implements fs.FileFsyncer.
func (h *handle) Fsync(ctx context.Context, flags uint32) syscall.Errno {
	return h.fs.errno("fsync", h.fs.reg.Sync(h.seg))
}

// Release implements fs.FileReleaser: the handle's pin ends, and with it,
// for an unlinked file, possibly the memory.
func (h *handle) Release(ctx context.Context) syscall.Errno {
	if h.released.Swap(true) {
		return 0
	}
	if h.ra != nil {
		h.ra.close()
	}
	if h.writable && h.fs.dropWriter(h.seg) {
		h.trim()
	}
	return h.fs.errno("release", h.fs.reg.Unpin(h.seg))
}

// Allocate implements fs.FileAllocater: fallocate(2) mode 0 extends the
// file with zeros; FALLOC_FL_KEEP_SIZE reserves memory for later writes
// (given back when the last writer closes). Other modes are not supported.
func (h *handle) Allocate(ctx context.Context, off, size uint64, mode uint32) syscall.Errno {
	if !h.writable {
		return syscall.EBADF
	}
	end := off + size
	if end < off || end > 1<<62 {
		return syscall.EFBIG
	}
	const keepSize = 1 // FALLOC_FL_KEEP_SIZE
	var err error
	switch mode {
	case 0:
		if inf := h.fs.reg.Info(h.seg); int64(end) > inf.Size {
			err = h.fs.reg.Resize(h.seg, int64(end))
		}
	case keepSize:
		err = h.fs.reg.Reserve(h.seg, int64(end))
	default:
		return syscall.EOPNOTSUPP
	}
	return h.fs.spaceErrno("fallocate", err)
}
