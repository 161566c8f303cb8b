package gpushm

import (
	"fmt"

	"github.com/gpushm/gpushm/internal/layout"
)

// BundleFile is a small file kept in a bundle beside its tensors.
type BundleFile struct {
	Name   string
	Offset int64 // in the segment
	Size   int64
}

// BundleFiles lists the small files a bundle segment keeps (none for a
// bundle of one safetensors file, or of put_tensors).
func (s *Segment) BundleFiles() ([]BundleFile, error) {
	meta, ok, err := layout.ParseMeta(s.Info().Meta, s.Size())
	if err != nil {
		return nil, err
	}
	if !ok {
		return nil, fmt.Errorf("gpushm: segment %q is not a tensor bundle", s.Info().Name)
	}
	var out []BundleFile
	for _, f := range meta.Files {
		out = append(out, BundleFile{Name: f.Name, Offset: f.At, Size: f.Size})
	}
	return out, nil
}

// Files reads the small files a bundle segment keeps (config.json, the
// tokenizer's, ...), by name.
func (s *Segment) Files() (map[string][]byte, error) {
	list, err := s.BundleFiles()
	if err != nil {
		return nil, err
	}
	m, err := s.Map()
	if err != nil {
		return nil, err
	}
	out := make(map[string][]byte, len(list))
	for _, f := range list {
		b := make([]byte, f.Size)
		if _, err := m.ReadAt(b, f.Offset); err != nil {
			return nil, fmt.Errorf("gpushm: read %s from %q: %w", f.Name, s.Info().Name, err)
		}
		out[f.Name] = b
	}
	return out, nil
}
