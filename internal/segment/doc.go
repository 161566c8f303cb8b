// Package segment is the registry of named segments: names, sizes, owners,
// modes, user metadata and open counts. It knows nothing of sockets or CUDA;
// it asks an Allocator for memory and holds what it gets.
//
// Lifecycle: Create reserves the name, allocates outside the lock, then makes
// the segment visible; a failed allocation removes the reservation, so a failed
// create leaves nothing behind. Acquire and Release count opens (leases);
// Unlink removes the name at once, and the memory is freed when the last lease
// is released. A segment's Memory, and the descriptor inside it, is owned by
// the registry and freed exactly once.
//
// Locking: one mutex guards every segment's mutable fields and both maps.
// Allocation and freeing run outside it. Concurrent operations on a name that
// is still being created wait for the creation to finish.
//
// Files (the FUSE view, fileops.go and data.go): a segment may be created
// empty (AllowEmpty), with a name and no memory until it is written or
// resized; Acquire refuses it (ErrEmpty). Pin and Unpin count in-daemon
// references (open files): like leases they keep an unlinked segment's
// memory, unlike leases they do not stop a resize, since nothing outside the
// daemon maps the memory through them. The memory is freed when the segment
// is unlinked and has neither leases nor pins. ReadAt, WriteAt, Resize,
// Reserve and Trim copy through the Memory's Data methods; replacing a
// segment's memory (grow, shrink, trim) is refused with ErrBusy while it has
// a lease. Each segment has an io RWMutex: copies hold it shared, replacing
// or freeing the memory holds it exclusively, and it is always taken before
// the registry mutex, never while holding it.
package segment
