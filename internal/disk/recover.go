package disk

import (
	"errors"
	"io/fs"
	"path/filepath"
	"slices"
)

// found is what Open found of one copy (one key's generation) in the
// directories it was given.
type found struct {
	m         *manifest // decoded from any of its manifests
	manifests []made    // its manifests that decode
	corrupt   []made    // its manifests that do not
	data      []made    // its data files
}

// recover reads the directories and puts them in order: temporary files
// removed; of each key, its newest committed copy kept and served, older
// ones and uncommitted ones removed. A copy is committed when its manifest
// is in its first stripe's directory (the commit's); a copy whose
// directories were not all given to Open is kept, not served.
func (s *Store) recover() error {
	copies, err := s.scan()
	if err != nil {
		return err
	}
	newest := map[string]*found{} // by key, among the committed
	var drop []*found
	for prefix, f := range copies {
		switch {
		case f.m == nil:
			if len(f.corrupt) > 0 {
				s.log.Warn("disk: removed a copy whose manifest does not decode", "files", f.files())
			}
			drop = append(drop, f) // an interrupted write's data, or a corrupt manifest's copy
		case prefix != copyName(f.m.key, f.m.gen):
			s.log.Warn("disk: removed a copy whose manifest is of another name", "files", f.files())
			drop = append(drop, f)
		case !s.present(f.m):
			s.keep(f)
		case !f.committed(s):
			drop = append(drop, f)
		default:
			if old := newest[f.m.key]; old == nil || old.m.gen < f.m.gen {
				if old != nil {
					drop = append(drop, old)
				}
				newest[f.m.key] = f
			} else {
				drop = append(drop, f)
			}
		}
	}
	for key, f := range newest {
		if g, ok := s.keptGen(key); ok && g > f.m.gen {
			// A newer copy sits in a directory not given: serving this
			// one would serve stale bytes.
			s.log.Warn("disk: a newer copy of the key needs a directory not given; the older is kept, not served", "key", key, "files", f.files())
			s.keep(f)
			continue
		}
		s.copies[key] = f.m
		s.used += f.m.footprint()
	}
	for _, f := range drop {
		f.remove(s)
	}
	for _, d := range s.dirs {
		if err := d.sync(); err != nil {
			return err
		}
	}
	return nil
}

// scan reads every directory: removes temporary files, decodes manifests,
// and gathers each copy's files by their common prefix.
func (s *Store) scan() (map[string]*found, error) {
	copies := map[string]*found{}
	for _, d := range s.dirs {
		names, err := d.names()
		if err != nil {
			return nil, err
		}
		for _, name := range names {
			if err := s.scanFile(d, name, copies); err != nil {
				return nil, err
			}
		}
	}
	return copies, nil
}

func (s *Store) scanFile(d *dir, name string, copies map[string]*found) error {
	p := parseName(name)
	if p.kind == foreign {
		return nil
	}
	if !d.regular(name) {
		// Never followed, never removed: someone put it there.
		s.log.Warn("disk: not a regular file of the daemon's: left alone", "file", filepath.Join(d.path, name))
		return nil
	}
	if p.kind == kindTemp {
		s.log.Info("disk: removed an interrupted write's file", "file", filepath.Join(d.path, name))
		return d.unlink(name)
	}
	s.lastGen = max(s.lastGen, p.gen)
	f := copies[p.prefix]
	if f == nil {
		f = &found{}
		copies[p.prefix] = f
	}
	if p.kind == kindData {
		f.data = append(f.data, made{d, name})
		return nil
	}
	b, err := d.readFile(name, maxManifest)
	if err != nil && !errors.Is(err, ErrCorrupt) {
		return err
	}
	m, err := decodeManifest(b)
	if err != nil {
		f.corrupt = append(f.corrupt, made{d, name})
		return nil
	}
	if f.m == nil || d.id == m.stripes[0] {
		f.m = m
	}
	f.manifests = append(f.manifests, made{d, name})
	return nil
}

// present says whether every directory of m's was given to Open.
func (s *Store) present(m *manifest) bool {
	for _, id := range m.stripes {
		if s.byID[id] == nil {
			return false
		}
	}
	return true
}

// committed says whether the commit's directory holds the manifest. One
// there that does not decode counts: the copy is listed, and its Read
// fails naming the file.
func (f *found) committed(s *Store) bool {
	for _, x := range append(f.manifests, f.corrupt...) {
		if x.d.id == f.m.stripes[0] {
			return true
		}
	}
	return false
}

// keep counts a copy that is kept but not served.
func (s *Store) keep(f *found) {
	s.log.Warn("disk: a copy is kept but not served: a directory of it was not given", "key", f.m.key, "files", f.files())
	s.used += f.m.footprint()
	if g, ok := s.keptGens[f.m.key]; !ok || g < f.m.gen {
		s.keptGens[f.m.key] = f.m.gen
	}
}

func (s *Store) keptGen(key string) (uint64, bool) {
	g, ok := s.keptGens[key]
	return g, ok
}

// all are the copy's files, its manifests first.
func (f *found) all() []made {
	return slices.Concat(f.manifests, f.corrupt, f.data)
}

func (f *found) files() []string {
	var names []string
	for _, x := range f.all() {
		names = append(names, filepath.Join(x.d.path, x.name))
	}
	return names
}

// remove removes the copy's files, its manifests first.
func (f *found) remove(s *Store) {
	for _, x := range f.all() {
		if err := x.d.unlink(x.name); err != nil && !errors.Is(err, fs.ErrNotExist) {
			s.log.Warn("disk: cannot remove a stale file", "err", err)
		}
	}
}
