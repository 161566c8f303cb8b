package disk

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"path/filepath"
	"slices"
	"sync"
	"time"
)

// Errors callers test with errors.Is.
var (
	// ErrNotExist: the store holds no copy of the key. It wraps
	// fs.ErrNotExist.
	ErrNotExist = fmt.Errorf("no copy on disk: %w", fs.ErrNotExist)
	// ErrBudget: a write would take the store over Options.Budget.
	ErrBudget = errors.New("over the disk budget")
	// ErrCorrupt: a copy's file is not what its manifest says (a chunk
	// fails its checksum, a file is shorter or longer, a manifest does
	// not decode). The copy is never served; removing it is the caller's
	// choice.
	ErrCorrupt = errors.New("corrupt copy")
	// ErrClosed: the store is closed.
	ErrClosed = errors.New("disk store closed")
)

// chunkUnit is what Options.Chunk must be a multiple of.
const chunkUnit = 1 << 20

// DefaultChunk is the checksum and stripe unit when Options.Chunk is 0.
const DefaultChunk = 64 << 20

// Options configure a Store. The zero value is the default.
type Options struct {
	// Budget is the bytes the store may take on disk, its files' lengths
	// (data, padding and manifests); 0 is no limit.
	Budget int64
	// Chunk is the checksum and stripe unit, a multiple of 1 MiB; 0 is
	// DefaultChunk. A copy keeps the chunk it was written with.
	Chunk int64
	// Streams is the reads or writes in flight at once in each directory,
	// each with two staging buffers of Chunk bytes; 0 is 1.
	Streams int
	// Pin, if set, is called once on each staging buffer when it is made
	// (a cuda caller registers it with the driver); unpin is called by
	// Close.
	Pin func([]byte) (unpin func(), err error)
	// Log, if set, is told of what Open recovered and of what it found
	// amiss; nil is slog.Default().
	Log *slog.Logger

	// buffered, for tests, writes through the page cache even where the
	// file system takes O_DIRECT.
	buffered bool
}

// A Source gives the bytes a Write stores. ReadAt fills p with the bytes at
// off; p is a staging buffer (aligned, pinned where Options.Pin pins), of
// Options.Chunk bytes but for the last chunk. It is called from several
// goroutines at once, for distinct ranges.
type Source interface {
	ReadAt(p []byte, off int64) error
}

// A Sink takes the bytes a Read brings back: WriteAt takes p's bytes, to be
// put at off; p is a staging buffer, reused once WriteAt returns. Every p
// has passed its checksum. It is called from several goroutines at once,
// for distinct ranges.
type Sink interface {
	WriteAt(p []byte, off int64) error
}

// An Entry describes a committed copy.
type Entry struct {
	Key     string
	Size    int64
	Meta    []byte
	Gen     uint64    // the copy's generation: a later Write of the key has a higher one
	Written time.Time // when the write began
	// Files are the copy's files: its data files in stripe order, then
	// its manifests (the first is the commit's).
	Files []string
	// Disk is the bytes its files take.
	Disk int64
}

// A Store is a set of copies, each striped over its directories.
type Store struct {
	dirs    []*dir
	byID    map[dirID]*dir
	chunk   int64
	align   int64 // the largest of the directories'
	streams int
	budget  int64
	pin     func([]byte) (func(), error)
	log     *slog.Logger

	mu      sync.RWMutex
	copies  map[string]*manifest     // the committed copies that can be read
	writing map[string]chan struct{} // keys being written, closed when done
	used    int64                    // bytes of every copy kept, and reserved by writes
	lastGen uint64                   // the highest generation handed out or found
	ops     sync.WaitGroup           // Writes and Reads in flight
	closed  bool
	// keptGens are, by key, the newest generation of the copies kept but
	// not served, since a directory of theirs was not given to Open.
	keptGens map[string]uint64
}

