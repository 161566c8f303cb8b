// Package disk is the daemon's disk tier: a store of copies of segments,
// each under a key the daemon chooses, striped over directories (one per
// drive) and read back whole, verified, after a crash or a reboot.
//
// # Files
//
// Each directory holds gpushm-disk.id, its id (a random 16 bytes, in hex),
// and the files of the copies; nothing else of the store's. A copy of key
// K, generation G (nanoseconds of the clock when it was begun, and higher
// than any the store has seen) has, in each directory that holds a stripe
// of it, H-G.j.data and H-G.manifest, where H is hex of the first 16 bytes
// of K's SHA-256, so that no key reaches outside the directory, and j is
// the stripe's index. Chunk i (Options.Chunk bytes, 64 MiB by default) is
// in stripe i mod n, of n = min(directories, chunks) stripes, stripe 0 in
// a directory picked by the key so that small copies spread; a stripe's
// chunks lie one after the other in its data file, the last chunk of the
// copy padded with zeros to the O_DIRECT alignment. The manifest, the same
// in each of the copy's directories, holds the key, Meta, the size, the
// chunk, the alignment, the generation, the time, the stripes' directory
// ids (so that directories may be given in another order, or at other
// paths), the CRC-32C of each chunk's bytes, and its own CRC-32C.
//
// # Commit and recovery
//
// Write writes and fsyncs the data files under the new generation's names
// (never over the old copy's), then writes the manifest into the
// directories of stripes n-1 down to 0, each aside (H-G.manifest.tmp),
// fsynced, renamed and its directory fsynced. The rename in stripe 0's
// directory is the commit: a copy is committed if and only if its manifest
// is there. Then the key's previous copy is removed, its stripe-0
// manifest first. Remove removes in the same order: the stripe-0
// manifest's removal is the removal's point.
//
// Open recovers from a crash at any point: it removes temporary files
// (.tmp), the files of copies not committed, and of each key every copy
// but the newest committed one. A copy one of whose directories was not
// given to Open is kept but not served (and no older copy of its key is
// served instead); so is a copy whose manifests all fail their checksum,
// which is removed. Names the store does not make are left alone; so are
// files of its names that are not regular files of the daemon's uid
// (symbolic links), never followed.
//
// # Trust
//
// The directories are the daemon's: 0700, owned by its uid, opened once
// with O_NOFOLLOW and held; every file is opened relative to them with
// O_NOFOLLOW, made 0600, and checked to be a regular file of the daemon's
// before it is read. A directory others may write is refused, one others
// may read is narrowed; each is locked (flock) so that no two stores, in
// any processes, share it. Every byte read is checked against its chunk's
// CRC-32C before a Sink is given it.
//
// # I/O
//
// Each directory has Options.Streams lanes (1 by default) of two staging
// buffers of a chunk each, mapped page-aligned outside the Go heap, made
// and pinned (Options.Pin) on first use and kept until Close. A Write or
// Read runs one goroutine pair per stripe and lane: while one goroutine
// reads or writes a buffer with O_DIRECT, the other fills or drains the
// other buffer through the caller's Source or Sink, checksumming it. So
// all directories move at once, and the caller's copy (for a GPU, into or
// out of pinned memory) overlaps the drive's. Operations on different
// keys share the lanes; Writes of one key run one after the other. A file
// system that refuses O_DIRECT (tmpfs before Linux 6.6) is written and
// read through the page cache, with the same fsyncs; Direct says so.
//
// # Locking
//
// Store.mu guards the index of committed copies, the bytes in use and the
// keys being written. A Read opens its files under it (read-locked), so
// that a commit or Remove, which takes it before removing a copy's files,
// never removes them under an open; after that the open descriptors keep
// the bytes. Whoever takes a copy out of the index removes its files.
// Close waits for the Writes and Reads in flight.
package disk
