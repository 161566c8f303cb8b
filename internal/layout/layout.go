package layout

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"unicode/utf8"

	"github.com/gpushm/gpushm/internal/crc32c"
	"github.com/gpushm/gpushm/internal/safetensors"
	"github.com/gpushm/gpushm/internal/wire"
)

// Align is the alignment of every part of a bundle, and of each shard's data:
// tensors keep the alignment their shard gave them relative to its data, and
// 64 bytes satisfies every dtype and vectorized load.
const Align = 64

// MaxFileSize bounds each small file kept with the tensors. Tokenizers are
// the largest in practice (tokenizer.json of a large vocabulary: up to about
// 35 MB); a bigger file is most likely weights in another format.
const MaxFileSize = 64 << 20

// Range is Len bytes at Off in File, which go to At in the segment.
type Range struct {
	File     *os.File
	Off, Len int64
	At       int64
}

// Shard is one safetensors file of the checkpoint.
type Shard struct {
	Name      string
	Size      int64 // the file's size
	HeaderLen int64 // 8+N: where its data starts
	DataAt    int64 // where its data lies in the segment
	HeaderAt  int64 // where its original header bytes lie in the segment
	// Origin is the file's identity when Scan opened it, without its
	// checksum: the copy computes that.
	Origin Identity
	header []byte
	file   *os.File
}

// File is a small file kept with the tensors.
type File struct {
	Name string `json:"name"`
	At   int64  `json:"offset"`
	Size int64  `json:"size"`
	file *os.File
}

// Plan is a checked checkpoint directory and the bundle it becomes.
type Plan struct {
	Dir string
	// OriginDir is Dir, absolute, symbolic links resolved: the meta's
	// origin.
	OriginDir string
	Shards    []Shard
	Files     []File
	Skipped   []string // what the directory held that is not kept, and why
	Tensors   int
	// DataBytes is the tensor data: the shards' data regions.
	DataBytes int64
	// Size is the segment's size.
	Size int64

	prefix  []byte // the combined header, 8+N bytes
	table   []byte // the shard table
	tableAt int64
}

// The index's conventional name; any *.safetensors.index.json is followed.
const indexSuffix = ".safetensors.index.json"

// Scan reads dir: its safetensors shards (those the index names, when there
// is an index, else every *.safetensors file, in name order), and every
// other regular file at its top level of at most MaxFileSize bytes.
// Symbolic links are followed (a Hugging Face cache snapshot is made of
// them); subdirectories are not. Every shard's header is checked, tensors
// named twice across shards and index entries that point at nothing are
// errors, and each error names the file. Close the Plan when done.
//
// Its steps: list the directory, choose the shards, read their headers,
// hold them against the index, open the small files, lay out the bundle.
func Scan(dir string) (_ *Plan, err error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	p := &Plan{Dir: dir}
	if p.OriginDir, err = OriginDir(dir); err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			p.Close()
		}
	}()
	regular, indexes := p.list(ents)
	shardNames, wantTensors, err := chooseShards(dir, regular, indexes)
	if err != nil {
		return nil, err
	}
	names, err := sortedShards(dir, regular, indexes, shardNames)
	if err != nil {
		return nil, err
	}
	all, meta, owner, err := p.readShards(names)
	if err != nil {
		return nil, err
	}
	if err := checkIndex(dir, indexes, wantTensors, owner); err != nil {
		return nil, err
	}
	if err := p.openFiles(regular, shardNames); err != nil {
		return nil, err
	}
	sort.Strings(p.Skipped)
	p.Tensors = len(all)
	if err := p.layOut(all, meta); err != nil {
		return nil, err
	}
	return p, nil
}

// dirEntry is a regular file of the directory, links followed.
type dirEntry struct {
	name string
	info os.FileInfo
}

