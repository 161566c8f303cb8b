package disk

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Write stores size bytes from src, with meta, as the key's new copy. It
// writes the data files aside (a new generation's names), syncs them,
// then writes the copy's manifest into each directory that holds a
// stripe, the commit's directory last: that rename, synced, is the
// commit. Until then the key's previous copy, if any, is the key's and can
// be read; after it, the previous copy's files are removed. A Write that
// fails, or whose ctx is done, removes what it wrote and leaves the
// previous copy.
//
// The copy's bytes, with its previous copy's, must fit the budget: a
// Write that would take the store over it fails before writing, with
// ErrBudget. Writes of one key are run one after the other; of different
// keys, at once.
func (s *Store) Write(ctx context.Context, key string, size int64, meta []byte, src Source) (Entry, error) {
	if err := checkWrite(key, size, meta); err != nil {
		return Entry{}, err
	}
	if err := s.begin(); err != nil {
		return Entry{}, fmt.Errorf("disk: write %q: %w", key, err)
	}
	defer s.ops.Done()
	done, err := s.lockKey(ctx, key)
	if err != nil {
		return Entry{}, fmt.Errorf("disk: write %q: %w", key, err)
	}
	defer done()
	m := s.plan(key, size, meta)
	if err := s.reserve(m.footprint(), key); err != nil {
		return Entry{}, err
	}
	w := &writer{s: s, m: m}
	if err := w.write(ctx, src); err != nil {
		return Entry{}, w.abort(err)
	}
	if err := w.commit(); err != nil {
		return Entry{}, w.abort(err)
	}
	return s.install(m), nil
}

func checkWrite(key string, size int64, meta []byte) error {
	switch {
	case key == "" || len(key) > MaxKey:
		return fmt.Errorf("disk: write: a key is 1 to %d bytes, not %d", MaxKey, len(key))
	case size < 0:
		return fmt.Errorf("disk: write %q: negative size %d", key, size)
	case len(meta) > MaxMeta:
		return fmt.Errorf("disk: write %q: meta of %d bytes, more than %d", key, len(meta), MaxMeta)
	}
	return nil
}

// plan makes the new copy's manifest, its sums to be filled: a new
// generation, and its stripes over as many directories as it has chunks,
// the first picked by the key so that small copies spread.
func (s *Store) plan(key string, size int64, meta []byte) *manifest {
	s.mu.Lock()
	// Generations follow the clock so that a copy written while another
	// of the key sat in a directory not given to Open is still newer than
	// it when both are found again.
	gen := max(s.lastGen+1, uint64(time.Now().UnixNano()))
	s.lastGen = gen
	s.mu.Unlock()
	m := &manifest{
		key: key, meta: slices.Clone(meta), gen: gen, size: size, chunk: s.chunk, align: s.align,
		written: time.Now(), sums: make([]uint32, nchunks(size, s.chunk)),
	}
	n := max(1, min(int64(len(s.dirs)), int64(len(m.sums))))
	h := keyHash(key)
	start := int(binary.BigEndian.Uint32([]byte(h[:8])) % uint32(len(s.dirs)))
	for j := range n {
		m.stripes = append(m.stripes, s.dirs[(start+int(j))%len(s.dirs)].id)
	}
	return m
}

// reserve counts n bytes against the budget, or fails with ErrBudget.
func (s *Store) reserve(n int64, key string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.budget > 0 && s.used+n > s.budget {
		return fmt.Errorf("disk: write %q: its %d bytes on disk would take the store to %d bytes, over its budget of %d (%d in use, writes in flight and copies being replaced included): %w",
			key, n, s.used+n, s.budget, s.used, ErrBudget)
	}
	s.used += n
	return nil
}

func (s *Store) unreserve(n int64) {
	s.mu.Lock()
	s.used -= n
	s.mu.Unlock()
}

// install makes m the key's copy, and removes the one it replaces.
func (s *Store) install(m *manifest) Entry {
	s.mu.Lock()
	old := s.copies[m.key]
	s.copies[m.key] = m
	e := s.entry(m)
	s.mu.Unlock()
	if old != nil {
		err := s.removeCopy(old)
		s.unreserve(old.footprint())
		if err != nil {
			// Committed all the same: Open removes what is left.
			s.log.Warn("disk: the replaced copy's files stay until the next Open", "err", err)
		}
	}
	return e
}

// A writer is one Write's state: the files it made, to remove on failure.
type writer struct {
	s       *Store
	m       *manifest
	made    []made
	stripes []*stripe
}

