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
package segment
