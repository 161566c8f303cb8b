package fusefs

import (
	"context"
	"errors"
	"syscall"

	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"

	"github.com/gpushm/gpushm/internal/segment"
)

// rootNode is the mount's only directory.
type rootNode struct {
	fs.Inode
	fs *FS
}

var (
	_ fs.NodeLookuper  = (*rootNode)(nil)
	_ fs.NodeReaddirer = (*rootNode)(nil)
	_ fs.NodeCreater   = (*rootNode)(nil)
	_ fs.NodeUnlinker  = (*rootNode)(nil)
	_ fs.NodeRenamer   = (*rootNode)(nil)
	_ fs.NodeGetattrer = (*rootNode)(nil)
	_ fs.NodeAccesser  = (*rootNode)(nil)
	_ fs.NodeStatfser  = (*rootNode)(nil)
	_ fs.NodeMkdirer   = (*rootNode)(nil)
	_ fs.NodeSymlinker = (*rootNode)(nil)
	_ fs.NodeLinker    = (*rootNode)(nil)
	_ fs.NodeMknoder   = (*rootNode)(nil)
)

func (r *rootNode) child(ctx context.Context, s *segment.Segment) *fs.Inode {
	return r.NewInode(ctx, &fileNode{fs: r.fs, seg: s}, fs.StableAttr{Mode: syscall.S_IFREG, Ino: s.ID()})
}

// Lookup implements fs.NodeLookuper.
func (r *rootNode) Lookup(ctx context.Context, name string, out *fuse.EntryOut) (*fs.Inode, syscall.Errno) {
	s, inf, err := r.fs.reg.Lookup(name)
	if err != nil {
		return nil, r.fs.errno("lookup", err)
	}
	fillAttr(&out.Attr, inf)
	return r.child(ctx, s), 0
}

// Readdir implements fs.NodeReaddirer.
func (r *rootNode) Readdir(ctx context.Context) (fs.DirStream, syscall.Errno) {
	var ents []fuse.DirEntry
	after := ""
	for {
		page := r.fs.reg.List(after, 1024)
		if len(page) == 0 {
			break
		}
		for _, inf := range page {
			ents = append(ents, fuse.DirEntry{Name: inf.Name, Ino: inf.ID, Mode: syscall.S_IFREG})
		}
		after = page[len(page)-1].Name
	}
	return fs.NewListDirStream(ents), 0
}

// Create implements fs.NodeCreater: an empty segment, owned by the caller,
// pinned by the handle returned. Creating needs no permission: the
// directory is world-writable, like /dev/shm.
func (r *rootNode) Create(ctx context.Context, name string, flags, mode uint32, out *fuse.EntryOut) (*fs.Inode, fs.FileHandle, uint32, syscall.Errno) {
	c := cred(ctx)
	s, _, err := r.fs.reg.Create(c, segment.CreateOptions{
		Name: name, AllowEmpty: true, Device: r.fs.backend.DefaultDevice(),
		Mode: mode & 0o777, UseMode: true, Pin: true,
	})
	if errors.Is(err, segment.ErrExist) && flags&syscall.O_EXCL == 0 {
		// The name appeared after the kernel's lookup: open it, as
		// open(O_CREAT) without O_EXCL would have.
		var inf segment.Info
		if s, inf, err = r.fs.reg.Lookup(name); err != nil {
			return nil, nil, 0, r.fs.errno("create", err)
		}
		h, errno := r.fs.open(ctx, s, flags)
		if errno != 0 {
			return nil, nil, 0, errno
		}
		fillAttr(&out.Attr, inf)
		return r.child(ctx, s), h, fuse.FOPEN_DIRECT_IO, 0
	}
	if err != nil {
		return nil, nil, 0, r.fs.spaceErrno("create", err)
	}
	fillAttr(&out.Attr, r.fs.reg.Info(s))
	return r.child(ctx, s), r.fs.newHandle(s, flags), fuse.FOPEN_DIRECT_IO, 0
}

// Unlink implements fs.NodeUnlinker: the name goes at once, the memory
// when the last open file, lease and pin are gone.
func (r *rootNode) Unlink(ctx context.Context, name string) syscall.Errno {
	return r.fs.errno("unlink", r.fs.reg.Unlink(cred(ctx), name))
}

// Rename implements fs.NodeRenamer, with RENAME_NOREPLACE and
// RENAME_EXCHANGE.
func (r *rootNode) Rename(ctx context.Context, name string, newParent fs.InodeEmbedder, newName string, flags uint32) syscall.Errno {
	if newParent.EmbeddedInode() != r.EmbeddedInode() {
		return syscall.EXDEV
	}
	return r.fs.errno("rename", r.fs.reg.Rename(cred(ctx), name, newName, flags))
}

// Getattr implements fs.NodeGetattrer.
func (r *rootNode) Getattr(ctx context.Context, _ fs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	out.Mode = syscall.S_IFDIR | syscall.S_ISVTX | 0o777
	out.Nlink = 2
	out.Owner = fuse.Owner{Uid: r.fs.uid, Gid: r.fs.gid}
	out.Blksize = MaxIO
	t := r.fs.start
	out.SetTimes(&t, &t, &t)
	return 0
}

// Access implements fs.NodeAccesser: mode 01777 grants everyone everything.
func (r *rootNode) Access(ctx context.Context, mask uint32) syscall.Errno { return 0 }

// Statfs implements fs.NodeStatfser: the memory of the device that files
// created here go to.
func (r *rootNode) Statfs(ctx context.Context, out *fuse.StatfsOut) syscall.Errno {
	devs, err := r.fs.backend.Devices()
	if err != nil {
		return r.fs.errno("statfs", err)
	}
	const bsize = 4096
	want := r.fs.backend.DefaultDevice()
	for _, d := range devs {
		if d.Index != want {
			continue
		}
		out.Bsize, out.Frsize = bsize, bsize
		out.Blocks = d.TotalBytes / bsize
		out.Bfree = d.FreeBytes / bsize
		out.Bavail = out.Bfree
		// Segments are not limited in number; say so generously.
		const files = 1 << 32
		out.Files = files
		out.Ffree = files - uint64(r.fs.reg.Usage().Named)
		out.NameLen = segment.MaxName
		return 0
	}
	r.fs.log.Error("fuse statfs: default device not among the backend's devices", "device", want)
	return syscall.EIO
}

// The namespace is flat, and a segment has one name: no directories, links
// or special files.

// Mkdir implements fs.NodeMkdirer.
func (r *rootNode) Mkdir(context.Context, string, uint32, *fuse.EntryOut) (*fs.Inode, syscall.Errno) {
	return nil, syscall.EPERM
}

// Symlink implements fs.NodeSymlinker.
func (r *rootNode) Symlink(context.Context, string, string, *fuse.EntryOut) (*fs.Inode, syscall.Errno) {
	return nil, syscall.EPERM
}

// Link implements fs.NodeLinker.
func (r *rootNode) Link(context.Context, fs.InodeEmbedder, string, *fuse.EntryOut) (*fs.Inode, syscall.Errno) {
	return nil, syscall.EPERM
}

// Mknod implements fs.NodeMknoder: the kernel uses Create for regular
// files, so only special files arrive here.
func (r *rootNode) Mknod(context.Context, string, uint32, uint32, *fuse.EntryOut) (*fs.Inode, syscall.Errno) {
	return nil, syscall.EPERM
}