// list sorts the directory's entries: regular files (and which of them are
// safetensors indexes) kept, the rest skipped.
func (p *Plan) list(ents []os.DirEntry) (regular []dirEntry, indexes []string) {
	for _, e := range ents {
		name := e.Name()
		path := filepath.Join(p.Dir, name)
		info, err := os.Stat(path) // follows links
		if err != nil {
			p.skip(name, "unreadable: "+err.Error())
			continue
		}
		switch {
		case info.IsDir():
			p.skip(name+"/", "a directory")
		case !info.Mode().IsRegular():
			p.skip(name, "not a regular file")
		case !utf8.ValidString(name):
			p.skip(name, "name is not UTF-8")
		default:
			regular = append(regular, dirEntry{name, info})
			if strings.HasSuffix(name, indexSuffix) {
				indexes = append(indexes, name)
			}
		}
	}
	return regular, indexes
}

// chooseShards names the shards: those the one index names (wantTensors is
// its tensor -> shard map), or without one every *.safetensors file.
func chooseShards(dir string, regular []dirEntry, indexes []string) (shardNames map[string]bool, wantTensors map[string]string, err error) {
	shardNames = map[string]bool{}
	switch len(indexes) {
	case 0:
		for _, e := range regular {
			if strings.HasSuffix(e.name, ".safetensors") {
				shardNames[e.name] = true
			}
		}
	case 1:
		wantTensors, err = readIndex(dir, indexes[0])
		if err != nil {
			return nil, nil, err
		}
		for _, shard := range wantTensors {
			shardNames[shard] = true
		}
	default:
		return nil, nil, fmt.Errorf("%s has %d safetensors indexes (%s): keep one", dir, len(indexes), strings.Join(indexes, ", "))
	}
	if len(shardNames) == 0 {
		hint := ""
		for _, e := range regular {
			if strings.HasSuffix(e.name, ".bin") || strings.HasSuffix(e.name, ".pt") || strings.HasSuffix(e.name, ".pth") {
				hint = " (only safetensors checkpoints are read; convert " + e.name + " first)"
				break
			}
		}
		if len(indexes) == 1 {
			return nil, nil, fmt.Errorf("%s names no shards", filepath.Join(dir, indexes[0]))
		}
		return nil, nil, fmt.Errorf("%s has no *.safetensors files%s", dir, hint)
	}
	return shardNames, wantTensors, nil
}

// sortedShards is the shards in name order, each checked to be there.
func sortedShards(dir string, regular []dirEntry, indexes []string, shardNames map[string]bool) ([]string, error) {
	present := map[string]bool{}
	for _, e := range regular {
		present[e.name] = true
	}
	var names []string
	for name := range shardNames {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		if !present[name] {
			return nil, fmt.Errorf("%s names shard %s, which is not in %s", filepath.Join(dir, indexes[0]), name, dir)
		}
	}
	return names, nil
}

// readShards opens the shards in turn and reads their headers: every
// tensor (its offsets rebased to the shards' data laid end to end), the
// metadata (the first shard's value of each key), and each tensor's shard.
// A tensor in two shards is an error.
func (p *Plan) readShards(names []string) (all []safetensors.Tensor, meta, owner map[string]string, err error) {
	owner = map[string]string{} // tensor -> shard
	meta = map[string]string{}
	at := int64(0) // data offset, relative to the data's start
	for _, name := range names {
		sh, h, err := openShard(p.Dir, name)
		if err != nil {
			return nil, nil, nil, err
		}
		p.Shards = append(p.Shards, sh)
		s := &p.Shards[len(p.Shards)-1]
		for _, t := range h.Tensors {
			if prev, ok := owner[t.Name]; ok {
				return nil, nil, nil, fmt.Errorf("tensor %q is in both %s and %s", t.Name, filepath.Join(p.Dir, prev), filepath.Join(p.Dir, name))
			}
			owner[t.Name] = name
			t.Begin += uint64(at)
			t.End += uint64(at)
			all = append(all, t)
		}
		for k, v := range h.Metadata {
			if _, ok := meta[k]; !ok {
				meta[k] = v
			}
		}
		s.DataAt = at // rebased by layOut, once the header's length is known
		at = alignUp(at+s.Size-s.HeaderLen, Align)
	}
	return all, meta, owner, nil
}

