package gpushm

import (
	"errors"
	"io"

	"github.com/gpushm/gpushm/internal/xfer"
)

// ReadFrom fills the segment from r, from offset 0, until r ends or the
// segment is full. On cuda the bytes go through two pinned staging buffers,
// so reading the next chunk overlaps copying the last one to the GPU
// (internal/xfer, the engine LoadFiles uses too).
func (m *Mapping) ReadFrom(r io.Reader) (int64, error) {
	if m.readOnly {
		return 0, errors.New("gpushm: write to a read-only mapping")
	}
	return xfer.ReadStream(m.target(), r)
}

// WriteTo writes the segment's Size bytes to w. On cuda the copy of the
// next chunk from the GPU overlaps writing the last one.
func (m *Mapping) WriteTo(w io.Writer) (int64, error) {
	return xfer.WriteStream(m.target(), w)
}
