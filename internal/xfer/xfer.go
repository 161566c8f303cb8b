// Package xfer moves bytes between files and memory that is either a GPU
// allocation mapped in this process or host memory: the copy engine of
// put, get, checkpoint directories and streams, in clients and in the
// daemon alike. Several copiers work at once, each reading its own chunks
// of the files, on cuda through two pinned buffers of its own and a stream,
// so that reading the next chunk overlaps the DMA of the last.
package xfer

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/gpushm/gpushm/internal/crc32c"
	"github.com/gpushm/gpushm/internal/cuda"
)

// A Target is where the bytes go to or come from: Size bytes at Ptr on
// Dev (cuda, mapped in this process), or Host.
type Target struct {
	Dev  *cuda.Device
	Ptr  uint64
	Host []byte
	Size int64
	// Buffers, when set, lends the copiers their pinned buffers and
	// streams instead of each copy making its own: a long-lived process
	// (the daemon) pins once.
	Buffers *Pool
}

// A Range is Len bytes at Off in File, and At, where they lie in the
// target.
type Range struct {
	File     *os.File
	Off, Len int64
	At       int64
}

// Direct says when Load reads with O_DIRECT.
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

// Options tune Load and Store. The zero value is the default.
type Options struct {
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
	// Borrowed says that the files are descriptors another process lent
	// (the daemon's fill and dump): the copy reads and writes only through
	// them and never opens a file again. A reopen through /proc/self/fd,
	// as Direct needs, checks permissions as this process, not as the one
	// that opened the file, and makes a new open file description with
	// this process's credentials: for a daemon running as root, access the
	// lender may not have. Setting O_DIRECT on the lender's description
	// instead (F_SETFL) would change it under the lender and every other
	// process sharing it. So a borrowed file is read through the page
	// cache, unless its description was opened with O_DIRECT by its owner:
	// then every chunk is read with O_DIRECT through it, and Direct is
	// ignored.
	Borrowed bool
	// CRC32C has Load hash what it reads: each copier computes the
	// CRC-32C of every chunk as it lands in its buffer, and Stats.CRC32C
	// has each range's, combined from its chunks'.
	CRC32C bool
}

