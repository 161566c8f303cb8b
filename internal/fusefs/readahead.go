package fusefs

import (
	"errors"
	"io"
	"sync"

	"github.com/hanwen/go-fuse/v2/fuse"

	"github.com/gpushm/gpushm/internal/segment"
)

// Read-ahead, for memory the daemon cannot lend (GPU memory): while a
// handle is read sequentially (cp, cat, a loader streaming a file), a
// goroutine of the handle copies the next requests' bytes out of the
// segment (on cuda a DMA through the staging buffers, then a copy) while
// the reader is busy with the last ones, so that its next request is
// answered from memory. Files are opened for direct I/O, for which the
// kernel does not read ahead itself.
//
// Bytes read ahead are served only if nothing can have changed them since
// they were read: the segment's stamp (Registry.Stamp) is still the one
// taken before reading them, so no write or resize through the daemon
// came between (this view, a mapping of it written back, a fill), and no
// socket client took a lease meanwhile; and the segment is quiet, no
// client holding it open (a lease holder writes through its own mapping,
// which the daemon does not see). While a client holds it open nothing is
// read ahead, and every read copies when it is asked for.

const (
	// raAfter is how many requests in a row, each starting where the last
	// ended, make a reader sequential.
	raAfter = 2
	// raWindow is how many requests' worth are read ahead of the reader.
	raWindow = 4
	// raBudget bounds the memory read-ahead holds in the whole view, and
	// raKeep what it keeps for reuse once given back.
	raBudget = 64 << 20
	raKeep   = 16 << 20
)

// chunk is one request's worth read ahead.
type chunk struct {
	off   int64
	size  int    // the request's
	buf   []byte // the bytes read (capacity size)
	stamp uint64 // the segment's stamp before the bytes were read
	err   error
	done  chan struct{} // closed once read

	// Guarded by readAhead.mu.
	started  bool // taken to be read
	finished bool // read: done is closed
	dropped  bool // discarded while being read: its reader gives it back
}

// readAhead is a handle's read-ahead. Its goroutine is the view's (FS.bg),
// which Unmount waits for; each runs only while chunks wait to be read.
type readAhead struct {
	fs  *FS
	seg *segment.Segment

	mu      sync.Mutex
	next    int64    // where the reader's next request should start
	run     int      // requests in a row that started where the last ended
	chunks  []*chunk // from next on, in order, contiguous
	reading bool     // a goroutine is reading chunks
	closed  bool     // the handle was released
}

// serve answers a request of n bytes at off from what was read ahead; ok
// false: the caller reads it now, then tells after.
func (ra *readAhead) serve(off int64, n int) (rr fuse.ReadResult, ok bool) {
	ra.mu.Lock()
	if len(ra.chunks) == 0 || off != ra.next || ra.chunks[0].off != off || ra.chunks[0].size != n {
		ra.dropLocked()
		ra.mu.Unlock()
		return nil, false
	}
	c := ra.chunks[0]
	ra.chunks = ra.chunks[1:]
	read := !c.started // asked for before the goroutine came to it
	c.started = true
	ra.mu.Unlock()

	if read {
		ra.fetch(c)
	}
	<-c.done
	stamp, quiet := ra.fs.reg.Stamp(ra.seg)
	if c.err != nil || !quiet || stamp != c.stamp || len(c.buf) == 0 {
		// Changed since, or may have: so may the rest. (An empty reply
		// is not worth lending: go-fuse would not give it back.)
		ra.fs.putChunk(c)
		ra.mu.Lock()
		ra.dropLocked()
		ra.mu.Unlock()
		return nil, false
	}
	ra.after(off, len(c.buf), n)
	ra.fs.raServed.Add(1)
	return &lentChunk{fs: ra.fs, c: c}, true
}

// after notes that a request of n bytes at off got got bytes, and reads
// ahead of a reader found sequential, unless a client holds the segment
// open (what it read ahead could not be served).
func (ra *readAhead) after(off int64, got, n int) {
	_, quiet := ra.fs.reg.Stamp(ra.seg)
	ra.mu.Lock()
	defer ra.mu.Unlock()
	if off == ra.next {
		ra.run++
	} else {
		ra.run = 1
		ra.dropLocked()
	}
	ra.next = off + int64(got)
	if got < n || ra.run < raAfter || ra.closed || !quiet {
		return // at the end, not sequential (yet), or not to be read ahead
	}
	end := ra.next
	if k := len(ra.chunks); k > 0 {
		end = ra.chunks[k-1].off + int64(ra.chunks[k-1].size)
	}
	for len(ra.chunks) < raWindow {
		c := ra.fs.getChunk(n)
		if c == nil {
			break // the view's read-ahead memory is in use
		}
		c.off = end
		ra.chunks = append(ra.chunks, c)
		end += int64(n)
	}
	if !ra.reading && len(ra.chunks) > 0 && ra.fs.spawn(ra.read) {
		ra.reading = true
	}
}