// checkIndex holds the index's tensor -> shard map (wantTensors) against
// where the shards put each tensor (owner).
func checkIndex(dir string, indexes []string, wantTensors, owner map[string]string) error {
	wanted := make([]string, 0, len(wantTensors))
	for t := range wantTensors {
		wanted = append(wanted, t)
	}
	sort.Strings(wanted)
	for _, t := range wanted {
		if shard := wantTensors[t]; owner[t] != shard {
			if owner[t] == "" {
				return fmt.Errorf("%s says tensor %q is in %s, which has no such tensor", filepath.Join(dir, indexes[0]), t, filepath.Join(dir, shard))
			}
			return fmt.Errorf("%s says tensor %q is in %s, but it is in %s", filepath.Join(dir, indexes[0]), t, shard, filepath.Join(dir, owner[t]))
		}
	}
	return nil
}

// openFiles opens the small files kept with the tensors, and skips the
// other files that are not shards.
func (p *Plan) openFiles(regular []dirEntry, shardNames map[string]bool) error {
	for _, e := range regular {
		switch {
		case shardNames[e.name]:
		case strings.HasSuffix(e.name, ".safetensors"):
			p.skip(e.name, "a safetensors file the index does not name")
		case e.info.Size() > MaxFileSize:
			p.skip(e.name, fmt.Sprintf("%d bytes, over the %d MiB limit for small files", e.info.Size(), MaxFileSize>>20))
		default:
			f, err := os.Open(filepath.Join(p.Dir, e.name))
			if err != nil {
				return err
			}
			p.Files = append(p.Files, File{Name: e.name, Size: e.info.Size(), file: f})
			if st, err := f.Stat(); err != nil || st.Size() != e.info.Size() {
				return fmt.Errorf("%s changed while being read", filepath.Join(p.Dir, e.name))
			}
		}
	}
	return nil
}

// layOut places the parts in the segment: the combined header, the
// shards' data, the small files, the shards' original headers, the shard
// table; and checks that the meta listing them fits.
func (p *Plan) layOut(all []safetensors.Tensor, meta map[string]string) error {
	p.prefix = safetensors.Encode(all, meta, Align)
	data := int64(len(p.prefix))
	var end int64
	for i := range p.Shards {
		s := &p.Shards[i]
		s.DataAt += data
		end = s.DataAt + s.Size - s.HeaderLen
	}
	p.DataBytes = end - data
	pos := alignUp(end, Align)
	for i := range p.Files {
		p.Files[i].At = pos
		pos = alignUp(pos+p.Files[i].Size, Align)
	}
	tab := table{Version: 1}
	for i := range p.Shards {
		s := &p.Shards[i]
		s.HeaderAt = pos
		pos = alignUp(pos+s.HeaderLen, Align)
		// The checksum is a placeholder of its final length: the table's
		// room is fixed now, and the table is made again, with the
		// checksums, once the copy computed them (Table).
		id := s.Origin.Sealed(0)
		tab.Shards = append(tab.Shards, tableShard{Name: s.Name, Header: [2]int64{s.HeaderAt, s.HeaderLen}, Data: [2]int64{s.DataAt, s.Size - s.HeaderLen}, Origin: &id})
	}
	p.table, _ = json.Marshal(tab)
	p.tableAt = pos
	p.Size = pos + int64(len(p.table))
	if m, err := p.Meta(true); err != nil {
		return err
	} else if len(m) > wire.MaxMeta {
		return fmt.Errorf("%s: listing its %d small files takes %d bytes of meta, over the limit of %d; move some out of the directory", p.Dir, len(p.Files), len(m), wire.MaxMeta)
	}
	return nil
}

func (p *Plan) skip(name, why string) {
	p.Skipped = append(p.Skipped, name+" ("+why+")")
}

func alignUp(n, a int64) int64 { return (n + a - 1) / a * a }

