package gpushm

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gpushm/gpushm/internal/cuda"
)

// A FileRange is Len bytes at Off in File, and At, where they lie in a
// segment.
type FileRange struct {
	File     *os.File
	Off, Len int64
	At       int64
}

// Direct says when LoadFiles reads with O_DIRECT.
type Direct int

const (
	// DirectAuto reads with O_DIRECT the chunks that are not in the page
	// cache, where the file system allows it, and through the page cache
	// what is already there.
	DirectAuto Direct = iota
	// DirectNever always reads through the page cache.
	DirectNever
	// DirectAlways reads with O_DIRECT wherever the file system allows it.
	DirectAlways
)

// CopyOptions tune LoadFiles and StoreFiles. The zero value is the default.
type CopyOptions struct {
	// Workers is the number of copiers, each with its own file reads,
	// pinned buffers and CUDA stream; 0 means min(16, the CPUs).
	Workers int
	// Chunk is the bytes a copier moves per step, a multiple of 64 KiB;
	// 0 means 8 MiB.
	Chunk int64
	// Direct says when to bypass the page cache.
	Direct Direct
	// Progress, if set, is told of every n bytes copied, from any
	// copier's goroutine.
	Progress func(n int64)
}

// CopyStats say how a copy went.
type CopyStats struct {
	Bytes   int64 // bytes copied
	Direct  int64 // of which read with O_DIRECT
	Workers int
	Chunk   int64
	// Elapsed is the copy's own time, from the first read to the last byte
	// in place (pinned buffers and streams included).
	Elapsed time.Duration
}

const (
	defaultChunk   = 8 << 20
	maxCopyWorkers = 16
	chunkUnit      = 64 << 10
)

// dioAlign is the alignment of O_DIRECT offsets, lengths and buffers: 4096
// serves devices of 512-byte and 4 KiB blocks alike; a file system that
// reports a larger alignment gets its own.
const dioAlign = 4096

// LoadFiles copies every range's bytes from its file into the segment,
// with several copiers in parallel. On cuda each copier reads into one of
// its two pinned buffers while the other is on its way to the GPU on the
// copier's own stream. Ranges must not overlap in the segment. With
// DirectAuto, chunks the page cache does not hold are read with O_DIRECT
// (disk to pinned memory, no copy through the cache); a file system that
// refuses O_DIRECT is read through the page cache instead. Close nothing
// before it returns.
func (m *Mapping) LoadFiles(ranges []FileRange, o *CopyOptions) (CopyStats, error) {
	if m.readOnly {
		return CopyStats{}, errors.New("gpushm: write to a read-only mapping")
	}
	return m.copyFiles(ranges, o, true)
}

// StoreFiles copies the segment's bytes at each range's At into its file,
// with several copiers in parallel (on cuda, each through its own pinned
// buffer and stream).
func (m *Mapping) StoreFiles(ranges []FileRange, o *CopyOptions) (CopyStats, error) {
	return m.copyFiles(ranges, o, false)
}

// step is one chunk of one range.
type step struct {
	src      *source
	off, len int64 // in the file
	at       int64 // in the segment
}

