// Package layout turns a Hugging Face checkpoint directory (safetensors
// shards, maybe an index, and small files such as config.json and the
// tokenizer's) into the layout of one bundle segment, and reads that layout
// back. It moves no bytes itself: Scan checks every shard's header and says
// which byte ranges of which open file go where in the segment; the caller
// copies them. docs/protocol.md ("Metadata conventions") specifies the
// layout and the meta; this package is its reference.
//
// The segment, in order (every part starting at a multiple of Align):
//
//	[0, 8+N)        the 8-byte length N and the combined safetensors header,
//	                naming every tensor of every shard, offsets rebased
//	data            each shard's data region (everything after its own
//	                header, gaps included), shard after shard
//	files           the small files, byte for byte
//	headers         each shard's original first 8+N bytes
//	shard table     JSON: where each shard's header and data lie, so that
//	                the shard files can be written back byte for byte
//
// [0, end of data) is a valid safetensors file whose tensors are exactly
// those of the shards. The meta lists the small files and points at the
// shard table.
//
// Scan opens every file it plans to read and keeps it open until Close, so
// that what is copied is what was checked (a file replaced by rename after
// Scan is not read).
package layout
