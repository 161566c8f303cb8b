// Package fusefs is the FUSE view of the registry: a flat directory in
// which every named segment is a regular file, and every regular file is a
// named segment. `cp model.bin /mnt/gpushm/` uploads, `ls -l` lists what is
// resident, `rm` frees; a file made here is a segment every socket client
// can open by name, and a segment made through the socket is a file here.
//
// # Files and segments
//
// An inode is a *segment.Segment, and its inode number is the segment's ID,
// which the registry never reuses: a name unlinked and created again is a
// new inode. The kernel caches nothing (entry, attribute and negative
// timeouts are 0, and files are opened with FOPEN_DIRECT_IO), because the
// registry changes behind the kernel's back through the socket, and because
// socket clients write the same memory directly: every read and write here
// goes to or from the segment's memory, never the page cache. Only mmap
// goes through the page cache (FUSE_DIRECT_IO_ALLOW_MMAP), which the
// kernel drops at every open: docs/fuse.md, "mmap".
//
// A read of host memory is answered from the daemon's own mapping of the
// memfd (Registry.Lend), which the kernel copies into the reader's buffer:
// no copy in the daemon. Other memory (a GPU's) is copied into the reply;
// for a reader reading sequentially, ahead of its requests, on a goroutine
// (readahead.go), and served only while Registry.Stamp says nothing can
// have changed it since.
//
// A file created empty is a segment with no memory (segment.CreateOptions
// AllowEmpty); the first write or truncate allocates. Socket clients see it
// in list and stat with size 0, and an open of it fails with EINVAL.
//
// # Ownership
//
//   - The registry owns every segment's memory and descriptor. This package
//     never sees a descriptor: it reads and writes through
//     Registry.ReadAt/WriteAt, which reach the backend's daemon-side mapping
//     (an mmap of the memfd, or a cuMemMap of the allocation made on first
//     use and kept until the memory is freed).
//   - Each open file (a handle) holds one registry pin on its segment, taken
//     in Open or Create and given back in Release. A pin keeps the memory
//     after unlink, as an open file keeps an unlinked file's data, but,
//     unlike a socket lease, does not stop the file from being resized.
//   - The Server owns the go-fuse server and the mount; Unmount ends both.
//
// # Lifecycle
//
// Mount cleans a stale mount left by a daemon that died (stat of the
// directory fails with ENOTCONN; it is lazily unmounted), mounts, and serves
// until Unmount. The daemon unmounts before it closes the registry, so no
// request meets a closed registry in normal shutdown.
//
// Writes past the end grow the segment: host memory no client has had a
// descriptor of grows in place (ftruncate of its memfd), other memory is
// replaced by memory twice as large, so a file written sequentially by cp
// is copied O(1) times per byte; the slack is given back (Registry.Trim)
// when the last writable handle is flushed or released. Growing, shrinking
// and trimming are refused with EBUSY while a socket client holds the
// segment open, since it may have the memory mapped.
//
// # Permissions
//
// The mount does not use default_permissions: the registry is the single
// authority, with the caller's uid and gid from the FUSE request. Open
// checks the mode as the socket's open does; unlink and rename follow the
// sticky-directory rule of /dev/shm (owner or root); chmod needs the owner
// or root, chown root (or the owner, to its own group). The root directory
// is mode 01777. When the daemon runs as root the mount is allow_other, so
// every user reaches it; otherwise only the mounting user does.
//
// # Locking
//
// This package keeps FS.mu, over the count of writable handles per
// segment; FS.raMu over read-ahead's buffers and FS.bgMu over its
// goroutines; and a mutex per handle's read-ahead, taken before FS.raMu.
// None is held across a registry call. The registry's order is Segment.io,
// then Registry.mu (see package segment); a lent reply holds Segment.io
// shared from Read until go-fuse has written it (Done).
//
// Read-ahead's goroutines belong to the FS: they run only while a handle
// has chunks to read, and Server.Unmount waits for them.
package fusefs
