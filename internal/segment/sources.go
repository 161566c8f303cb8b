package segment

import (
	"cmp"
	"slices"

	"github.com/gpushm/gpushm/internal/crc32c"
)

// Sources: what the daemon itself copied into a segment from files (the
// fill operation), with each file's identity as fstat saw it through the
// client's descriptor before and after the copy. They are the daemon's
// word, never a client's: a loader that serves a file's tensors from a
// segment (python -m gpushm.run) trusts these, not the meta a client
// wrote, to say which bytes of the segment are which bytes of which file
// (docs/security.md, "Files served from bundles").
//
// A source stands while the bytes it names are the file's bytes as far as
// the daemon can know: a write the daemon makes into its range (the FUSE
// view, another fill) removes it. Writes through a mapping the daemon
// cannot see, so only the writes of the segment's owner and of root are
// taken on trust (a loader trusts only bundles of root and of its own
// user): once write access went to anyone else (on cuda, any access: a
// read-only open's export can be mapped read-write), or the owner changed
// (the old owner may still hold a mapping), the segment is foreign: its
// sources go, and it records none again. Only fills by the owner or root
// are recorded, and a fill by anyone else makes the segment foreign too:
// its copy may run beside the owner's, interleaving their bytes.

// Source is a range of a segment the daemon filled from a file.
type Source struct {
	// The file, as fstat saw it before and after the copy (the two
	// equal, or no source is recorded).
	Dev     uint64 `json:"dev"`
	Ino     uint64 `json:"ino"`
	Size    int64  `json:"size"`
	MtimeNS int64  `json:"mtime_ns"`
	CtimeNS int64  `json:"ctime_ns"`
	// Off is where the range starts in the file, At in the segment, Len
	// its length.
	Off int64 `json:"offset"`
	At  int64 `json:"at"`
	Len int64 `json:"len"`
	// CRC32C is the range's CRC-32C, as the copy computed it.
	CRC32C uint32 `json:"crc32c"`
}

// sameFile says whether a and b name one file in one state.
func (a Source) sameFile(b Source) bool {
	return a.Dev == b.Dev && a.Ino == b.Ino && a.Size == b.Size && a.MtimeNS == b.MtimeNS && a.CtimeNS == b.CtimeNS
}

// MaxSources bounds the sources a segment keeps: a checkpoint directory's
// bundle takes one a file, and a file filled in steps one in all. Past it
// no further source is recorded (a loader then reads those files itself).
// A segment's journal record and its stat reply each go in one message of
// 64 KiB, half of which its meta may take: 128 sources of the largest
// numbers leave room for the rest. With 1024, any user's own segment made
// a record the serving process could not journal, which broke its link to
// the supervisor for as long as that segment lived: every other change was
// dropped, and a crash then lost them (another user's write access to
// root's bundle among them, which brought its sources back).
const MaxSources = 128

// ForgetSources removes the sources overlapping [at, at+n) of s: the
// daemon is about to write there.
func (r *Registry) ForgetSources(s *Segment, at, n int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.forgetSourcesLocked(s, at, n)
}

func (r *Registry) forgetSourcesLocked(s *Segment, at, n int64) {
	if len(s.sources) == 0 {
		return
	}
	// A new slice, never the old one changed: journal records share it
	// (recordLocked).
	var keep []Source
	for _, src := range s.sources {
		if src.At+src.Len <= at || at+n <= src.At {
			keep = append(keep, src)
		}
	}
	if len(keep) == len(s.sources) {
		return
	}
	s.sources = keep
	r.noteLocked(s, -1)
}

// AddSource records that the daemon copied src into s for c. A range
// that continues one of the same file (a fill in steps) extends it.
func (r *Registry) AddSource(c Cred, s *Segment, src Source) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if s.gone || s.published || s.foreign || src.Len <= 0 || !trustedWriter(c, s) {
		// A published segment's memory is its publisher's too, who writes
		// it unseen.
		return
	}
	r.forgetSourcesLocked(s, src.At, src.Len)
	for i, p := range s.sources {
		if p.sameFile(src) && p.Off+p.Len == src.Off && p.At+p.Len == src.At {
			p.CRC32C = crc32c.Combine(p.CRC32C, src.CRC32C, src.Len)
			p.Len += src.Len
			s.sources = slices.Clone(s.sources)
			s.sources[i] = p
			r.noteLocked(s, -1)
			return
		}
	}
	if len(s.sources) >= MaxSources {
		return
	}
	s.sources = append(slices.Clip(s.sources), src)
	r.noteLocked(s, -1)
}

// trustedWriter says whether c's writes to s are taken on trust.
func trustedWriter(c Cred, s *Segment) bool { return c.UID == 0 || c.UID == s.uid }

// Filling is told that c has the daemon copy into s (fill), whatever
// lease c holds. A host copy kept clean (tier.go) goes: the next eviction
// would bring back the bytes from before the fill, under its source. And
// the daemon sees the write, but not the order of its bytes against those
// of a fill running beside it, whose source would then stand over c's
// bytes: unless c's writes are trusted, s is foreign from now on, as when
// c is given write access to the memory itself.
func (r *Registry) Filling(c Cred, s *Segment) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.writtenLocked(s)
	r.grantWriteLocked(c, s)
}

// grantWriteLocked is told that c gets write access to s's memory, which
// the daemon will not see used: unless c is s's owner or root, s is
// foreign from now on.
func (r *Registry) grantWriteLocked(c Cred, s *Segment) {
	if !trustedWriter(c, s) {
		r.makeForeignLocked(s)
	}
}

// handleCUDA is the cuda backend's HandleType (wire.HandleCUDA).
const handleCUDA = "cuda_fd"

// readersWrite says whether a read-only open hands out a descriptor that
// its holder can write through all the same: a CUDA export carries no
// access mode, and whoever imports it may map it read-write
// (docs/security.md, "What read-only can and cannot promise"). There a
// read-only open by anyone but the owner and root makes the segment
// foreign: a reader of root's bundle wrote it, and the hook served that.
func (r *Registry) readersWrite() bool { return r.alloc.HandleType() == handleCUDA }

// makeForeignLocked marks s as written by someone the sources' readers do
// not trust, for good: its sources go, and no more are recorded.
func (r *Registry) makeForeignLocked(s *Segment) {
	if s.foreign {
		return
	}
	s.foreign, s.sources = true, nil
	r.noteLocked(s, -1)
}

// sourcesOf copies s's sources, in segment order.
func sourcesOf(s *Segment) []Source {
	if len(s.sources) == 0 {
		return nil
	}
	out := slices.Clone(s.sources)
	slices.SortFunc(out, func(a, b Source) int { return cmp.Compare(a.At, b.At) })
	return out
}