// readIndex reads a model.safetensors.index.json's weight_map.
func readIndex(dir, name string) (map[string]string, error) {
	path := filepath.Join(dir, name)
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if st, err := f.Stat(); err == nil && st.Size() > MaxFileSize {
		return nil, fmt.Errorf("%s is over %d MiB: not an index", path, MaxFileSize>>20)
	}
	b, err := io.ReadAll(io.LimitReader(f, MaxFileSize))
	if err != nil {
		return nil, err
	}
	var idx struct {
		WeightMap map[string]string `json:"weight_map"`
	}
	if err := json.Unmarshal(b, &idx); err != nil {
		return nil, fmt.Errorf("%s is not a safetensors index: %w", path, err)
	}
	if len(idx.WeightMap) == 0 {
		return nil, fmt.Errorf("%s has no weight_map", path)
	}
	for t, shard := range idx.WeightMap {
		if !ValidName(shard) || !strings.HasSuffix(shard, ".safetensors") {
			return nil, fmt.Errorf("%s maps tensor %q to %q, which is not a .safetensors file in the same directory", path, t, shard)
		}
	}
	return idx.WeightMap, nil
}

func openShard(dir, name string) (Shard, *safetensors.Header, error) {
	path := filepath.Join(dir, name)
	f, err := os.Open(path)
	if err != nil {
		return Shard{}, nil, err
	}
	st, err := f.Stat()
	if err == nil && !st.Mode().IsRegular() {
		err = errors.New("not a regular file")
	}
	var h *safetensors.Header
	if err == nil {
		h, err = safetensors.Read(f, st.Size())
	}
	var hdr []byte
	if err == nil {
		hdr = make([]byte, h.DataStart())
		_, err = f.ReadAt(hdr, 0)
	}
	if err != nil {
		f.Close()
		return Shard{}, nil, fmt.Errorf("%s is not a valid safetensors file: %w", path, err)
	}
	// Taken before the header is read (f.Stat above is the same fstat;
	// this one has the identity's fields), and compared after the copy.
	id, err := StatFile(f)
	if err == nil && id.Size != st.Size() {
		err = fmt.Errorf("%s changed while being read", path)
	}
	if err != nil {
		f.Close()
		return Shard{}, nil, err
	}
	return Shard{Name: name, Size: st.Size(), HeaderLen: h.DataStart(), Origin: id, header: hdr, file: f}, h, nil
}

// Close closes the files the plan holds open.
func (p *Plan) Close() error {
	var errs []error
	for _, s := range p.Shards {
		if s.file != nil {
			errs = append(errs, s.file.Close())
		}
	}
	for _, f := range p.Files {
		if f.file != nil {
			errs = append(errs, f.file.Close())
		}
	}
	return errors.Join(errs...)
}

// Ranges are the file bytes to copy into the segment: each shard's data
// (the first len(Shards) ranges, in Shards' order), then the small files.
// Write Pieces and, after the copy, Table too.
func (p *Plan) Ranges() []Range {
	var rs []Range
	for _, s := range p.Shards {
		rs = append(rs, Range{File: s.file, Off: s.HeaderLen, Len: s.Size - s.HeaderLen, At: s.DataAt})
	}
	for _, f := range p.Files {
		rs = append(rs, Range{File: f.file, Len: f.Size, At: f.At})
	}
	return rs
}

// Piece is bytes made or read by Scan, and where they go in the segment.
type Piece struct {
	At   int64
	Data []byte
}

// Pieces are the bytes Scan holds for the segment: the combined header and
// each shard's original header (as checked, not read again). The shard
// table comes last, from Table.
func (p *Plan) Pieces() []Piece {
	ps := []Piece{{0, p.prefix}}
	for _, s := range p.Shards {
		ps = append(ps, Piece{s.HeaderAt, s.header})
	}
	return ps
}