func (m *Mapping) copyFiles(ranges []FileRange, o *CopyOptions, load bool) (st CopyStats, err error) {
	start := time.Now()
	defer func() { st.Elapsed = time.Since(start) }()
	if o == nil {
		o = &CopyOptions{}
	}
	chunk := o.Chunk
	if chunk == 0 {
		chunk = defaultChunk
	}
	if chunk < 0 || chunk%chunkUnit != 0 {
		return st, fmt.Errorf("gpushm: copy chunk %d is not a positive multiple of %d", chunk, chunkUnit)
	}
	srcs := map[*os.File]*source{}
	defer func() {
		for _, s := range srcs {
			s.close()
		}
	}()
	var steps []step
	for _, r := range ranges {
		if r.File == nil || r.Off < 0 || r.Len < 0 || r.At < 0 || r.At > m.size || r.Len > m.size-r.At {
			return st, fmt.Errorf("gpushm: range of %d bytes at %d to %d: %w", r.Len, r.Off, r.At, errOffset)
		}
		s := srcs[r.File]
		if s == nil {
			s = &source{f: r.File, direct: DirectNever, dfd: -1}
			if load {
				s.direct = o.Direct
			}
			srcs[r.File] = s
		}
		// Chunks end at multiples of chunk in the file, so that an aligned
		// read covering a chunk never exceeds the buffer.
		for off := r.Off; off < r.Off+r.Len; {
			end := min((off/chunk+1)*chunk, r.Off+r.Len)
			steps = append(steps, step{s, off, end - off, r.At + off - r.Off})
			st.Bytes += end - off
			off = end
		}
	}
	workers := o.Workers
	if workers <= 0 {
		workers = min(maxCopyWorkers, runtime.NumCPU())
	}
	workers = min(workers, max(len(steps), 1))
	st.Workers, st.Chunk = workers, chunk
	if len(steps) == 0 {
		return st, nil
	}
	var (
		next   atomic.Int64
		failed atomic.Bool
		direct atomic.Int64
		wg     sync.WaitGroup
	)
	errs := make([]error, workers)
	for i := range workers {
		wg.Go(func() {
			c := &copier{m: m, chunk: chunk}
			defer func() {
				errs[i] = errors.Join(errs[i], c.close())
				direct.Add(c.direct)
			}()
			if err := c.open(); err != nil {
				errs[i] = err
				failed.Store(true)
				return
			}
			for !failed.Load() {
				k := next.Add(1) - 1
				if k >= int64(len(steps)) {
					break
				}
				s := steps[k]
				var err error
				if load {
					err = c.load(s)
				} else {
					err = c.store(s)
				}
				if err != nil {
					errs[i] = err
					failed.Store(true)
					return
				}
				if o.Progress != nil {
					o.Progress(s.len)
				}
			}
			errs[i] = c.finish()
		})
	}
	wg.Wait()
	st.Direct = direct.Load()
	return st, errors.Join(errs...)
}

// copier is one worker: on cuda two pinned buffers, a stream, and an event
// per buffer saying when its last copy is done. Each copier pins its own
// buffers, so that the first start copying while the others still pin.
type copier struct {
	m       *Mapping
	chunk   int64
	pinned  []byte
	buf     [2][]byte
	ev      [2]*cuda.Event
	pending [2]bool
	stream  *cuda.Stream
	turn    int
	bounce  []byte // host segments: the O_DIRECT landing buffer
	direct  int64
}

func (c *copier) open() error {
	if c.m.dev == nil {
		return nil
	}
	var err error
	if c.pinned, err = c.m.dev.AllocHost(2 * c.chunk); err != nil {
		return fmt.Errorf("gpushm: staging buffers: %w", err)
	}
	c.buf = [2][]byte{c.pinned[:c.chunk], c.pinned[c.chunk:]}
	if c.stream, err = c.m.dev.NewStream(); err != nil {
		return fmt.Errorf("gpushm: stream: %w", err)
	}
	for i := range c.ev {
		if c.ev[i], err = c.m.dev.NewSyncEvent(); err != nil {
			return fmt.Errorf("gpushm: event: %w", err)
		}
	}
	return nil
}

// wait waits for buffer i's last copy.
func (c *copier) wait(i int) error {
	if !c.pending[i] {
		return nil
	}
	c.pending[i] = false
	if err := c.ev[i].Synchronize(); err != nil {
		return fmt.Errorf("gpushm: copy to device: %w", err)
	}
	return nil
}

// finish waits for the copies still in flight.
func (c *copier) finish() error {
	if c.stream == nil {
		return nil
	}
	if err := c.stream.Synchronize(); err != nil {
		return fmt.Errorf("gpushm: copy to device: %w", err)
	}
	c.pending = [2]bool{}
	return nil
}

func (c *copier) close() error {
	var errs []error
	if c.stream != nil {
		errs = append(errs, c.stream.Synchronize(), c.stream.Close())
	}
	for _, e := range c.ev {
		if e != nil {
			errs = append(errs, e.Close())
		}
	}
	if c.pinned != nil {
		// After the stream's copies are done: they read the buffers.
		errs = append(errs, c.m.dev.FreeHost(c.pinned))
	}
	if c.bounce != nil {
		freeAligned(c.bounce)
	}
	return errors.Join(errs...)
}

