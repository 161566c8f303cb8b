package disk

import (
	"context"
	"fmt"
)

// SetMeta replaces the Meta of key's copy, its bytes left as they are: its
// manifests are written again, each aside and renamed over the old one, so
// that a crash leaves each the old or the new (a copy whose manifests then
// differ in Meta alone is served with the one of its commit's directory).
func (s *Store) SetMeta(key string, meta []byte) error {
	if len(meta) > MaxMeta {
		return fmt.Errorf("disk: meta of %q: %d bytes, at most %d", key, len(meta), MaxMeta)
	}
	if err := s.begin(); err != nil {
		return err
	}
	defer s.ops.Done()
	done, err := s.lockKey(context.Background(), key)
	if err != nil {
		return err
	}
	defer done()
	s.mu.Lock()
	old := s.copies[key]
	s.mu.Unlock()
	if old == nil {
		return fmt.Errorf("disk: set the meta of %q: %w", key, ErrNotExist)
	}
	m := *old
	m.meta = append([]byte(nil), meta...)
	grow := m.manifestLen() - old.manifestLen()
	if grow > 0 {
		if err := s.reserve(grow*int64(len(m.stripes)), key); err != nil {
			return err
		}
	}
	b := m.encode()
	name := manifestName(m.key, m.gen)
	// The commit's directory last: its manifest is the one a reopened
	// store trusts.
	for j := len(m.stripes) - 1; j >= 0; j-- {
		d := s.byID[m.stripes[j]]
		if d == nil {
			continue
		}
		if err := d.writeFile(name+tmpExt, name, b); err != nil {
			if grow > 0 {
				s.unreserve(grow * int64(len(m.stripes)))
			}
			return fmt.Errorf("disk: set the meta of %q: %w", key, err)
		}
	}
	s.mu.Lock()
	if s.copies[key] == old {
		s.copies[key] = &m
	}
	if grow < 0 {
		s.used += grow * int64(len(m.stripes))
	}
	s.mu.Unlock()
	return nil
}
