package xfer

import (
	"errors"
	"fmt"
	"io"
)

// ReadStream fills t from r, from offset 0, until r ends or t is full, and
// says how many bytes it took. On cuda one copier's two pinned buffers take
// turns, so that reading the next chunk overlaps copying the last one to the
// GPU. For streams (a pipe, a socket); a regular file goes faster through
// Load, which reads it in parallel.
func ReadStream(t Target, r io.Reader) (int64, error) {
	if t.Dev == nil {
		n, err := io.ReadFull(r, t.Host[:t.Size])
		if errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) {
			err = nil
		}
		return int64(n), err
	}
	c := &copier{t: t, chunk: streamChunk(t.Size), loan: &loan{}}
	if _, err := c.open(true, nil, nil); err != nil {
		return 0, err
	}
	var off int64
	for i := 0; off < t.Size; i++ {
		k := i % 2
		// The copy that last used this buffer must finish before it is
		// refilled.
		if err := c.wait(k); err != nil {
			return off, errors.Join(err, c.close())
		}
		n, rerr := io.ReadFull(r, c.buf[k][:min(c.chunk, t.Size-off)])
		if n > 0 {
			if err := c.stream.CopyHtoDAsync(t.Ptr+uint64(off), c.buf[k][:n]); err != nil {
				return off, errors.Join(fmt.Errorf("xfer: copy to device: %w", err), c.close())
			}
			if err := c.ev[k].Record(c.stream); err != nil {
				return off, errors.Join(fmt.Errorf("xfer: record event: %w", err), c.close())
			}
			c.pending[k] = true
			off += int64(n)
		}
		if rerr != nil {
			if errors.Is(rerr, io.EOF) || errors.Is(rerr, io.ErrUnexpectedEOF) {
				break
			}
			return off, errors.Join(rerr, c.close())
		}
	}
	return off, errors.Join(c.finish(), c.close())
}

// WriteStream writes t's Size bytes to w. On cuda the copy of the next chunk
// from the GPU overlaps writing the last one.
func WriteStream(t Target, w io.Writer) (int64, error) {
	if t.Dev == nil {
		n, err := w.Write(t.Host[:t.Size])
		return int64(n), err
	}
	c := &copier{t: t, chunk: streamChunk(t.Size), loan: &loan{}}
	if _, err := c.open(true, nil, nil); err != nil {
		return 0, err
	}
	issue := func(i int) error {
		off := int64(i) * c.chunk
		if off >= t.Size {
			return nil
		}
		k := i % 2
		if err := c.stream.CopyDtoHAsync(c.buf[k][:min(c.chunk, t.Size-off)], t.Ptr+uint64(off)); err != nil {
			return fmt.Errorf("xfer: copy from device: %w", err)
		}
		if err := c.ev[k].Record(c.stream); err != nil {
			return fmt.Errorf("xfer: record event: %w", err)
		}
		c.pending[k] = true
		return nil
	}
	if err := issue(0); err != nil {
		return 0, errors.Join(err, c.close())
	}
	var done int64
	for i := 0; done < t.Size; i++ {
		if err := c.wait(i % 2); err != nil {
			return done, errors.Join(err, c.close())
		}
		if err := issue(i + 1); err != nil {
			return done, errors.Join(err, c.close())
		}
		k, err := w.Write(c.buf[i%2][:min(c.chunk, t.Size-done)])
		done += int64(k)
		if err != nil {
			return done, errors.Join(err, c.close())
		}
	}
	return done, c.close()
}

// streamChunk is the buffer size for a stream: the engine's chunk, or less
// for a small target.
func streamChunk(size int64) int64 {
	return max(min(int64(defaultChunk), (size+chunkUnit-1)/chunkUnit*chunkUnit), chunkUnit)
}
