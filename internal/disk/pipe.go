package disk

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"

	"github.com/gpushm/gpushm/internal/crc32c"
)

// A lane is one stream of a directory: two staging buffers, made and
// pinned on first use and kept until Close, so that one is being filled
// or drained by the caller's copy while the other is on its way to or from
// the drive.
type lane struct {
	buf   [2][]byte
	unpin []func()
}

// ready makes the lane's buffers, of chunk bytes each, if not yet made.
func (l *lane) ready(chunk int64, pin func([]byte) (func(), error)) error {
	if l.buf[0] != nil {
		return nil
	}
	for i := range l.buf {
		b, err := allocAligned(int(chunk))
		if err != nil {
			l.free()
			return err
		}
		l.buf[i] = b
		if pin != nil {
			unpin, err := pin(b)
			if err != nil {
				l.free()
				return fmt.Errorf("disk: pin a staging buffer: %w", err)
			}
			l.unpin = append(l.unpin, unpin)
		}
	}
	return nil
}

func (l *lane) free() {
	for _, u := range l.unpin {
		u()
	}
	l.unpin = nil
	for i, b := range l.buf {
		if b != nil {
			freeAligned(b)
		}
		l.buf[i] = nil
	}
}

// warm makes every lane's buffers now, rather than on first use.
func (s *Store) warm() error {
	for _, d := range s.dirs {
		var taken []*lane
		var err error
		for range s.streams {
			l := <-d.lanes
			taken = append(taken, l)
			if err == nil {
				err = l.ready(s.chunk, s.pin)
			}
		}
		for _, l := range taken {
			d.lanes <- l
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// sumPiece is the least a goroutine of checksum hashes.
const sumPiece = 8 << 20

// checksum is the CRC-32C of b, hashed by several goroutines at once when
// b is long and there are CPUs for them, and combined: one core hashes
// about 10 GB/s from memory, no more than a fast drive moves, and the
// hash must keep up with it beside the caller's copy.
func checksum(b []byte) uint32 {
	n := min(runtime.GOMAXPROCS(0), len(b)/sumPiece, 8)
	if n <= 1 {
		return crc32c.Checksum(b)
	}
	piece := (len(b) + n - 1) / n
	sums := make([]uint32, n)
	var wg sync.WaitGroup
	for k := 1; k < n; k++ {
		wg.Go(func() { sums[k] = crc32c.Checksum(b[k*piece : min((k+1)*piece, len(b))]) })
	}
	sums[0] = crc32c.Checksum(b[:piece])
	wg.Wait()
	crc := sums[0]
	for k := 1; k < n; k++ {
		crc = crc32c.Combine(crc, sums[k], int64(min((k+1)*piece, len(b))-k*piece))
	}
	return crc
}

// A stripe is the part of one Write or Read in one directory: the chunks
// j, j+n, j+2n, ... of a copy of n stripes, in one file.
type stripe struct {
	d      *dir
	fd     int
	name   string // the file's path, for errors
	chunks []int64
	next   atomic.Int64 // the index in chunks of the next to start
}

// take hands out the stripe's chunks, each once, to its lanes.
func (st *stripe) take() (int64, bool) {
	k := st.next.Add(1) - 1
	if k >= int64(len(st.chunks)) {
		return 0, false
	}
	return st.chunks[k], true
}

// stages are the two halves of a stream's work on a chunk, each run in a
// goroutine of its own so that they overlap: first fills a buffer
// (Write: from the Source, checksummed; Read: from the drive), second
// drains it (Write: to the drive; Read: checked, to the Sink).
type stages struct {
	first, second func(b []byte, chunk int64) error
}

// runStripes runs each stripe in its own goroutine, through one lane of
// its directory and as many more as are free then, and returns when all
// are done, or the first error has stopped the others.
func (s *Store) runStripes(ctx context.Context, sts []*stripe, work func(*stripe) stages) error {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	errs := make([]error, len(sts))
	var wg sync.WaitGroup
	for i, st := range sts {
		wg.Go(func() {
			if err := s.runStripe(ctx, st, work(st)); err != nil {
				errs[i] = err
				cancel(err)
			}
		})
	}
	wg.Wait()
	return firstError(errs)
}

// firstError is the error that stopped the others: one that is not only
// their being stopped.
func firstError(errs []error) error {
	var stopped error
	for _, err := range errs {
		if err == nil {
			continue
		}
		if !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded) {
			return err
		}
		stopped = err
	}
	return stopped
}

func (s *Store) runStripe(ctx context.Context, st *stripe, work stages) error {
	var lanes []*lane
	select {
	case l := <-st.d.lanes:
		lanes = append(lanes, l)
	case <-ctx.Done():
		return context.Cause(ctx)
	}
more:
	for len(lanes) < min(s.streams, len(st.chunks)) {
		select {
		case l := <-st.d.lanes:
			lanes = append(lanes, l)
		default:
			break more
		}
	}
	defer func() {
		for _, l := range lanes {
			st.d.lanes <- l
		}
	}()
	for _, l := range lanes {
		if err := l.ready(s.chunk, s.pin); err != nil {
			return err
		}
	}
	errs := make([]error, len(lanes))
	var wg sync.WaitGroup
	for i, l := range lanes {
		wg.Go(func() { errs[i] = pipe(ctx, l.buf[:], st.take, work) })
	}
	wg.Wait()
	return firstError(errs)
}

// pipe runs work on the chunks next hands out, first in this goroutine and
// second in another, through bufs: while second drains one buffer, first
// fills the next.
func pipe(ctx context.Context, bufs [][]byte, next func() (int64, bool), work stages) error {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	type item struct {
		b     []byte
		chunk int64
	}
	free := make(chan []byte, len(bufs))
	for _, b := range bufs {
		free <- b
	}
	full := make(chan item, len(bufs)) // never blocks: there are no more buffers
	var errSecond error
	drained := make(chan struct{})
	go func() {
		defer close(drained)
		for it := range full {
			if ctx.Err() != nil {
				continue
			}
			if err := work.second(it.b, it.chunk); err != nil {
				errSecond = err
				cancel(err)
				continue
			}
			free <- it.b
		}
	}()
	var errFirst error
	for errFirst == nil {
		chunk, ok := next()
		if !ok {
			break
		}
		select {
		case b := <-free:
			if err := ctx.Err(); err != nil {
				errFirst = context.Cause(ctx)
			} else if errFirst = work.first(b, chunk); errFirst == nil {
				full <- item{b, chunk}
			}
		case <-ctx.Done():
			errFirst = context.Cause(ctx)
		}
	}
	close(full)
	<-drained
	if errSecond != nil {
		return errSecond
	}
	return errFirst
}
