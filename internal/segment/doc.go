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
// a lease. Memory that can change size in place (Resizer: host memory whose
// descriptor no client has had yet) is resized instead of replaced, and
// opens wait while it is (the segment is "moving"). Lend hands out the
// memory's own bytes instead of a copy, for a reply made of them; the
// borrower gives them back (done) once the reply is written. Stamp tells a
// reader that read ahead whether its bytes are still the segment's: every
// change the daemon makes, and every lease taken, moves it. Each segment
// has an io RWMutex: copies hold it shared (a loan until it is given
// back), replacing, resizing or freeing the memory holds it exclusively,
// and it is always taken before the registry mutex, never while holding
// it.
package segment