// read reads the chunks waiting, in order, until none is left.
func (ra *readAhead) read() {
	for {
		ra.mu.Lock()
		var c *chunk
		for _, ch := range ra.chunks {
			if !ch.started {
				c = ch
				break
			}
		}
		if c == nil {
			ra.reading = false
			ra.mu.Unlock()
			return
		}
		c.started = true
		ra.mu.Unlock()
		ra.fetch(c)
	}
}

// fetch reads chunk c, and closes its done.
func (ra *readAhead) fetch(c *chunk) {
	// The stamp before the bytes: a change after it moves it.
	stamp, quiet := ra.fs.reg.Stamp(ra.seg)
	if quiet {
		n, err := ra.fs.reg.ReadAt(ra.seg, c.buf[:c.size], c.off)
		c.buf = c.buf[:n]
		if err != nil && !errors.Is(err, io.EOF) {
			c.err = err
		}
	} else {
		c.err = errNotQuiet
	}
	c.stamp = stamp

	ra.mu.Lock()
	defer ra.mu.Unlock()
	c.finished = true
	close(c.done)
	if c.dropped {
		ra.fs.putChunk(c)
	}
}

var errNotQuiet = errors.New("a socket client holds the segment open")

// dropLocked discards what was read ahead; a chunk still being read is
// given back by its reader.
func (ra *readAhead) dropLocked() {
	for _, c := range ra.chunks {
		switch {
		case !c.started:
			c.started = true // never to be read
			ra.fs.putChunk(c)
		case c.finished:
			ra.fs.putChunk(c)
		default:
			c.dropped = true
		}
	}
	ra.chunks = nil
}

// close ends the read-ahead of a released handle.
func (ra *readAhead) close() {
	ra.mu.Lock()
	defer ra.mu.Unlock()
	ra.closed = true
	ra.dropLocked()
}

// lentChunk is a reply made of a chunk's bytes, which go back to the view
// once the reply is written.
type lentChunk struct {
	fs *FS
	c  *chunk
}

func (l *lentChunk) Size() int                          { return len(l.c.buf) }
func (l *lentChunk) Bytes([]byte) ([]byte, fuse.Status) { return l.c.buf, fuse.OK }

// Slices makes go-fuse write the reply from the chunk itself (writev).
func (l *lentChunk) Slices() ([][]byte, fuse.Status) { return [][]byte{l.c.buf}, fuse.OK }
func (l *lentChunk) Done()                           { l.fs.putChunk(l.c) }

// getChunk takes a chunk of n bytes from the view's budget; nil when it is
// spent. Buffers are kept for the next chunks: fresh memory costs a page
// fault a page.
func (f *FS) getChunk(n int) *chunk {
	f.raMu.Lock()
	defer f.raMu.Unlock()
	if f.raBytes+n > raBudget {
		return nil
	}
	f.raBytes += n
	var buf []byte
	for i, b := range f.raFree {
		if cap(b) == n {
			buf = b
			f.raFree = append(f.raFree[:i], f.raFree[i+1:]...)
			break
		}
	}
	if buf == nil {
		buf = make([]byte, n)
		f.raKept += n
	}
	return &chunk{size: n, buf: buf[:0], done: make(chan struct{})}
}

// putChunk gives a chunk's buffer back, kept for reuse up to raKeep.
func (f *FS) putChunk(c *chunk) {
	f.raMu.Lock()
	defer f.raMu.Unlock()
	f.raBytes -= c.size
	f.raFree = append(f.raFree, c.buf[:0])
	for f.raKept > raKeep && len(f.raFree) > 0 {
		f.raKept -= cap(f.raFree[0])
		f.raFree = f.raFree[1:]
	}
}

// spawn runs fn on a goroutine Unmount waits for; false once unmounting.
func (f *FS) spawn(fn func()) bool {
	f.bgMu.Lock()
	defer f.bgMu.Unlock()
	if f.bgDone {
		return false
	}
	f.bg.Add(1)
	go func() {
		defer f.bg.Done()
		fn()
	}()
	return true
}

// waitBackground stops new goroutines and waits for those running.
func (f *FS) waitBackground() {
	f.bgMu.Lock()
	f.bgDone = true
	f.bgMu.Unlock()
	f.bg.Wait()
}
