package server

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm/internal/crc32c"
	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/wire"
	"github.com/gpushm/gpushm/internal/xfer"
)

// Fill and dump (docs/protocol.md): the daemon copies between a file the
// client sends and a segment the client holds open, with the copy engine
// it keeps warm (a CUDA context, pinned buffers). A client that only moves
// bytes (put, get) then needs no CUDA context of its own, which costs more
// than the copy of a few GiB.
//
// The descriptor is the client's: the daemon reads or writes only what the
// client opened, with the access it opened it with. Only regular files
// (and, for dump, /dev/null and other character devices) are taken, so a
// copy ends; a copy holds no worker (it is set aside, as a waiting open
// is), and at most maxCopies run at once, maxUserCopies for one user.

const (
	maxCopies     = 8
	maxUserCopies = 2
)

// XferTarget is implemented by the backends' memories: the memory mapped
// in the daemon, for the copy engine.
type XferTarget interface {
	XferTarget() (xfer.Target, error)
}

type copyLimits struct {
	mu     sync.Mutex
	all    int
	byUser map[uint32]int
	free   *sync.Cond
}

func (l *copyLimits) enter(uid uint32) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.byUser == nil {
		l.byUser = make(map[uint32]int)
		l.free = sync.NewCond(&l.mu)
	}
	if uid != 0 && l.byUser[uid] >= maxUserCopies {
		return fmt.Errorf("%d copies of user %d already run (limit %d a user): %w", l.byUser[uid], uid, maxUserCopies, syscall.EAGAIN)
	}
	l.byUser[uid]++
	for l.all >= maxCopies {
		l.free.Wait()
	}
	l.all++
	return nil
}

func (l *copyLimits) leave(uid uint32) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.all--
	if l.byUser[uid]--; l.byUser[uid] == 0 {
		delete(l.byUser, uid)
	}
	l.free.Signal()
}

func (c *conn) copyFile(req *wire.Request, fd int) (*wire.Reply, int) {
	f := os.NewFile(uintptr(fd), "client file")
	defer f.Close()
	rep, err := c.copyFileErr(req, f)
	if err != nil {
		return fail(fmt.Errorf("%s: %w", req.Op, err))
	}
	return rep, -1
}

func (c *conn) copyFileErr(req *wire.Request, f *os.File) (*wire.Reply, error) {
	fill := req.Op == wire.OpFill
	l := c.leases[req.Segment]
	if l == nil {
		return nil, fmt.Errorf("this connection holds no open of segment %d: %w", req.Segment, syscall.EINVAL)
	}
	seg := l.seg
	cred := segment.Cred{UID: c.cred.UID, GID: c.cred.GID}
	if seg.IsChannel() {
		return nil, fmt.Errorf("segment %d is a channel: %w", req.Segment, syscall.EINVAL)
	}
	if fill {
		if err := c.s.reg.Access(cred, seg, segment.Write); err != nil {
			return nil, err
		}
	}
	size := c.s.reg.Info(seg).Size
	if req.Size < 0 || req.Offset < 0 || req.At < 0 || req.At > size || req.Size > size-req.At {
		return nil, fmt.Errorf("%d bytes at %d of a %d-byte segment (file offset %d): %w", req.Size, req.At, size, req.Offset, syscall.EINVAL)
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return nil, fmt.Errorf("the file: %w", err)
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFREG:
		if fill && req.Offset+req.Size > st.Size {
			return nil, fmt.Errorf("%d bytes at %d: past the end of the %d-byte file: %w", req.Size, req.Offset, st.Size, syscall.EINVAL)
		}
	case unix.S_IFCHR:
		if fill {
			return nil, fmt.Errorf("fill reads a regular file, not a device: %w", syscall.EINVAL)
		}
	default:
		return nil, fmt.Errorf("the file is not a regular file (mode %#o): the client copies streams itself: %w", st.Mode&unix.S_IFMT, syscall.EINVAL)
	}
	mem := c.s.reg.Memory(seg)
	xt, ok := mem.(XferTarget)
	if !ok || mem == nil {
		return nil, fmt.Errorf("segment %d's memory cannot be copied by the daemon: %w", req.Segment, syscall.ENOSYS)
	}
	if err := c.s.copies.enter(c.cred.UID); err != nil {
		return nil, err
	}
	defer c.s.copies.leave(c.cred.UID)
	// A copy of gigabytes must not hold one of the workers.
	c.s.setAside(c.w)
	t, err := xt.XferTarget()
	if err != nil {
		return nil, err
	}
	r := []xfer.Range{{File: f, Off: req.Offset, Len: req.Size, At: req.At}}
	var cs xfer.Stats
	if fill {
		cs, err = xfer.Load(t, r, &xfer.Options{CRC32C: true})
	} else {
		cs, err = xfer.Store(t, r, nil)
	}
	if err != nil {
		var errno syscall.Errno
		if !errors.As(err, &errno) {
			err = fmt.Errorf("%w: %w", err, syscall.EIO)
		}
		return nil, err
	}
	rep := &wire.Reply{Bytes: cs.Bytes, CopySeconds: cs.Elapsed.Seconds(), Copiers: cs.Workers, Direct: cs.Direct}
	if len(cs.CRC32C) == 1 {
		rep.CRC32C = crc32c.Format(cs.CRC32C[0])
	}
	return rep, nil
}