// Stats say how a copy went.
type Stats struct {
	Bytes   int64 // bytes copied
	Direct  int64 // of which read with O_DIRECT
	Workers int
	Chunk   int64
	// Elapsed is the copy's own time, from the first read to the last byte
	// in place (pinned buffers and streams included).
	Elapsed time.Duration
	// Wall, for a copy the daemon made (Fill, Dump), is the request's
	// time as the client saw it.
	Wall time.Duration
	// CRC32C, when Options.CRC32C asked for it, is the CRC-32C of each
	// range's bytes, in the order of the ranges. A daemon's copy (Fill)
	// has one, or none when the daemon is too old to hash.
	CRC32C []uint32
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

// Load copies every range's bytes from its file into t, with several
// copiers in parallel. On cuda each copier reads into one of its two
// pinned buffers while the other is on its way to the GPU on the copier's
// own stream. Ranges must not overlap in t. With DirectAuto, chunks the
// page cache does not hold are read with O_DIRECT (disk to pinned memory,
// no copy through the cache); a file system that refuses O_DIRECT is read
// through the page cache instead.
//
// ctx done stops the copy at its copiers' next chunk: Load returns once
// the reads and writes under way have ended (a read the kernel does not
// interrupt, such as one from a FUSE file whose server never answers,
// holds it until it returns), with an error wrapping ctx's cause, and
// leaves what was copied before.
func Load(ctx context.Context, t Target, ranges []Range, o *Options) (Stats, error) {
	return copyFiles(ctx, t, ranges, o, true)
}

// Store copies t's bytes at each range's At into its file, with several
// copiers in parallel (on cuda, each through its own pinned buffer and
// stream). ctx stops it as it stops Load.
func Store(ctx context.Context, t Target, ranges []Range, o *Options) (Stats, error) {
	return copyFiles(ctx, t, ranges, o, false)
}

// check returns o (the defaults for nil) and the bytes a copier moves per
// step: Chunk, or the default.
func (o *Options) check() (*Options, int64, error) {
	if o == nil {
		o = &Options{}
	}
	c := o.Chunk
	if c == 0 {
		c = defaultChunk
	}
	if c < 0 || c%chunkUnit != 0 {
		return o, 0, fmt.Errorf("xfer: copy chunk %d is not a positive multiple of %d", c, chunkUnit)
	}
	return o, c, nil
}

// step is one chunk of one range.
type step struct {
	src      *source
	mem      []byte  // instead of src: host memory (Move)
	off, len int64   // in the file
	at       int64   // in the segment
	sum      *uint32 // if set, where the chunk's CRC-32C goes (Load)
}

func copyFiles(ctx context.Context, t Target, ranges []Range, o *Options, load bool) (st Stats, err error) {
	o, chunk, err := o.check()
	if err != nil {
		return st, err
	}
	srcs := map[*os.File]*source{}
	defer func() {
		for _, s := range srcs {
			s.close()
		}
	}()
	var (
		steps []step
		first []int // each range's first step
	)
	for _, r := range ranges {
		first = append(first, len(steps))
		if r.File == nil || r.Off < 0 || r.Len < 0 || r.At < 0 || r.At > t.Size || r.Len > t.Size-r.At {
			return st, fmt.Errorf("xfer: range of %d bytes at %d to %d: outside the segment (%d bytes)", r.Len, r.Off, r.At, t.Size)
		}
		s := srcs[r.File]
		if s == nil {
			s = &source{f: r.File, direct: DirectNever, dfd: -1, borrowed: o.Borrowed}
			if load {
				s.direct = o.Direct
				if o.Borrowed {
					s.direct = DirectNever
					if ok, align := ownDirect(r.File); ok {
						s.direct, s.align = DirectAlways, align
					}
				}
			}
			srcs[r.File] = s
		}
		// Chunks end at multiples of chunk in the file, so that an aligned
		// read covering a chunk never exceeds the buffer.
		for off := r.Off; off < r.Off+r.Len; {
			end := min((off/chunk+1)*chunk, r.Off+r.Len)
			steps = append(steps, step{src: s, off: off, len: end - off, at: r.At + off - r.Off})
			st.Bytes += end - off
			off = end
		}
	}
	st.Chunk = chunk
	if !load {
		// Each file's pages made ahead of its writes: their ranges, in
		// order, one goroutine a file, stopped when the copy ends and
		// waited for (the descriptor may be closed once this returns).
		done := make(chan struct{})
		var wg sync.WaitGroup
		defer func() {
			close(done)
			wg.Wait()
		}()
		spans := map[*source][2]int64{}
		for _, s := range steps {
			sp, ok := spans[s.src]
			if !ok {
				sp = [2]int64{s.off, s.off + s.len}
			}
			spans[s.src] = [2]int64{min(sp[0], s.off), max(sp[1], s.off+s.len)}
		}
		for s, sp := range spans {
			wg.Go(func() { allocateAhead(s.f, sp[0], sp[1], done) })
		}
	}
	hash := load && o.CRC32C
	var sums []uint32
	if hash {
		// Copiers read chunks in any order; each hashes its own into its
		// place, and the chunks' sums are combined by offset once all
		// are in.
		sums = make([]uint32, len(steps))
		for k := range steps {
			steps[k].sum = &sums[k]
		}
	}
	st, err = run(ctx, t, steps, st, o, load)
	if err != nil || !hash {
		return st, err
	}
	st.CRC32C = make([]uint32, len(ranges))
	for i := range ranges {
		end := len(steps)
		if i+1 < len(first) {
			end = first[i+1]
		}
		var crc uint32
		for k := first[i]; k < end; k++ {
			crc = crc32c.Combine(crc, sums[k], steps[k].len)
		}
		st.CRC32C[i] = crc
	}
	return st, nil
}

// run has workers copy steps, of st.Chunk bytes at most, between t and
// their files or memory, until they are done, one fails, or ctx is done.
func run(ctx context.Context, t Target, steps []step, st Stats, o *Options, load bool) (Stats, error) {
	start := time.Now()
	chunk := st.Chunk
	workers := o.Workers
	if workers <= 0 {
		workers = min(maxCopyWorkers, runtime.NumCPU())
	}
	workers = min(workers, max(len(steps), 1))
	st.Workers, st.Chunk = workers, chunk
	if len(steps) == 0 {
		st.Elapsed = time.Since(start)
		return st, nil
	}
	var (
		next    atomic.Int64
		failed  atomic.Bool
		stopped atomic.Bool
		direct  atomic.Int64
		copied  atomic.Int64
		copiers atomic.Int32
		wg      sync.WaitGroup
		once    sync.Once
	)
	// over is closed once no chunk is left for a copier that has not
	// started: copiers that wait for a pinned buffer then give up.
	over := make(chan struct{})
	end := func() { once.Do(func() { close(over) }) }
	l := &loan{}
	errs := make([]error, workers)
	for i := range workers {
		wg.Go(func() {
			c := &copier{t: t, chunk: chunk, loan: l}
			defer func() {
				errs[i] = errors.Join(errs[i], c.close())
				direct.Add(c.direct)
			}()
			// The first copier never waits for a buffer (Pool.get):
			// the copy goes on whatever other copies hold.
			joined, err := c.open(i == 0, over, ctx.Done())
			if err != nil {
				errs[i] = err
				failed.Store(true)
				end()
				return
			}
			if !joined {
				return
			}
			copiers.Add(1)
			for !failed.Load() {
				if ctx.Err() != nil {
					stopped.Store(true)
					failed.Store(true)
					break
				}
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
					end()
					return
				}
				copied.Add(s.len)
				if o.Progress != nil {
					o.Progress(s.len)
				}
			}
			end()
			errs[i] = c.finish()
		})
	}
	wg.Wait()
	st.Direct = direct.Load()
	st.Elapsed = time.Since(start)
	// Those that copied: a copier that found no pinned buffer did not.
	st.Workers = max(int(copiers.Load()), 1)
	err := errors.Join(errs...)
	if stopped.Load() {
		err = errors.Join(fmt.Errorf("xfer: stopped after %d of %d bytes: %w", copied.Load(), st.Bytes, context.Cause(ctx)), err)
	}
	return st, err
}