// Table is the shard table, made once the shards' data is copied: dataCRC
// holds the CRC-32C of each shard's data range (Ranges' first len(Shards)),
// as the copy computed them. The table then records each shard's identity
// with its whole file's checksum (its header's, which Scan holds, combined
// with its data's), which crcs returns too, in Shards' order. With dataCRC
// nil (a daemon that copied without hashing) the table has no such
// records, and is padded with spaces to the room Scan made for it. Either
// way every shard is checked again with fstat: one written since Scan
// opened it is an error, and the bundle must not be committed.
func (p *Plan) Table(dataCRC []uint32) (tab Piece, crcs []uint32, err error) {
	if dataCRC != nil && len(dataCRC) != len(p.Shards) {
		return Piece{}, nil, fmt.Errorf("%d data checksums for %d shards", len(dataCRC), len(p.Shards))
	}
	t := table{Version: 1}
	for i, s := range p.Shards {
		if err := s.Origin.Unchanged(s.file); err != nil {
			return Piece{}, nil, err
		}
		e := tableShard{Name: s.Name, Header: [2]int64{s.HeaderAt, s.HeaderLen}, Data: [2]int64{s.DataAt, s.Size - s.HeaderLen}}
		if dataCRC != nil {
			crc := crc32c.Combine(crc32c.Checksum(s.header), dataCRC[i], s.Size-s.HeaderLen)
			id := s.Origin.Sealed(crc)
			e.Origin = &id
			crcs = append(crcs, crc)
		}
		t.Shards = append(t.Shards, e)
	}
	b, err := json.Marshal(t)
	if err != nil {
		return Piece{}, nil, err
	}
	if len(b) > len(p.table) {
		return Piece{}, nil, fmt.Errorf("the shard table takes %d bytes, more than the %d it was given", len(b), len(p.table))
	}
	for len(b) < len(p.table) {
		b = append(b, ' ')
	}
	return Piece{p.tableAt, b}, crcs, nil
}

// Meta is the segment's meta; readOnly asks clients to map it read-only
// unless told otherwise.
func (p *Plan) Meta(readOnly bool) (json.RawMessage, error) {
	files := p.Files
	if files == nil {
		files = []File{}
	}
	return json.Marshal(Meta{
		Kind: "bundle", Format: "safetensors",
		HeaderBytes: int64(len(p.prefix)) - 8, Tensors: p.Tensors,
		Source: "dir", Files: files, Shards: &Region{p.tableAt, int64(len(p.table))},
		ReadOnly: readOnly, Origin: &Origin{Dir: p.OriginDir},
	})
}

// Meta is a bundle segment's meta.
type Meta struct {
	Kind        string `json:"kind"`   // "bundle"
	Format      string `json:"format"` // "safetensors"
	HeaderBytes int64  `json:"header_bytes"`
	Tensors     int    `json:"tensors"`
	// Source is "dir" for a checkpoint directory; empty for one file.
	Source string `json:"source,omitempty"`
	// Files are the small files kept with the tensors.
	Files []File `json:"files,omitempty"`
	// Shards points at the shard table.
	Shards *Region `json:"shards,omitempty"`
	// ReadOnly asks clients to map the segment read-only unless they ask
	// for write access.
	ReadOnly bool `json:"readonly,omitempty"`
	// Origin says where the files came from (origin.go).
	Origin *Origin `json:"origin,omitempty"`
}

// Region is a byte range of the segment.
type Region struct {
	At   int64 `json:"offset"`
	Size int64 `json:"size"`
}

type table struct {
	Version int          `json:"version"`
	Shards  []tableShard `json:"shards"`
}

type tableShard struct {
	Name   string   `json:"name"`
	Header [2]int64 `json:"header"` // offset, length in the segment
	Data   [2]int64 `json:"data"`
	// Origin is the shard file's identity, without its name.
	Origin *Identity `json:"origin,omitempty"`
}

// ParseMeta reads a segment's meta as a bundle's; ok is false for meta of
// another kind.
func ParseMeta(raw json.RawMessage, size int64) (m *Meta, ok bool, err error) {
	var probe struct{ Kind, Format string }
	if len(raw) == 0 || json.Unmarshal(raw, &probe) != nil || probe.Kind != "bundle" || probe.Format != "safetensors" {
		return nil, false, nil
	}
	m = &Meta{}
	if err := json.Unmarshal(raw, m); err != nil {
		return nil, true, fmt.Errorf("bundle meta: %w", err)
	}
	if m.HeaderBytes < 2 || 8+m.HeaderBytes > size {
		return nil, true, fmt.Errorf("bundle meta: header_bytes %d does not fit the segment's %d bytes", m.HeaderBytes, size)
	}
	for _, f := range m.Files {
		if !ValidName(f.Name) {
			return nil, true, fmt.Errorf("bundle meta: file name %q is not a plain file name", f.Name)
		}
		if !inside(f.At, f.Size, size) {
			return nil, true, fmt.Errorf("bundle meta: file %s [%d, +%d) lies outside the segment's %d bytes", f.Name, f.At, f.Size, size)
		}
	}
	if m.Shards != nil && !inside(m.Shards.At, m.Shards.Size, size) {
		return nil, true, fmt.Errorf("bundle meta: the shard table [%d, +%d) lies outside the segment's %d bytes", m.Shards.At, m.Shards.Size, size)
	}
	return m, true, nil
}

