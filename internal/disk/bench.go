package disk

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// Rates are what Bench measured, each the time to move Bytes.
type Rates struct {
	Bytes  int64
	Dirs   int
	Block  int64 // the raw I/O's block, the store's chunk
	Direct bool  // whether both used O_DIRECT
	// RawWrite and RawRead are the directories' own rate: each written
	// and read in Block-sized O_DIRECT I/O, one at a time per directory
	// and all directories at once, without checksums or copies (dd
	// oflag=direct bs=Block conv=fsync, one per directory), the writes
	// synced.
	RawWrite, RawRead time.Duration
	// Write and Read are Store.Write and Store.Read of a copy of Bytes,
	// from and to host memory.
	Write, Read time.Duration
}

// GBps is n bytes in d, in GB/s.
func GBps(n int64, d time.Duration) float64 { return float64(n) / d.Seconds() / 1e9 }

// Bench measures dirs: their raw O_DIRECT rate, then a Store's over them
// (opened with o), writing and reading size bytes of host memory. The
// directories must not be another open store's; Bench leaves in them only
// what a Store leaves (its id file), and removes its copy.
func Bench(ctx context.Context, dirs []string, size int64, o Options) (Rates, error) {
	s, err := Open(dirs, o)
	if err != nil {
		return Rates{}, err
	}
	defer s.Close()
	r := Rates{Bytes: size, Dirs: len(dirs), Block: s.chunk, Direct: s.Direct()}
	src := make(mem, size)
	for i := range min(size, 1<<20) {
		src[i] = byte(i*7 + i>>12)
	}
	for i := int64(1 << 20); i < size; i += 1 << 20 {
		copy(src[i:], src[:1<<20])
		src[i] ^= byte(i >> 20) // no two MiB alike
	}
	// Staging buffers are made once a store: not timed.
	if err := s.warm(); err != nil {
		return r, err
	}
	raw, err := s.newRaw(size)
	if err != nil {
		return r, err
	}
	defer raw.close()
	dst := make(mem, size)
	for i := 0; i < len(dst); i += os.Getpagesize() {
		dst[i] = 1 // its pages made before the clock starts, as src's
	}
	// Each of the store's runs right after the raw run it is compared
	// with, so that a drive whose speed drifts (a shared or virtual one)
	// drifts less between them.
	if r.RawWrite, err = raw.write(); err != nil {
		return r, err
	}
	start := time.Now()
	if _, err := s.Write(ctx, "bench", size, nil, src); err != nil {
		return r, err
	}
	r.Write = time.Since(start)
	if r.RawRead, err = raw.read(); err != nil {
		return r, err
	}
	start = time.Now()
	if _, err := s.Read(ctx, "bench", dst); err != nil {
		return r, err
	}
	r.Read = time.Since(start)
	if !bytes.Equal(dst, src) {
		return r, errors.New("disk: bench: the bytes read back are not those written")
	}
	return r, s.Remove("bench")
}

// mem is host memory that is a Source and a Sink.
type mem []byte

func (m mem) ReadAt(p []byte, off int64) error {
	if off < 0 || off+int64(len(p)) > int64(len(m)) {
		return fmt.Errorf("%d bytes at %d of %d", len(p), off, len(m))
	}
	copy(p, m[off:])
	return nil
}

func (m mem) WriteAt(p []byte, off int64) error {
	if off < 0 || off+int64(len(p)) > int64(len(m)) {
		return fmt.Errorf("%d bytes at %d of %d", len(p), off, len(m))
	}
	copy(m[off:], p)
	return nil
}

// rawFiles are Bench's plain files, one a directory, each of per bytes,
// written and read in blocks of block bytes, one goroutine and one
// buffer a directory.
type rawFiles struct {
	dirs  []*dir
	fds   []int
	bufs  [][]byte
	name  string
	per   int64
	block int64
}

func (s *Store) newRaw(size int64) (*rawFiles, error) {
	r := &rawFiles{
		dirs: s.dirs, name: probePrefix + "bench-" + strconv.Itoa(os.Getpid()) + tmpExt,
		per: (size/int64(len(s.dirs)) + s.align - 1) / s.align * s.align, block: s.chunk,
	}
	for _, d := range s.dirs {
		fd, err := d.create(r.name)
		if err != nil {
			r.close()
			return nil, err
		}
		r.fds = append(r.fds, fd)
		b, err := allocAligned(int(s.chunk))
		if err != nil {
			r.close()
			return nil, err
		}
		for k := range b {
			b[k] = byte(k)
		}
		r.bufs = append(r.bufs, b)
	}
	return r, nil
}

func (r *rawFiles) close() {
	for i, fd := range r.fds {
		unix.Close(fd)
		r.dirs[i].unlink(r.name)
	}
	for _, b := range r.bufs {
		freeAligned(b)
	}
}

// each runs op in every directory at once, and times them.
func (r *rawFiles) each(op func(d *dir, fd int, b []byte) error) (time.Duration, error) {
	errs := make([]error, len(r.dirs))
	var wg sync.WaitGroup
	start := time.Now()
	for i, d := range r.dirs {
		wg.Go(func() { errs[i] = op(d, r.fds[i], r.bufs[i]) })
	}
	wg.Wait()
	return time.Since(start), errors.Join(errs...)
}

func (r *rawFiles) write() (time.Duration, error) {
	return r.each(func(d *dir, fd int, b []byte) error {
		for off := int64(0); off < r.per; off += r.block {
			if err := pwriteFull(fd, b[:min(r.block, r.per-off)], off); err != nil {
				return fmt.Errorf("disk: bench: write %s: %w", d.path, err)
			}
		}
		return unix.Fsync(fd)
	})
}

func (r *rawFiles) read() (time.Duration, error) {
	for i, d := range r.dirs {
		unix.Close(r.fds[i])
		fd, _, err := d.open(r.name, d.direct)
		if err != nil {
			r.fds[i] = -1
			return 0, err
		}
		r.fds[i] = fd
	}
	return r.each(func(d *dir, fd int, b []byte) error {
		for off := int64(0); off < r.per; off += r.block {
			if _, err := preadFull(fd, b[:min(r.block, r.per-off)], off); err != nil {
				return fmt.Errorf("disk: bench: read %s: %w", d.path, err)
			}
		}
		return nil
	})
}