// copier is one worker: on cuda two pinned buffers, a stream, and an event
// per buffer saying when its last copy is done. Each copier pins its own
// buffers, so that the first start copying while the others still pin.
type copier struct {
	t       Target
	chunk   int64
	pinned  []byte
	buf     [2][]byte
	ev      [2]*cuda.Event
	pending [2]bool
	stream  *cuda.Stream
	turn    int
	bounce  []byte // host segments: the O_DIRECT landing buffer
	kit     *kit   // borrowed from Target.Buffers
	loan    *loan  // the kits its copy borrowed
	direct  int64
}

// open readies the copier's buffers and stream, and says whether it
// copies: a copier other than the copy's first that finds no pinned
// buffer of Target.Buffers to borrow waits for one until over or stop is
// closed, and then does not copy (Pool.get).
func (c *copier) open(first bool, over, stop <-chan struct{}) (bool, error) {
	if c.t.Dev == nil {
		return true, nil
	}
	if p := c.t.Buffers; p != nil && p.chunk == c.chunk {
		var err error
		if c.kit, err = p.get(c.loan, first, over, stop); err != nil || c.kit == nil {
			return false, err
		}
		c.pinned, c.stream, c.ev = c.kit.pinned, c.kit.stream, c.kit.ev
		c.buf = [2][]byte{c.pinned[:c.chunk], c.pinned[c.chunk:]}
		return true, nil
	}
	return true, c.pin()
}

// pin makes the copier's own buffers, stream and events.
func (c *copier) pin() error {
	var err error
	if c.pinned, err = c.t.Dev.AllocHost(2 * c.chunk); err != nil {
		return fmt.Errorf("xfer: staging buffers: %w", err)
	}
	c.buf = [2][]byte{c.pinned[:c.chunk], c.pinned[c.chunk:]}
	if c.stream, err = c.t.Dev.NewStream(); err != nil {
		return fmt.Errorf("xfer: stream: %w", err)
	}
	for i := range c.ev {
		if c.ev[i], err = c.t.Dev.NewSyncEvent(); err != nil {
			return fmt.Errorf("xfer: event: %w", err)
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
		return fmt.Errorf("xfer: copy to device: %w", err)
	}
	return nil
}

// finish waits for the copies still in flight.
func (c *copier) finish() error {
	if c.stream == nil {
		return nil
	}
	if err := c.stream.Synchronize(); err != nil {
		return fmt.Errorf("xfer: copy to device: %w", err)
	}
	c.pending = [2]bool{}
	return nil
}

func (c *copier) close() error {
	if c.kit != nil {
		err := c.stream.Synchronize()
		if err != nil {
			// A stream in error is not lent again.
			c.t.Buffers.discard(c.loan, c.kit)
		} else {
			c.t.Buffers.put(c.loan, c.kit)
		}
		c.kit, c.stream, c.pinned, c.ev = nil, nil, nil, [2]*cuda.Event{}
		if c.bounce != nil {
			freeAligned(c.bounce)
		}
		return err
	}
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
		errs = append(errs, c.t.Dev.FreeHost(c.pinned))
	}
	if c.bounce != nil {
		freeAligned(c.bounce)
	}
	return errors.Join(errs...)
}