type made struct {
	d    *dir
	name string
}

// write writes the data files.
func (w *writer) write(ctx context.Context, src Source) error {
	defer w.closeFiles()
	s, m := w.s, w.m
	for j, id := range m.stripes {
		d := s.byID[id]
		name := dataName(m.key, m.gen, j)
		fd, err := d.create(name)
		if err != nil {
			return err
		}
		w.made = append(w.made, made{d, name})
		st := &stripe{d: d, fd: fd, name: filepath.Join(d.path, name)}
		w.stripes = append(w.stripes, st)
		for i := int64(j); i < int64(len(m.sums)); i += int64(len(m.stripes)) {
			st.chunks = append(st.chunks, i)
		}
		if err := reserve(fd, m.stripeLen(j)); err != nil {
			return fmt.Errorf("%s: make room for %d bytes: %w", st.name, m.stripeLen(j), err)
		}
	}
	n := int64(len(m.stripes))
	fill := func(b []byte, i int64) error {
		size, pad := m.chunkLen(i)
		p := b[:size]
		if err := src.ReadAt(p, i*m.chunk); err != nil {
			return fmt.Errorf("the source's %d bytes at %d: %w", size, i*m.chunk, err)
		}
		m.sums[i] = checksum(p)
		clear(b[size:pad])
		return nil
	}
	put := func(st *stripe) func([]byte, int64) error {
		return func(b []byte, i int64) error {
			_, pad := m.chunkLen(i)
			if err := pwriteFull(st.fd, b[:pad], i/n*m.chunk); err != nil {
				return fmt.Errorf("%s: write %d bytes at %d: %w", st.name, pad, i/n*m.chunk, err)
			}
			return nil
		}
	}
	if err := s.runStripes(ctx, w.stripes, func(st *stripe) stages { return stages{fill, put(st)} }); err != nil {
		return err
	}
	// Each drive flushes on its own: synced one after the other, a
	// copy over n drives would wait for n flushes.
	return parallel(len(w.stripes), func(j int) error {
		if err := unix.Fsync(w.stripes[j].fd); err != nil {
			return fmt.Errorf("%s: sync: %w", w.stripes[j].name, err)
		}
		return nil
	})
}

// parallel runs f(0) to f(n-1) at once, and returns their errors.
func parallel(n int, f func(int) error) error {
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { errs[i] = f(i) })
	}
	wg.Wait()
	return errors.Join(errs...)
}

func (w *writer) closeFiles() {
	for _, st := range w.stripes {
		if st.fd >= 0 {
			unix.Close(st.fd)
			st.fd = -1
		}
	}
}

// commit writes the manifest into each stripe's directory, the commit's
// (the first stripe's) last, once the others are durable. Each rename is
// synced with its directory, which also makes the data file's name there
// durable.
func (w *writer) commit() error {
	m := w.m
	b := m.encode()
	name := manifestName(m.key, m.gen)
	dirs := make([]*dir, len(m.stripes))
	for j := len(dirs) - 1; j >= 0; j-- {
		// abort removes in reverse: the commit's manifest first.
		dirs[j] = w.s.byID[m.stripes[j]]
		w.made = append(w.made, made{dirs[j], name})
	}
	err := parallel(len(dirs)-1, func(j int) error {
		return dirs[j+1].writeFile(name+tmpExt, name, b)
	})
	if err != nil {
		return err
	}
	return dirs[0].writeFile(name+tmpExt, name, b)
}

// abort removes the files the write made, and gives back its bytes.
func (w *writer) abort(err error) error {
	w.closeFiles()
	// The commit's manifest first: made in reverse order.
	for k := len(w.made) - 1; k >= 0; k-- {
		f := w.made[k]
		if e := f.d.unlink(f.name); e != nil && !errors.Is(e, syscall.ENOENT) {
			w.s.log.Warn("disk: a failed write's file stays until the next Open", "err", e)
		}
	}
	for _, f := range w.made {
		f.d.sync()
	}
	w.s.unreserve(w.m.footprint())
	if errors.Is(err, syscall.ENOSPC) {
		return fmt.Errorf("disk: write %q (%d bytes): the disk is full; nothing of it is left, and the key's previous copy is kept: %w", w.m.key, w.m.size, err)
	}
	return fmt.Errorf("disk: write %q (%d bytes): %w", w.m.key, w.m.size, err)
}
