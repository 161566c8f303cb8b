package disk

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// maxManifest bounds the manifest files read.
const maxManifest = 1 << 28

// Read gives dst the bytes of the key's copy, and returns its entry. It
// first checks the copy's manifest on disk against the one it committed,
// then every chunk against its checksum before dst takes it: a file that
// is corrupt, truncated, or not a regular file of ours fails the Read with
// an error naming the key and the file, wrapping ErrCorrupt, and what it
// holds is never given to dst. On an error dst may have taken some
// chunks, each verified, and not others: the caller discards them.
func (s *Store) Read(ctx context.Context, key string, dst Sink) (Entry, error) {
	if err := s.begin(); err != nil {
		return Entry{}, fmt.Errorf("disk: read %q: %w", key, err)
	}
	defer s.ops.Done()
	// The files are opened before a commit or Remove may remove them:
	// those take s.mu before they do.
	s.mu.RLock()
	m := s.copies[key]
	if m == nil {
		s.mu.RUnlock()
		return Entry{}, fmt.Errorf("disk: read %q: %w", key, ErrNotExist)
	}
	e := s.entry(m)
	sts, err := s.openCopy(m)
	s.mu.RUnlock()
	defer func() {
		for _, st := range sts {
			unix.Close(st.fd)
		}
	}()
	if err != nil {
		return e, fmt.Errorf("disk: read %q: %w", key, err)
	}
	n := int64(len(m.stripes))
	get := func(st *stripe) func([]byte, int64) error {
		return func(b []byte, i int64) error {
			_, pad := m.chunkLen(i)
			got, err := preadFull(st.fd, b[:pad], i/n*m.chunk)
			if err != nil {
				return fmt.Errorf("%s: read %d bytes at %d: %w", st.name, pad, i/n*m.chunk, err)
			}
			if int64(got) < pad {
				return fmt.Errorf("%s: read %d bytes at %d: the file ends after %d: %w", st.name, pad, i/n*m.chunk, got, ErrCorrupt)
			}
			return nil
		}
	}
	give := func(st *stripe) func([]byte, int64) error {
		return func(b []byte, i int64) error {
			size, _ := m.chunkLen(i)
			p := b[:size]
			if sum := checksum(p); sum != m.sums[i] {
				return fmt.Errorf("%s: chunk %d (bytes %d to %d of the copy) fails its checksum (crc32c %08x, recorded %08x): %w",
					st.name, i, i*m.chunk, i*m.chunk+size, sum, m.sums[i], ErrCorrupt)
			}
			return dst.WriteAt(p, i*m.chunk)
		}
	}
	err = s.runStripes(ctx, sts, func(st *stripe) stages { return stages{get(st), give(st)} })
	if err != nil {
		return e, fmt.Errorf("disk: read %q: %w", key, err)
	}
	return e, nil
}

// openCopy checks m's manifest on disk, and opens its data files, each of
// the length the manifest says.
func (s *Store) openCopy(m *manifest) (sts []*stripe, err error) {
	d := s.byID[m.stripes[0]]
	name := manifestName(m.key, m.gen)
	b, err := d.readFile(name, maxManifest)
	if err != nil {
		return nil, err
	}
	if _, derr := decodeManifest(b); derr != nil {
		return nil, fmt.Errorf("%s: %w: %w", filepath.Join(d.path, name), derr, ErrCorrupt)
	}
	if !bytes.Equal(b, m.encode()) {
		return nil, fmt.Errorf("%s: not the manifest the copy was committed with: %w", filepath.Join(d.path, name), ErrCorrupt)
	}
	for j, id := range m.stripes {
		d := s.byID[id]
		name := dataName(m.key, m.gen, j)
		// A copy padded for a smaller alignment than the drive's own is
		// read through the page cache.
		fd, size, err := d.open(name, d.direct && m.align%d.align == 0)
		if errors.Is(err, fs.ErrNotExist) {
			return sts, fmt.Errorf("%w: %w", err, ErrCorrupt)
		}
		if err != nil {
			return sts, err
		}
		st := &stripe{d: d, fd: fd, name: filepath.Join(d.path, name)}
		sts = append(sts, st)
		if want := m.stripeLen(j); size != want {
			return sts, fmt.Errorf("%s: %d bytes, its manifest says %d (truncated, or not this copy's): %w", st.name, size, want, ErrCorrupt)
		}
		for i := int64(j); i < int64(len(m.sums)); i += int64(len(m.stripes)) {
			st.chunks = append(st.chunks, i)
		}
	}
	return sts, nil
}
