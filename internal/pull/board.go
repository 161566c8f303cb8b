package pull

import (
	"encoding/binary"
	"sync/atomic"
	"unsafe"
)

// A board is what a lender publishes beside the bytes it lends, and what
// a fetcher publishes of what it has fetched (for the lender of a chain's
// next node): word 0 counts the chunks ready, in order; word 1 counts the
// chunks a fetcher has taken from a lender's ring (the fetcher writes it,
// with a put); then a CRC-32C per chunk, each written before the count
// that covers it.
type board []byte

const boardHeader = 16

// BoardSize is the size of a board for size bytes, rounded up to pages.
func BoardSize(size int64) int64 {
	n := (size + Chunk - 1) / Chunk
	return (boardHeader + 4*n + 4095) &^ 4095
}

// The board's words are read and written by other processes (a fetcher's
// memfd, mapped by the next lender too) and by UCX on behalf of peers:
// atomics, on memory that mmap aligned.
func (b board) word(i int) *atomic.Uint64 { return (*atomic.Uint64)(unsafe.Pointer(&b[8*i])) }

func (b board) ready() int64       { return int64(b.word(0).Load()) }
func (b board) setReady(n int64)   { b.word(0).Store(uint64(n)) }
func (b board) taken() int64       { return int64(b.word(1).Load()) }
func (b board) crc(i int64) uint32 { return binary.LittleEndian.Uint32(b[boardHeader+4*i:]) }

func (b board) setCRC(i int64, c uint32) {
	(*atomic.Uint32)(unsafe.Pointer(&b[boardHeader+4*i])).Store(c)
}