func (c *copier) load(s step) error {
	m := c.t
	if m.Dev == nil && s.mem != nil {
		copy(m.Host[s.at:s.at+s.len], s.mem)
		return nil
	}
	if m.Dev == nil {
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
				s.place(m.Host[s.at:s.at+s.len], b)
				c.direct += s.len
				return nil
			}
		}
		return s.read(m.Host[s.at : s.at+s.len])
	}
	i := c.turn
	c.turn ^= 1
	if err := c.wait(i); err != nil {
		return err
	}
	var b []byte
	if s.mem != nil {
		b = c.buf[i][:s.len]
		copy(b, s.mem)
	} else if s.src.wantDirect(s.off, s.len) {
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
		if err := s.read(b); err != nil {
			return err
		}
	} else {
		// Hashed in the staging buffer, before the DMA is queued: the
		// buffer is not written again until the copy is done (wait,
		// above).
		s.hash(b)
	}
	if err := c.stream.CopyHtoDAsync(m.Ptr+uint64(s.at), b); err != nil {
		return fmt.Errorf("xfer: copy to device: %w", err)
	}
	if err := c.ev[i].Record(c.stream); err != nil {
		return fmt.Errorf("xfer: record event: %w", err)
	}
	c.pending[i] = true
	return nil
}

// hashPiece is how much of a chunk a hashing copier reads or copies at a
// time: each piece is hashed right away, while it is still in the CPU's
// cache. Hashing a whole chunk (8 MiB) after reading it would fetch it
// from memory once more.
const hashPiece = 256 << 10

// hash records the CRC-32C of the chunk's bytes b, if asked to.
func (s step) hash(b []byte) {
	if s.sum != nil {
		*s.sum = crc32c.Checksum(b)
	}
}

// read fills b with the chunk's bytes from its file, hashing them as they
// come if asked to.
func (s step) read(b []byte) error {
	if s.sum == nil {
		return readFull(s.src.f, b, s.off)
	}
	var crc uint32
	for p := 0; p < len(b); p += hashPiece {
		q := b[p:min(p+hashPiece, len(b))]
		if err := readFull(s.src.f, q, s.off+int64(p)); err != nil {
			return err
		}
		crc = crc32c.Update(crc, q)
	}
	*s.sum = crc
	return nil
}

// place copies the chunk's bytes src (read with O_DIRECT) to dst, hashing
// them as they go if asked to.
func (s step) place(dst, src []byte) {
	if s.sum == nil {
		copy(dst, src)
		return
	}
	var crc uint32
	for p := 0; p < len(src); p += hashPiece {
		q := src[p:min(p+hashPiece, len(src))]
		copy(dst[p:], q)
		crc = crc32c.Update(crc, q)
	}
	*s.sum = crc
}

func (c *copier) store(s step) error {
	m := c.t
	var b []byte
	if m.Dev == nil {
		b = m.Host[s.at : s.at+s.len]
	} else {
		b = c.buf[0][:s.len]
		if err := c.stream.CopyDtoHAsync(b, m.Ptr+uint64(s.at)); err != nil {
			return fmt.Errorf("xfer: copy from device: %w", err)
		}
		if err := c.stream.Synchronize(); err != nil {
			return fmt.Errorf("xfer: copy from device: %w", err)
		}
	}
	if s.mem != nil {
		copy(s.mem, b)
		return nil
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

	// borrowed: f is another process's (Options.Borrowed), never opened
	// again; dfd is then f's own descriptor, when its description reads
	// with O_DIRECT, and is not closed.
	borrowed bool

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
	if s.borrowed {
		if s.direct == DirectAlways {
			s.dfd = fdOf(s.f)
		}
		return
	}
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
		return nil, false, fmt.Errorf("xfer: read %d bytes at %d of %s: %w", hi-lo, lo, s.f.Name(), err)
	}
	if got < off+n-lo {
		return nil, false, fmt.Errorf("xfer: read %d bytes at %d of %s: got %d: the file is shorter than when it was checked", n, off, s.f.Name(), max(got-(off-lo), 0))
	}
	return buf[off-lo : off-lo+n], true, nil
}

func (s *source) close() {
	if s.dfd >= 0 && !s.borrowed {
		syscall.Close(s.dfd)
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

// fdOf returns f's descriptor without the side effect of f.Fd, which puts
// a non-blocking descriptor in blocking mode: on the open file
// description, which a borrowed file shares with its owner.
func fdOf(f *os.File) int {
	fd := -1
	if rc, err := f.SyscallConn(); err == nil {
		rc.Control(func(u uintptr) { fd = int(u) })
	}
	return fd
}

func readFull(r io.ReaderAt, b []byte, off int64) error {
	n, err := r.ReadAt(b, off)
	if n == len(b) {
		return nil
	}
	if err == nil || err == io.EOF {
		err = io.ErrUnexpectedEOF
	}
	return fmt.Errorf("xfer: read %d bytes at %d: got %d: %w", len(b), off, n, err)
}
