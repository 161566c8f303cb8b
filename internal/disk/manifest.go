package disk

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"time"

	"github.com/gpushm/gpushm/internal/crc32c"
)

// Limits on what a manifest holds, so that a decoder never allocates more
// than a few MiB for a file it has not yet verified.
const (
	MaxKey     = 4096    // bytes of a key
	MaxMeta    = 1 << 20 // bytes of an entry's Meta
	maxStripes = 256     // directories a copy is striped over
	maxChunks  = 1 << 24 // chunks of a copy: 1 PiB at 64 MiB
)

// manifestMagic starts every manifest; its last byte is the format's
// version.
var manifestMagic = [8]byte{'g', 'p', 'u', 's', 'h', 'm', 'D', 1}

// idLen is the length of a directory's id.
const idLen = 16

// A dirID names a directory of a store, whatever path it is given by: a
// copy's manifest records its stripes' directories by id, so that the
// directories may be given in another order, or at other paths, after a
// restart.
type dirID [idLen]byte

func (d dirID) String() string { return hex.EncodeToString(d[:]) }

// A manifest describes one committed copy: what the daemon stored (key,
// meta, size), where its bytes are (the stripes' directories) and their
// chunks' checksums.
type manifest struct {
	key     string
	meta    []byte
	gen     uint64
	size    int64
	chunk   int64
	align   int64 // the data files' last chunk is padded to a multiple of it
	written time.Time
	stripes []dirID  // chunk i is in stripes[i%len(stripes)]; stripes[0] holds the primary manifest
	sums    []uint32 // CRC-32C of each chunk's bytes (not its padding)
}

// nchunks is the number of chunks of size bytes.
func nchunks(size, chunk int64) int64 { return (size + chunk - 1) / chunk }

// encode lays m out: the magic, the fixed fields, the stripes, key, meta,
// the chunks' sums, and the CRC-32C of all that, little-endian.
func (m *manifest) encode() []byte {
	var b bytes.Buffer
	b.Write(manifestMagic[:])
	le := binary.LittleEndian
	for _, v := range []uint64{m.gen, uint64(m.size), uint64(m.chunk), uint64(m.align), uint64(m.written.UnixNano())} {
		b.Write(le.AppendUint64(nil, v))
	}
	for _, v := range []int{len(m.stripes), len(m.key), len(m.meta), len(m.sums)} {
		b.Write(le.AppendUint32(nil, uint32(v)))
	}
	for _, s := range m.stripes {
		b.Write(s[:])
	}
	b.WriteString(m.key)
	b.Write(m.meta)
	for _, s := range m.sums {
		b.Write(le.AppendUint32(nil, s))
	}
	b.Write(le.AppendUint32(nil, crc32c.Checksum(b.Bytes())))
	return b.Bytes()
}

// manifestLen is the length of m's encoding.
func (m *manifest) manifestLen() int64 {
	return int64(len(manifestMagic) + 5*8 + 4*4 + idLen*len(m.stripes) + len(m.key) + len(m.meta) + 4*len(m.sums) + 4)
}

var errManifest = errors.New("not a valid manifest")

// decodeManifest reads a manifest, checking its checksum first and then
// that every field is consistent with the others.
func decodeManifest(b []byte) (*manifest, error) {
	const fixed = len(manifestMagic) + 5*8 + 4*4
	if len(b) < fixed+4 {
		return nil, fmt.Errorf("%w: %d bytes, too short", errManifest, len(b))
	}
	if !bytes.Equal(b[:len(manifestMagic)], manifestMagic[:]) {
		return nil, fmt.Errorf("%w: bad magic %q", errManifest, b[:len(manifestMagic)])
	}
	le := binary.LittleEndian
	body, sum := b[:len(b)-4], le.Uint32(b[len(b)-4:])
	if got := crc32c.Checksum(body); got != sum {
		return nil, fmt.Errorf("%w: checksum %08x, recorded %08x", errManifest, got, sum)
	}
	p := body[len(manifestMagic):]
	u64 := func() uint64 { v := le.Uint64(p); p = p[8:]; return v }
	u32 := func() int64 { v := le.Uint32(p); p = p[4:]; return int64(v) }
	m := &manifest{gen: u64(), size: int64(u64()), chunk: int64(u64()), align: int64(u64())}
	m.written = time.Unix(0, int64(u64()))
	nstripes, nkey, nmeta, nsums := u32(), u32(), u32(), u32()
	switch {
	case m.size < 0 || m.chunk <= 0 || m.chunk%chunkUnit != 0 || m.align <= 0 || m.align > chunkUnit || chunkUnit%m.align != 0:
		return nil, fmt.Errorf("%w: size %d, chunk %d, alignment %d", errManifest, m.size, m.chunk, m.align)
	case nstripes < 1 || nstripes > maxStripes || nstripes > max(1, nsums):
		return nil, fmt.Errorf("%w: %d stripes", errManifest, nstripes)
	case nkey < 1 || nkey > MaxKey || nmeta > MaxMeta:
		return nil, fmt.Errorf("%w: key of %d bytes, meta of %d", errManifest, nkey, nmeta)
	case nsums != nchunks(m.size, m.chunk) || nsums > maxChunks:
		return nil, fmt.Errorf("%w: %d checksums for %d bytes in chunks of %d", errManifest, nsums, m.size, m.chunk)
	case int64(len(p)) != nstripes*idLen+nkey+nmeta+4*nsums:
		return nil, fmt.Errorf("%w: %d bytes of fields, want %d", errManifest, len(p), nstripes*idLen+nkey+nmeta+4*nsums)
	}
	m.stripes = make([]dirID, nstripes)
	for i := range m.stripes {
		p = p[copy(m.stripes[i][:], p):]
	}
	for i := range m.stripes {
		for j := range i {
			if m.stripes[i] == m.stripes[j] {
				return nil, fmt.Errorf("%w: directory %s holds two stripes", errManifest, m.stripes[i])
			}
		}
	}
	m.key, p = string(p[:nkey]), p[nkey:]
	m.meta, p = bytes.Clone(p[:nmeta]), p[nmeta:]
	m.sums = make([]uint32, nsums)
	for i := range m.sums {
		m.sums[i] = uint32(u32())
	}
	return m, nil
}

// chunkLen is the length of chunk i's bytes, padded says how many the
// data file holds for it: the last chunk is padded to the alignment.
func (m *manifest) chunkLen(i int64) (n, padded int64) {
	n = min(m.chunk, m.size-i*m.chunk)
	return n, (n + m.align - 1) / m.align * m.align
}

// stripeLen is the length of stripe j's data file.
func (m *manifest) stripeLen(j int) int64 {
	var n int64
	for i := int64(j); i < int64(len(m.sums)); i += int64(len(m.stripes)) {
		_, p := m.chunkLen(i)
		n += p
	}
	return n
}

// footprint is the bytes the copy takes on disk: its data files, and a
// manifest in each of their directories.
func (m *manifest) footprint() int64 {
	n := int64(len(m.stripes)) * m.manifestLen()
	for j := range m.stripes {
		n += m.stripeLen(j)
	}
	return n
}

// keyHash names a key's files: hex of the first 16 bytes of its SHA-256,
// so that no key, whatever bytes it holds, makes a path of its own.
func keyHash(key string) string {
	h := sha256.Sum256([]byte(key))
	return hex.EncodeToString(h[:16])
}