func inside(at, n, size int64) bool { return at >= 0 && n >= 0 && at <= size && n <= size-at }

// ValidName reports whether name is a plain file name: one path element,
// neither "." nor "..". Names read from a segment are checked with it before
// anything is written, since the segment's owner chose them.
func ValidName(name string) bool {
	return name != "" && name != "." && name != ".." && !strings.ContainsAny(name, "/\x00") && utf8.ValidString(name)
}

// OutFile is a file to write back from a segment: pieces of the segment, in
// order, make its bytes.
type OutFile struct {
	Name   string
	Pieces []Region
}

// Size is the file's size.
func (o OutFile) Size() int64 {
	var n int64
	for _, r := range o.Pieces {
		n += r.Size
	}
	return n
}

// Outputs lists the files a directory bundle is written back as: each shard
// (its original header, then its data) and each small file. table is the
// shard table read from the segment at m.Shards.
func (m *Meta) Outputs(raw []byte, size int64) ([]OutFile, error) {
	if m.Source != "dir" || m.Shards == nil {
		return nil, errors.New("not a checkpoint directory's bundle")
	}
	var tab table
	if err := json.Unmarshal(raw, &tab); err != nil {
		return nil, fmt.Errorf("shard table: %w", err)
	}
	if tab.Version != 1 {
		return nil, fmt.Errorf("shard table version %d is not known (want 1)", tab.Version)
	}
	seen := map[string]bool{}
	var out []OutFile
	add := func(name string, pieces ...Region) error {
		if !ValidName(name) {
			return fmt.Errorf("file name %q is not a plain file name", name)
		}
		if seen[name] {
			return fmt.Errorf("file %s is listed twice", name)
		}
		seen[name] = true
		for _, r := range pieces {
			if !inside(r.At, r.Size, size) {
				return fmt.Errorf("file %s: [%d, +%d) lies outside the segment's %d bytes", name, r.At, r.Size, size)
			}
		}
		out = append(out, OutFile{name, pieces})
		return nil
	}
	for _, s := range tab.Shards {
		if err := add(s.Name, Region{s.Header[0], s.Header[1]}, Region{s.Data[0], s.Data[1]}); err != nil {
			return nil, fmt.Errorf("shard table: %w", err)
		}
	}
	for _, f := range m.Files {
		if err := add(f.Name, Region{f.At, f.Size}); err != nil {
			return nil, fmt.Errorf("bundle meta: %w", err)
		}
	}
	return out, nil
}

// FileMeta is the meta of a single file put as a segment: a bundle's when
// the file is safetensors, nil otherwise. A file named *.safetensors must be
// valid; any other counts as safetensors only if it validates completely,
// so that an arbitrary binary is never refused for looking a little like
// one.
func FileMeta(f *os.File, size int64, readOnly bool) (json.RawMessage, error) {
	named := strings.HasSuffix(strings.ToLower(f.Name()), ".safetensors")
	if !named {
		// Cheap sniff before reading up to 100 MB of a header: the JSON
		// object must start right after the length.
		var b [9]byte
		if _, err := f.ReadAt(b[:], 0); err != nil || b[8] != '{' {
			return nil, nil
		}
	}
	h, err := safetensors.Read(io.NewSectionReader(f, 0, size), size)
	if err != nil {
		if named {
			return nil, fmt.Errorf("%s is not a valid safetensors file: %w", f.Name(), err)
		}
		return nil, nil
	}
	return json.Marshal(Meta{Kind: "bundle", Format: "safetensors", HeaderBytes: int64(h.Len), Tensors: len(h.Tensors), ReadOnly: readOnly})
}
