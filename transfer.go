package gpushm

import (
	"errors"
	"fmt"
	"io"

	"github.com/gpushm/gpushm/internal/cuda"
)

// stagingChunk is the size of each pinned staging buffer. Large enough that
// a copy's fixed cost vanishes (a 64 MiB copy runs at full PCIe speed),
// small enough that two of them are cheap.
const stagingChunk = 64 << 20

// ReadFrom fills the segment from r, from offset 0, until r ends or the
// segment is full. On cuda the bytes go through two pinned staging buffers,
// so reading the next chunk overlaps copying the last one to the GPU.
func (m *Mapping) ReadFrom(r io.Reader) (int64, error) {
	if m.readOnly {
		return 0, errors.New("gpushm: write to a read-only mapping")
	}
	if m.host != nil {
		n, err := io.ReadFull(r, m.host[:m.size])
		if errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) {
			err = nil
		}
		return int64(n), err
	}
	st, err := newStaging(m.dev, m.size)
	if err != nil {
		return 0, err
	}
	defer st.close()
	var off int64
	for i := 0; off < m.size; i++ {
		b := st.buf[i%2]
		// The copy that last used this buffer must finish before it is
		// refilled.
		if err := st.wait(i % 2); err != nil {
			return off, err
		}
		n, rerr := io.ReadFull(r, b[:min(int64(len(b)), m.size-off)])
		if n > 0 {
			if err := st.stream.CopyHtoDAsync(m.ptr+uint64(off), b[:n]); err != nil {
				return off, fmt.Errorf("gpushm: copy to device: %w", err)
			}
			if err := st.record(i % 2); err != nil {
				return off, err
			}
			off += int64(n)
		}
		if rerr != nil {
			if errors.Is(rerr, io.EOF) || errors.Is(rerr, io.ErrUnexpectedEOF) {
				break
			}
			st.stream.Synchronize()
			return off, rerr
		}
	}
	if err := st.stream.Synchronize(); err != nil {
		return off, fmt.Errorf("gpushm: copy to device: %w", err)
	}
	return off, nil
}

// WriteTo writes the segment's Size bytes to w. On cuda the copy of the
// next chunk from the GPU overlaps writing the last one.
func (m *Mapping) WriteTo(w io.Writer) (int64, error) {
	if m.host != nil {
		n, err := w.Write(m.host[:m.size])
		return int64(n), err
	}
	st, err := newStaging(m.dev, m.size)
	if err != nil {
		return 0, err
	}
	defer st.close()
	chunk := int64(len(st.buf[0]))
	issue := func(i int) error {
		off := int64(i) * chunk
		if off >= m.size {
			return nil
		}
		n := min(chunk, m.size-off)
		if err := st.stream.CopyDtoHAsync(st.buf[i%2][:n], m.ptr+uint64(off)); err != nil {
			return fmt.Errorf("gpushm: copy from device: %w", err)
		}
		return st.record(i % 2)
	}
	if err := issue(0); err != nil {
		return 0, err
	}
	var done int64
	for i := 0; done < m.size; i++ {
		if err := st.wait(i % 2); err != nil {
			return done, err
		}
		if err := issue(i + 1); err != nil {
			return done, err
		}
		n := min(chunk, m.size-done)
		k, err := w.Write(st.buf[i%2][:n])
		done += int64(k)
		if err != nil {
			st.stream.Synchronize()
			return done, err
		}
	}
	return done, nil
}

// staging is a pair of pinned buffers with a stream and an event per buffer.
type staging struct {
	dev     *cuda.Device
	buf     [2][]byte
	ev      [2]*cuda.Event
	pending [2]bool
	stream  *cuda.Stream
}

func newStaging(dev *cuda.Device, size int64) (st *staging, err error) {
	st = &staging{dev: dev}
	defer func() {
		if err != nil {
			st.close()
			err = fmt.Errorf("gpushm: staging buffers: %w", err)
		}
	}()
	chunk := min(int64(stagingChunk), size)
	for i := range st.buf {
		if st.buf[i], err = dev.AllocHost(chunk); err != nil {
			return st, err
		}
		if st.ev[i], err = dev.NewEvent(); err != nil {
			return st, err
		}
	}
	st.stream, err = dev.NewStream()
	return st, err
}

func (st *staging) record(i int) error {
	if err := st.ev[i].Record(st.stream); err != nil {
		return fmt.Errorf("gpushm: record event: %w", err)
	}
	st.pending[i] = true
	return nil
}

func (st *staging) wait(i int) error {
	if !st.pending[i] {
		return nil
	}
	st.pending[i] = false
	if err := st.ev[i].Synchronize(); err != nil {
		return fmt.Errorf("gpushm: copy: %w", err)
	}
	return nil
}

func (st *staging) close() {
	if st.stream != nil {
		st.stream.Synchronize()
		st.stream.Close()
	}
	for i := range st.buf {
		if st.ev[i] != nil {
			st.ev[i].Close()
		}
		if st.buf[i] != nil {
			st.dev.FreeHost(st.buf[i])
		}
	}
}
