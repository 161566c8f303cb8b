package gpushm

import (
	"context"
	"errors"
	"fmt"
	"os"
	"runtime"
	"time"

	"github.com/gpushm/gpushm/internal/crc32c"
	"github.com/gpushm/gpushm/internal/wire"
	"github.com/gpushm/gpushm/internal/xfer"
)

// A FileRange is Len bytes at Off in File, and At, where they lie in a
// segment.
type FileRange = xfer.Range

// Direct says when LoadFiles reads with O_DIRECT.
type Direct = xfer.Direct

const (
	// DirectAuto reads with O_DIRECT the chunks that are not in the page
	// cache, where the file system allows it, and through the page cache
	// what is already there.
	DirectAuto = xfer.DirectAuto
	// DirectNever always reads through the page cache.
	DirectNever = xfer.DirectNever
	// DirectAlways reads with O_DIRECT wherever the file system allows it.
	DirectAlways = xfer.DirectAlways
)

// CopyOptions tune LoadFiles and StoreFiles. The zero value is the default.
type CopyOptions = xfer.Options

// CopyStats say how a copy went.
type CopyStats = xfer.Stats

// LoadFiles copies every range's bytes from its file into the segment,
// with several copiers in parallel (internal/xfer, the one copy engine of
// put, get and checkpoints). On cuda each copier reads into one of its two
// pinned buffers while the other is on its way to the GPU on the copier's
// own stream. Ranges must not overlap in the segment. With DirectAuto,
// chunks the page cache does not hold are read with O_DIRECT; a file
// system that refuses O_DIRECT is read through the page cache instead.
// Close nothing before it returns.
func (m *Mapping) LoadFiles(ranges []FileRange, o *CopyOptions) (CopyStats, error) {
	if m.readOnly {
		return CopyStats{}, errors.New("gpushm: write to a read-only mapping")
	}
	return xfer.Load(context.Background(), m.target(), ranges, o)
}

// StoreFiles copies the segment's bytes at each range's At into its file,
// with several copiers in parallel (on cuda, each through its own pinned
// buffer and stream).
func (m *Mapping) StoreFiles(ranges []FileRange, o *CopyOptions) (CopyStats, error) {
	return xfer.Store(context.Background(), m.target(), ranges, o)
}

func (m *Mapping) target() xfer.Target {
	return xfer.Target{Dev: m.dev, Ptr: m.ptr, Host: m.host, Size: m.size}
}

// Fill has the daemon copy n bytes at off in f, a regular file, into the
// segment at at, with its copy engine (the same as LoadFiles', with a warm
// CUDA context and pinned buffers): this process maps nothing and needs no
// CUDA context. The segment must be open read-write. The daemon reads only
// through f, which must be open for reading (else EBADF); it reads with
// O_DIRECT only if f was opened with O_DIRECT. A daemon too old to fill
// answers ENOSYS. The stats' CRC32C is the bytes' CRC-32C, which the
// daemon computes as it reads them; one too old to do so leaves it empty.
func (s *Segment) Fill(ctx context.Context, f *os.File, off, at, n int64) (CopyStats, error) {
	return s.copyFile(ctx, wire.OpFill, f, off, at, n)
}

// Dump has the daemon copy n bytes of the segment at at into f at off: a
// regular file (which the daemon writes with parallel pwrites; it does not
// truncate or extend it first), /dev/null, /dev/zero or /dev/full. f must
// be open for writing (else EBADF), and not with O_APPEND (EINVAL).
func (s *Segment) Dump(ctx context.Context, f *os.File, off, at, n int64) (CopyStats, error) {
	return s.copyFile(ctx, wire.OpDump, f, off, at, n)
}

func (s *Segment) copyFile(ctx context.Context, op string, f *os.File, off, at, n int64) (CopyStats, error) {
	if s.closed {
		return CopyStats{}, fmt.Errorf("gpushm: %s of a closed segment", op)
	}
	sh, c := s.sh, s.sh.c
	start := time.Now()
	rep, _, err := c.roundTripFD(ctx, &wire.Request{Op: op, Segment: sh.info.ID, Offset: off, At: at, Size: n}, int(f.Fd()))
	runtime.KeepAlive(f)
	if err != nil {
		return CopyStats{}, fmt.Errorf("gpushm: %s %q: %w", op, sh.info.Name, err)
	}
	st := CopyStats{Bytes: rep.Bytes, Direct: rep.Direct, Workers: rep.Copiers,
		Elapsed: time.Duration(rep.CopySeconds * float64(time.Second)), Wall: time.Since(start)}
	if rep.CRC32C != "" {
		crc, err := crc32c.Parse(rep.CRC32C)
		if err != nil {
			return st, fmt.Errorf("gpushm: %s %q: the daemon's reply: %w", op, sh.info.Name, err)
		}
		st.CRC32C = []uint32{crc}
	}
	return st, nil
}
