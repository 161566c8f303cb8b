package fusefs

import (
	"context"
	"strconv"
	"syscall"

	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/wire"
)

// Extended attributes. Values are text: decimal numbers, the handle type's
// protocol name, and the segment's JSON metadata verbatim. Only
// user.gpushm.meta may be set or removed (by the owner or root), so that
// files made by cp can be given a manifest.
//
// user.fabric_handle is never listed: the backend exports POSIX file
// descriptors only (fabric handles need an IMEX channel the driver does not
// grant on the machines measured), and a made-up handle would be worse than
// none.
const (
	xattrID         = "user.gpushm.id"
	xattrDevice     = "user.gpushm.device"
	xattrAllocSize  = "user.gpushm.alloc_size"
	xattrHandleType = "user.gpushm.handle_type"
	xattrMeta       = "user.gpushm.meta"
	// xattrAllocation is the name other GPU file systems use for the
	// allocation size.
	xattrAllocation = "user.allocation_size"
)

// xattrs returns the segment's attributes, in listing order.
func xattrs(inf segment.Info) [][2]string {
	out := [][2]string{
		{xattrID, strconv.FormatUint(inf.ID, 10)},
		{xattrDevice, strconv.Itoa(inf.Device)},
		{xattrAllocSize, strconv.FormatInt(inf.AllocSize, 10)},
		{xattrHandleType, inf.HandleType},
		{xattrAllocation, strconv.FormatInt(inf.AllocSize, 10)},
	}
	if len(inf.Meta) > 0 {
		out = append(out, [2]string{xattrMeta, string(inf.Meta)})
	}
	return out
}

// readable is the segment's attributes for a caller who may read it:
// anyone else gets EACCES, as for the user.* attributes of a file one
// cannot read, so that the owner's meta (a bundle's origin paths, a
// model's layout) is not shown to those the mode keeps out
// (docs/security.md, "What others may see"). Listing is refused too,
// which a disk file system allows: the list would tell whether there is
// a meta.
func (n *fileNode) readable(ctx context.Context) ([][2]string, syscall.Errno) {
	inf := n.fs.reg.Info(n.seg)
	if !inf.Allows(cred(ctx), segment.Read) {
		return nil, syscall.EACCES
	}
	return xattrs(inf), 0
}

// Getxattr implements fs.NodeGetxattrer.
func (n *fileNode) Getxattr(ctx context.Context, attr string, dest []byte) (uint32, syscall.Errno) {
	attrs, errno := n.readable(ctx)
	if errno != 0 {
		return 0, errno
	}
	for _, kv := range attrs {
		if kv[0] != attr {
			continue
		}
		if len(dest) < len(kv[1]) {
			return uint32(len(kv[1])), syscall.ERANGE
		}
		return uint32(copy(dest, kv[1])), 0
	}
	return 0, syscall.ENODATA
}

// Listxattr implements fs.NodeListxattrer.
func (n *fileNode) Listxattr(ctx context.Context, dest []byte) (uint32, syscall.Errno) {
	attrs, errno := n.readable(ctx)
	if errno != 0 {
		return 0, errno
	}
	var b []byte
	for _, kv := range attrs {
		b = append(append(b, kv[0]...), 0)
	}
	if len(dest) < len(b) {
		return uint32(len(b)), syscall.ERANGE
	}
	return uint32(copy(dest, b)), 0
}

// Setxattr implements fs.NodeSetxattrer.
func (n *fileNode) Setxattr(ctx context.Context, attr string, data []byte, flags uint32) syscall.Errno {
	switch attr {
	case xattrMeta:
	case xattrID, xattrDevice, xattrAllocSize, xattrHandleType, xattrAllocation:
		return syscall.EPERM
	default:
		return syscall.EOPNOTSUPP
	}
	if len(data) > wire.MaxMeta {
		return syscall.E2BIG
	}
	inf := n.fs.reg.Info(n.seg)
	const create, replace = 1, 2 // XATTR_CREATE, XATTR_REPLACE
	switch {
	case flags&create != 0 && len(inf.Meta) > 0:
		return syscall.EEXIST
	case flags&replace != 0 && len(inf.Meta) == 0:
		return syscall.ENODATA
	case len(data) == 0:
		return syscall.EINVAL
	}
	return n.fs.errno("setxattr", n.fs.reg.SetMeta(cred(ctx), n.seg, data))
}

// Removexattr implements fs.NodeRemovexattrer.
func (n *fileNode) Removexattr(ctx context.Context, attr string) syscall.Errno {
	switch attr {
	case xattrMeta:
	case xattrID, xattrDevice, xattrAllocSize, xattrHandleType, xattrAllocation:
		return syscall.EPERM
	default:
		return syscall.ENODATA
	}
	if len(n.fs.reg.Info(n.seg).Meta) == 0 {
		return syscall.ENODATA
	}
	return n.fs.errno("removexattr", n.fs.reg.SetMeta(cred(ctx), n.seg, nil))
}
