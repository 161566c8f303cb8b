// Package backend provides the allocators the registry draws on: Host
// (memfd, for machines without a GPU and for CI) and CUDA (VMM allocations
// exported as POSIX file descriptors). Each Memory owns its descriptor and
// closes it in Free.
package backend
