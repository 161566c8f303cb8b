package server

import (
	"errors"
	"fmt"
	"os"
	"slices"
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
// The descriptor is the client's, and the client's authority is all it
// carries: the daemon runs as root, so whatever it did with the file beyond
// what the descriptor allows would be done with root's rights.
// checkClientFile decides before any copy (docs/security.md, "Descriptors
// and paths from clients"), and the copy then reads and writes only through
// that descriptor: it is never opened again (xfer.Options.Borrowed). Only
// regular files of file systems that hold data (and, for dump, /dev/null,
// /dev/zero and /dev/full) are taken, so a copy ends (unless a file
// system's reads stall: see copyLimits) and no kernel interface acts on
// the daemon's privileges; a copy holds no worker (it is set aside, as a
// waiting open is), and copylimits.go says how many run.

// XferTarget is implemented by the backends' memories: the memory mapped
// in the daemon, for the copy engine.
type XferTarget interface {
	XferTarget() (xfer.Target, error)
}

func (c *conn) copyFile(req *wire.Request, fd int) (*wire.Reply, int) {
	f := os.NewFile(uintptr(fd), "client file")
	defer f.Close()
	rep, err := c.copyFileErr(req, f, fd)
	if err != nil {
		return fail(fmt.Errorf("%s: %w", req.Op, err))
	}
	return rep, -1
}

// copyFileErr copies between the segment and f, whose descriptor is fd.
// The daemon never calls f.Fd: it would put a non-blocking descriptor in
// blocking mode, on the description the client shares.
func (c *conn) copyFileErr(req *wire.Request, f *os.File, fd int) (*wire.Reply, error) {
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
	st, err := statClientFile(fill, fd)
	if err != nil {
		return nil, err
	}
	if fill && req.Offset+req.Size > st.Size {
		return nil, fmt.Errorf("%d bytes at %d: past the end of the %d-byte file: %w", req.Size, req.Offset, st.Size, syscall.EINVAL)
	}
	mem := c.s.reg.Memory(seg)
	xt, ok := mem.(XferTarget)
	if !ok || mem == nil {
		return nil, fmt.Errorf("segment %d's memory cannot be copied by the daemon: %w", req.Segment, syscall.ENOSYS)
	}
	slot, err := c.s.copies.enter(c.cred.UID, copyWaiter{
		aside: func() { c.s.setAside(c.w) }, gone: c.hungUp, stop: c.s.waitStopped()})
	if err != nil {
		return nil, err
	}
	defer slot.leave()
	// A copy of gigabytes must not hold one of the workers.
	c.s.setAside(c.w)
	ctx, unwatch := c.watchClient(slot)
	defer unwatch()
	t, err := xt.XferTarget()
	if err != nil {
		return nil, err
	}
	r := []xfer.Range{{File: f, Off: req.Offset, Len: req.Size, At: req.At}}
	o := &xfer.Options{Borrowed: true}
	var cs xfer.Stats
	if fill {
		// What was there is overwritten, whatever comes of the copy.
		c.s.reg.Filling(cred, seg)
		c.s.reg.ForgetSources(seg, req.At, req.Size)
		cs, err = xfer.Load(ctx, t, r, &xfer.Options{Borrowed: true, CRC32C: true})
	} else {
		cs, err = xfer.Store(ctx, t, r, o)
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
		if fill {
			c.recordSource(seg, fd, st, req, cs.CRC32C[0])
		}
	}
	return rep, nil
}

// recordSource records that seg's range was filled from the file whose
// descriptor is fd, if the file is as it was before the copy (st): the
// daemon's own word on which bytes are the file's (segment/sources.go),
// which loaders trust where they trust no client's.
func (c *conn) recordSource(seg *segment.Segment, fd int, st *unix.Stat_t, req *wire.Request, crc uint32) {
	var now unix.Stat_t
	if unix.Fstat(fd, &now) != nil || now.Dev != st.Dev || now.Ino != st.Ino || now.Size != st.Size ||
		now.Mtim != st.Mtim || now.Ctim != st.Ctim {
		return // written meanwhile: these bytes may be no state the file was ever in
	}
	c.s.reg.AddSource(segment.Cred{UID: c.cred.UID, GID: c.cred.GID}, seg, segment.Source{
		Dev: st.Dev, Ino: st.Ino, Size: st.Size, MtimeNS: st.Mtim.Nano(), CtimeNS: st.Ctim.Nano(),
		Off: req.Offset, At: req.At, Len: req.Size, CRC32C: crc,
	})
}

// statClientFile checks fd, a descriptor a client sent with fill or dump,
// with checkClientFile, and returns its fstat.
func statClientFile(fill bool, fd int) (*unix.Stat_t, error) {
	fl, err := unix.FcntlInt(uintptr(fd), unix.F_GETFL, 0)
	if err != nil {
		return nil, fmt.Errorf("the file's flags: %w", err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("the file: %w", err)
	}
	var fs unix.Statfs_t
	if err := unix.Fstatfs(fd, &fs); err != nil {
		return nil, fmt.Errorf("the file's file system: %w", err)
	}
	if err := checkClientFile(fill, fl, st.Mode, st.Rdev, int64(fs.Type)); err != nil {
		return nil, err
	}
	return &st, nil
}

// checkClientFile says whether a descriptor a client sent may be copied
// from (fill) or to (dump), from its flags (F_GETFL), its mode and device
// (fstat) and its file system's type (fstatfs). nil means yes; EBADF, a
// descriptor without the access the copy needs; EINVAL, a file the daemon
// does not copy. Whatever it allows, the copy does through the descriptor
// itself, so the kernel checks every read and write against the access the
// client opened it with.
//
// What it refuses, and why:
//   - O_PATH: the descriptor grants no access to the data at all (reads and
//     writes through it fail). Reopening it through /proc/self/fd would
//     check permissions as the daemon, root: that was how a client could
//     have any file copied.
//   - fill without read access, dump without write access (O_WRONLY for a
//     fill, O_RDONLY for a dump, and the access mode 3 that grants
//     neither).
//   - anything but a regular file, and for dump /dev/null, /dev/zero and
//     /dev/full: a directory; a pipe, FIFO or socket (a copy must end, and
//     a client copies a stream itself); a block device; any other device,
//     whose driver acts as the process that reads or writes it, the daemon
//     (some check capabilities then, not when the device was opened).
//   - a regular file of a file system whose files are kernel interfaces
//     rather than data (proc, sysfs, cgroup, debugfs, anonymous inodes such
//     as eventfds, ...): their handlers may decide by the credentials of the
//     caller at the time of the read or write, which would be root's. A
//     client could otherwise have its own /proc/PID/oom_score_adj or
//     loginuid written with privileges it lacks, or read the parts of a
//     PCI device's config space that sysfs shows only to CAP_SYS_ADMIN.
//   - dump to a descriptor opened with O_APPEND: pwrite appends there
//     whatever the offset, so the chunks the copiers write in parallel
//     would land out of order.
func checkClientFile(fill bool, flags int, mode uint32, rdev uint64, fsType int64) error {
	op, need, flag := "dump", "writing", "O_WRONLY or O_RDWR"
	if fill {
		op, need, flag = "fill", "reading", "O_RDONLY or O_RDWR"
	}
	if flags&unix.O_PATH != 0 {
		return fmt.Errorf("the descriptor was opened with O_PATH, which gives no access to the file's data: %s needs one opened for %s (%s): %w", op, need, flag, syscall.EBADF)
	}
	switch mode & unix.S_IFMT {
	case unix.S_IFREG:
		if name, ok := kernelFS[fsType]; ok {
			return fmt.Errorf("the file is on %s, whose files are kernel interfaces that act with the daemon's privileges, not the client's: %s copies only files that hold data: %w", name, op, syscall.EINVAL)
		}
	case unix.S_IFCHR:
		if fill {
			return fmt.Errorf("fill reads a regular file, not a device: %w", syscall.EINVAL)
		}
		if unix.Major(rdev) != 1 || !slices.Contains([]uint32{3, 5, 7}, unix.Minor(rdev)) {
			return fmt.Errorf("dump writes a regular file, /dev/null, /dev/zero or /dev/full, not device %d:%d, whose driver would act with the daemon's privileges: %w", unix.Major(rdev), unix.Minor(rdev), syscall.EINVAL)
		}
	case unix.S_IFDIR:
		return fmt.Errorf("the descriptor is a directory: %s needs a regular file: %w", op, syscall.EINVAL)
	case unix.S_IFIFO, unix.S_IFSOCK:
		return fmt.Errorf("the descriptor is a pipe or socket (mode %#o): %s needs a regular file, and the client copies streams itself: %w", mode&unix.S_IFMT, op, syscall.EINVAL)
	default:
		return fmt.Errorf("the file is not a regular file (mode %#o): %s needs one: %w", mode&unix.S_IFMT, op, syscall.EINVAL)
	}
	acc := flags & unix.O_ACCMODE
	if fill && acc != unix.O_RDONLY && acc != unix.O_RDWR || !fill && acc != unix.O_WRONLY && acc != unix.O_RDWR {
		return fmt.Errorf("the descriptor is not open for %s (%s): %s reads and writes only through it, with the access the client opened it with: open it %s: %w", need, accessName(acc), op, flag, syscall.EBADF)
	}
	if !fill && flags&unix.O_APPEND != 0 {
		return fmt.Errorf("the descriptor was opened with O_APPEND, where a write at an offset lands at the end: dump writes at the offsets asked; open it without O_APPEND: %w", syscall.EINVAL)
	}
	return nil
}

func accessName(acc int) string {
	switch acc {
	case unix.O_RDONLY:
		return "opened O_RDONLY"
	case unix.O_WRONLY:
		return "opened O_WRONLY"
	case unix.O_RDWR:
		return "opened O_RDWR"
	}
	return fmt.Sprintf("access mode %d, neither reading nor writing", acc)
}

// kernelFS names the file systems whose regular files are kernel
// interfaces, not data (checkClientFile). Those without a constant in
// x/sys/unix carry their magic number from linux/magic.h.
var kernelFS = map[int64]string{
	unix.PROC_SUPER_MAGIC:      "proc",
	unix.SYSFS_MAGIC:           "sysfs",
	unix.DEBUGFS_MAGIC:         "debugfs",
	unix.TRACEFS_MAGIC:         "tracefs",
	unix.SECURITYFS_MAGIC:      "securityfs",
	unix.CGROUP_SUPER_MAGIC:    "cgroup",
	unix.CGROUP2_SUPER_MAGIC:   "cgroup2",
	unix.BPF_FS_MAGIC:          "bpf",
	unix.PSTOREFS_MAGIC:        "pstore",
	unix.EFIVARFS_MAGIC:        "efivarfs",
	unix.SELINUX_MAGIC:         "selinuxfs",
	unix.SMACK_MAGIC:           "smackfs",
	unix.AAFS_MAGIC:            "apparmorfs",
	unix.BINFMTFS_MAGIC:        "binfmt_misc",
	unix.BINDERFS_SUPER_MAGIC:  "binderfs",
	unix.RDTGROUP_SUPER_MAGIC:  "resctrl",
	unix.XENFS_SUPER_MAGIC:     "xenfs",
	unix.OPENPROM_SUPER_MAGIC:  "openpromfs",
	unix.USBDEVICE_SUPER_MAGIC: "usbfs",
	unix.DEVPTS_SUPER_MAGIC:    "devpts",
	unix.ANON_INODE_FS_MAGIC:   "anonymous inodes (an eventfd, a signalfd, ...)",
	unix.NSFS_MAGIC:            "nsfs",
	unix.PID_FS_MAGIC:          "pidfs",
	unix.SOCKFS_MAGIC:          "sockfs",
	unix.PIPEFS_MAGIC:          "pipefs",
	unix.DMA_BUF_MAGIC:         "dma-buf",
	unix.SECRETMEM_MAGIC:       "secretmem",
	unix.GUEST_MEMFD_MAGIC:     "guest_memfd",
	unix.DEVMEM_MAGIC:          "devmem",
	unix.BDEVFS_MAGIC:          "bdev",
	0x62656570:                 "configfs",
	0x65735543:                 "fusectl",
	0x6e667364:                 "nfsd",
	0x67596969:                 "rpc_pipefs",
	0x19800202:                 "mqueue",
}
