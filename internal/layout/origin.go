package layout

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/gpushm/gpushm/internal/crc32c"
)

// Where a bundle came from (docs/protocol.md, "Where a bundle came from"):
// put records, for every safetensors file it copies, the file's identity
// as fstat gives it and the CRC-32C of its bytes, computed by whoever
// copied them while copying. A loader that opens a path then serves it from
// the bundle only when the path's directory (symbolic links resolved) is
// the origin's, and a stat of the path, following links, matches the
// record; it never reads the file to compare.

// Identity is what put records of one file: its name in the origin's
// directory (absent in a shard table's entry, which has its own), its
// size, modification and status change times in nanoseconds, the device
// and inode it lives on, and the CRC-32C of its bytes in 8 lowercase
// hexadecimal digits.
type Identity struct {
	Name    string `json:"name,omitempty"`
	Size    int64  `json:"size"`
	MtimeNS int64  `json:"mtime_ns"`
	CtimeNS int64  `json:"ctime_ns"`
	Dev     uint64 `json:"dev"`
	Ino     uint64 `json:"ino"`
	CRC32C  string `json:"crc32c"`
}

// Origin is a bundle meta's "origin": the directory the files came from,
// absolute, symbolic links resolved, and for a single file's bundle its
// identity (a directory's shards have theirs in the shard table).
type Origin struct {
	Dir   string     `json:"dir"`
	Files []Identity `json:"files,omitempty"`
}

// OriginDir is the directory put records for files in dir: absolute, with
// symbolic links resolved. The files' own links are not resolved: a
// Hugging Face snapshot's shard is a link into the cache's blobs, and it is
// the snapshot's path that a loader opens.
func OriginDir(dir string) (string, error) {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return "", err
	}
	return filepath.EvalSymlinks(abs)
}

// StatFile is f's identity without its checksum, from fstat of f's
// descriptor: the file a symbolic link led to when f was opened.
func StatFile(f *os.File) (Identity, error) {
	id, err := fstat(f)
	if err != nil {
		return id, fmt.Errorf("stat %s: %w", f.Name(), err)
	}
	return id, nil
}

// Unchanged checks that f has the size and times id has: a file written
// while put copied it may have been copied half old, half new, and its
// checksum would not be its content's.
func (id Identity) Unchanged(f *os.File) error {
	now, err := StatFile(f)
	if err != nil {
		return err
	}
	return id.same(f.Name(), now)
}

func (id Identity) same(name string, now Identity) error {
	if now.Size == id.Size && now.MtimeNS == id.MtimeNS && now.CtimeNS == id.CtimeNS {
		return nil
	}
	return fmt.Errorf("%s changed while it was copied (size %d to %d bytes, modified %s to %s, status changed %s to %s): put it again once nothing writes it",
		name, id.Size, now.Size, stamp(id.MtimeNS), stamp(now.MtimeNS), stamp(id.CtimeNS), stamp(now.CtimeNS))
}

func stamp(ns int64) string { return time.Unix(0, ns).UTC().Format(time.RFC3339Nano) }

// Sealed returns id with the checksum of the file's bytes.
func (id Identity) Sealed(crc uint32) Identity {
	id.CRC32C = crc32c.Format(crc)
	return id
}

// WithOrigin returns a bundle's meta (FileMeta's) with o as its origin.
func WithOrigin(meta json.RawMessage, o *Origin) (json.RawMessage, error) {
	var m Meta
	if err := json.Unmarshal(meta, &m); err != nil {
		return nil, fmt.Errorf("bundle meta: %w", err)
	}
	m.Origin = o
	return json.Marshal(m)
}