// Open opens a store over dirs, one directory per drive, and recovers what
// an earlier store left: files of writes that never committed are removed,
// and of each key only its newest committed copy is kept.
//
// A directory that does not exist is made, mode 0700, if its parent does;
// one that exists must be a directory, not a symbolic link, of this
// process's effective uid, and writable by nobody else: one that others
// may write is refused (they could have planted files), one others may
// read is narrowed to 0700. Open then checks that each directory takes
// writes, and with O_DIRECT (Direct says whether all do), and locks it
// against another Store in any process.
func Open(dirs []string, o Options) (*Store, error) {
	if len(dirs) == 0 {
		return nil, errors.New("disk: no directories")
	}
	if len(dirs) > maxStripes {
		return nil, fmt.Errorf("disk: %d directories, at most %d", len(dirs), maxStripes)
	}
	s := &Store{
		chunk: o.Chunk, streams: max(o.Streams, 1), budget: o.Budget, pin: o.Pin, log: o.Log,
		byID: map[dirID]*dir{}, copies: map[string]*manifest{}, writing: map[string]chan struct{}{},
		keptGens: map[string]uint64{}, align: 4096,
	}
	if s.chunk == 0 {
		s.chunk = DefaultChunk
	}
	if s.chunk < 0 || s.chunk%chunkUnit != 0 {
		return nil, fmt.Errorf("disk: chunk %d is not a positive multiple of 1 MiB", s.chunk)
	}
	if s.budget < 0 {
		return nil, fmt.Errorf("disk: negative budget %d", s.budget)
	}
	if s.log == nil {
		s.log = slog.Default()
	}
	for _, p := range dirs {
		d, err := openDir(p, s.log)
		if err == nil {
			if other := s.same(d); other != nil {
				err = fmt.Errorf("disk: %s and %s are the same directory", other.path, d.path)
			} else {
				err = d.ready(o.buffered)
			}
			if err != nil {
				d.close()
			}
		}
		if err != nil {
			s.closeDirs()
			return nil, err
		}
		if other := s.byID[d.id]; other != nil {
			d.close()
			s.closeDirs()
			return nil, fmt.Errorf("disk: %s and %s have the same id (%s): one was copied from the other; remove %s from the copy", other.path, d.path, d.id, idFile)
		}
		s.dirs = append(s.dirs, d)
		s.byID[d.id] = d
		s.align = max(s.align, d.align)
	}
	if s.align > chunkUnit {
		s.closeDirs()
		return nil, fmt.Errorf("disk: O_DIRECT alignment %d is over 1 MiB", s.align)
	}
	for _, d := range s.dirs {
		d.lanes = make(chan *lane, s.streams)
		for range s.streams {
			d.lanes <- &lane{}
		}
		if !d.direct {
			s.log.Warn("disk: the file system refuses O_DIRECT: copies go through the page cache, with fsync", "dir", d.path)
		}
	}
	if err := s.recover(); err != nil {
		s.closeDirs()
		return nil, err
	}
	return s, nil
}

// same returns the directory of s that d is, if any.
func (s *Store) same(d *dir) *dir {
	for _, o := range s.dirs {
		if o.dev == d.dev && o.ino == d.ino {
			return o
		}
	}
	return nil
}

// Direct says whether every directory is written and read with O_DIRECT;
// where the file system refuses it (tmpfs before Linux 6.6, some FUSE and
// overlay mounts), a directory goes through the page cache and fsync.
func (s *Store) Direct() bool {
	for _, d := range s.dirs {
		if !d.direct {
			return false
		}
	}
	return true
}

// Stat returns the key's committed copy, or an error wrapping ErrNotExist.
func (s *Store) Stat(key string) (Entry, error) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	m := s.copies[key]
	if m == nil {
		return Entry{}, fmt.Errorf("disk: %q: %w", key, ErrNotExist)
	}
	return s.entry(m), nil
}