func (c *copier) load(s step) error {
	m := c.m
	if m.dev == nil {
		if s.src.wantDirect(s.off, s.len) {
			if c.bounce == nil {
				var err error
				if c.bounce, err = allocAligned(int(c.chunk)); err != nil {
					return err
				}
			}
			b, ok, err := s.src.readDirect(c.bounce, s.off, s.len)
			if err != nil {
				return err
			}
			if ok {
				copy(m.host[s.at:s.at+s.len], b)
				c.direct += s.len
				return nil
			}
		}
		return readFull(s.src.f, m.host[s.at:s.at+s.len], s.off)
	}
	i := c.turn
	c.turn ^= 1
	if err := c.wait(i); err != nil {
		return err
	}
	var b []byte
	if s.src.wantDirect(s.off, s.len) {
		d, ok, err := s.src.readDirect(c.buf[i], s.off, s.len)
		if err != nil {
			return err
		}
		if ok {
			b = d
			c.direct += s.len
		}
	}
	if b == nil {
		b = c.buf[i][:s.len]
		if err := readFull(s.src.f, b, s.off); err != nil {
			return err
		}
	}
	if err := c.stream.CopyHtoDAsync(m.ptr+uint64(s.at), b); err != nil {
		return fmt.Errorf("gpushm: copy to device: %w", err)
	}
	if err := c.ev[i].Record(c.stream); err != nil {
		return fmt.Errorf("gpushm: record event: %w", err)
	}
	c.pending[i] = true
	return nil
}

func (c *copier) store(s step) error {
	m := c.m
	var b []byte
	if m.dev == nil {
		b = m.host[s.at : s.at+s.len]
	} else {
		b = c.buf[0][:s.len]
		if err := c.stream.CopyDtoHAsync(b, m.ptr+uint64(s.at)); err != nil {
			return fmt.Errorf("gpushm: copy from device: %w", err)
		}
		if err := c.stream.Synchronize(); err != nil {
			return fmt.Errorf("gpushm: copy from device: %w", err)
		}
	}
	if _, err := s.src.f.WriteAt(b, s.off); err != nil {
		return err
	}
	return nil
}

// source is a file being read, with what is known about reading it with
// O_DIRECT. It is shared by the copiers.
type source struct {
	f      *os.File
	direct Direct // DirectNever for stores

	once     sync.Once
	dfd      int   // the file reopened with O_DIRECT; -1 until then, or if it cannot be
	align    int64 // its alignment
	size     int64
	cache    residency
	disabled atomic.Bool // a direct read failed as unsupported
}

func (s *source) setup() {
	s.dfd = -1
	st, err := s.f.Stat()
	if err != nil {
		return
	}
	s.size = st.Size()
	s.dfd, s.align = openDirect(s.f)
	if s.dfd >= 0 && s.direct == DirectAuto {
		s.cache = newResidency(s.f, s.size)
	}
}

// wantDirect decides for one chunk.
func (s *source) wantDirect(off, n int64) bool {
	if s.direct == DirectNever || s.disabled.Load() {
		return false
	}
	s.once.Do(s.setup)
	if s.dfd < 0 || s.align > dioAlign*16 {
		return false
	}
	if s.direct == DirectAlways {
		return true
	}
	return s.cache == nil || !s.cache.cached(off, n)
}

// readDirect reads [off, off+n) with O_DIRECT into buf (at least the aligned
// chunk's size, and aligned) and returns the bytes. ok is false, with no
// error, when the file system turned out to refuse O_DIRECT: then read it
// the other way.
func (s *source) readDirect(buf []byte, off, n int64) (b []byte, ok bool, err error) {
	a := s.align
	lo := off / a * a
	hi := min((off+n+a-1)/a*a, (s.size+a-1)/a*a)
	if hi-lo > int64(len(buf)) {
		return nil, false, nil
	}
	got, err := preadDirect(s.dfd, buf[:hi-lo], lo, a)
	if err != nil {
		if directUnsupported(err) {
			s.disabled.Store(true)
			return nil, false, nil
		}
		return nil, false, fmt.Errorf("gpushm: read %d bytes at %d of %s: %w", hi-lo, lo, s.f.Name(), err)
	}
	if got < off+n-lo {
		return nil, false, fmt.Errorf("gpushm: read %d bytes at %d of %s: got %d: the file is shorter than when it was checked", n, off, s.f.Name(), max(got-(off-lo), 0))
	}
	return buf[off-lo : off-lo+n], true, nil
}

func (s *source) close() {
	if s.dfd >= 0 {
		closeFD(s.dfd)
	}
	if s.cache != nil {
		s.cache.close()
	}
}

// residency tells whether file ranges are in the page cache.
type residency interface {
	cached(off, n int64) bool
	close()
}
