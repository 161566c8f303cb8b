package bench

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"math/rand/v2"
)

// A pattern is a deterministic byte stream for a seed: a 1 MiB random block,
// stamped at the start of each block with the seed and the block's index, so
// that a misplaced, stale or foreign block is caught, not just a wrong byte.
const patternBlock = 1 << 20

func patternBlockFor(seed uint64) []byte {
	var key [32]byte
	binary.LittleEndian.PutUint64(key[:], seed)
	b := make([]byte, patternBlock)
	rand.NewChaCha8(key).Read(b)
	return b
}

func stamp(b []byte, seed uint64, index int64) {
	if len(b) >= 16 {
		binary.LittleEndian.PutUint64(b, seed)
		binary.LittleEndian.PutUint64(b[8:], uint64(index))
	}
}

// patternReader yields size bytes of seed's pattern.
type patternReader struct {
	block, cur []byte
	seed       uint64
	off, size  int64
}

func newPatternReader(seed uint64, size int64) *patternReader {
	return &patternReader{block: patternBlockFor(seed), cur: make([]byte, patternBlock), seed: seed, size: size}
}

func (p *patternReader) Read(b []byte) (int, error) {
	if p.off >= p.size {
		return 0, io.EOF
	}
	n := 0
	for n < len(b) && p.off < p.size {
		i, within := p.off/patternBlock, p.off%patternBlock
		if within == 0 || n == 0 {
			copy(p.cur, p.block)
			stamp(p.cur, p.seed, i)
		}
		k := copy(b[n:], p.cur[within:min(int64(patternBlock), within+p.size-p.off)])
		n += k
		p.off += int64(k)
	}
	return n, nil
}

// patternChecker is a Writer that fails on the first byte that differs from
// seed's pattern.
type patternChecker struct {
	want *patternReader
	buf  []byte
	off  int64
}

func newPatternChecker(seed uint64, size int64) *patternChecker {
	return &patternChecker{want: newPatternReader(seed, size)}
}

func (c *patternChecker) Write(b []byte) (int, error) {
	if len(c.buf) < len(b) {
		c.buf = make([]byte, len(b))
	}
	want := c.buf[:len(b)]
	if n, _ := io.ReadFull(c.want, want); n != len(b) {
		return 0, fmt.Errorf("got more than the %d bytes expected", c.want.size)
	}
	if !bytes.Equal(b, want) {
		for i := range b {
			if b[i] != want[i] {
				return i, fmt.Errorf("byte %d is %#02x, want %#02x", c.off+int64(i), b[i], want[i])
			}
		}
	}
	c.off += int64(len(b))
	return len(b), nil
}

// done checks that every expected byte arrived.
func (c *patternChecker) done() error {
	if c.off != c.want.size {
		return fmt.Errorf("got %d bytes, want %d", c.off, c.want.size)
	}
	return nil
}