// List returns every committed copy that can be read, by key.
func (s *Store) List() []Entry {
	s.mu.RLock()
	defer s.mu.RUnlock()
	es := make([]Entry, 0, len(s.copies))
	for _, m := range s.copies {
		es = append(es, s.entry(m))
	}
	slices.SortFunc(es, func(a, b Entry) int { return cmpString(a.Key, b.Key) })
	return es
}

func cmpString(a, b string) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// Usage returns the bytes the store's files take, with those reserved by
// writes in flight, and the budget (0: none).
func (s *Store) Usage() (used, budget int64) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.used, s.budget
}

// entry describes m; s.mu is held.
func (s *Store) entry(m *manifest) Entry {
	e := Entry{Key: m.key, Size: m.size, Meta: slices.Clone(m.meta), Gen: m.gen, Written: m.written, Disk: m.footprint()}
	for j, id := range m.stripes {
		e.Files = append(e.Files, filepath.Join(s.byID[id].path, dataName(m.key, m.gen, j)))
	}
	for _, id := range m.stripes {
		e.Files = append(e.Files, filepath.Join(s.byID[id].path, manifestName(m.key, m.gen)))
	}
	return e
}

// begin counts an operation in flight, so that Close waits for it.
func (s *Store) begin() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return ErrClosed
	}
	s.ops.Add(1)
	return nil
}

// Close waits for the Writes and Reads in flight, then closes the
// directories and frees the staging buffers.
func (s *Store) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	s.mu.Unlock()
	s.ops.Wait()
	return s.closeDirs()
}

func (s *Store) closeDirs() error {
	var errs []error
	for _, d := range s.dirs {
		errs = append(errs, d.close())
	}
	s.dirs = nil
	return errors.Join(errs...)
}

// Remove removes the key's copy: its manifest in the commit's directory
// first, which is the removal's point (after a crash, Open removes the
// rest), then its other files. A Write of the key in flight goes on: once
// committed, its copy is the key's.
func (s *Store) Remove(key string) error {
	if err := s.begin(); err != nil {
		return err
	}
	defer s.ops.Done()
	// Whoever takes a copy out of s.copies removes its files and its
	// bytes from s.used: Remove here, a Write's commit for the copy it
	// replaces.
	s.mu.Lock()
	m := s.copies[key]
	delete(s.copies, key)
	s.mu.Unlock()
	if m == nil {
		return fmt.Errorf("disk: remove %q: %w", key, ErrNotExist)
	}
	err := s.removeCopy(m)
	s.mu.Lock()
	s.used -= m.footprint()
	s.mu.Unlock()
	return err
}

// lockKey waits until no other Write of key is in flight, and marks one;
// done unmarks it.
func (s *Store) lockKey(ctx context.Context, key string) (done func(), err error) {
	for {
		s.mu.Lock()
		c, busy := s.writing[key]
		if !busy {
			c = make(chan struct{})
			s.writing[key] = c
			s.mu.Unlock()
			return func() {
				s.mu.Lock()
				delete(s.writing, key)
				s.mu.Unlock()
				close(c)
			}, nil
		}
		s.mu.Unlock()
		select {
		case <-c:
		case <-ctx.Done():
			return nil, context.Cause(ctx)
		}
	}
}

// removeCopy removes m's files, the commit's manifest first.
func (s *Store) removeCopy(m *manifest) error {
	var errs []error
	rm := func(id dirID, name string) {
		d := s.byID[id]
		if d == nil {
			return
		}
		if err := d.unlink(name); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	rm(m.stripes[0], manifestName(m.key, m.gen))
	if d := s.byID[m.stripes[0]]; d != nil {
		errs = append(errs, d.sync())
	}
	for j, id := range m.stripes {
		if j > 0 {
			rm(id, manifestName(m.key, m.gen))
		}
		rm(id, dataName(m.key, m.gen, j))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("disk: remove the copy of %q (generation %d): %w", m.key, m.gen, err)
	}
	return nil
}
