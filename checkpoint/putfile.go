package checkpoint

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"math/rand/v2"
	"os"
	"path/filepath"
	"syscall"
	"time"
	"unicode/utf8"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/crc32c"
	"github.com/gpushm/gpushm/internal/layout"
	"github.com/gpushm/gpushm/internal/terminal"
	"github.com/gpushm/gpushm/internal/xfer"
)

// A Progress follows one copy, as a bar on a terminal does.
type Progress interface {
	// Add counts n more bytes copied.
	Add(n int64)
	// Done ends the copy, with its error: nil once every byte is copied.
	Done(err error)
}

// follow starts the progress of a copy of total bytes: start's, or none.
func follow(start func(total int64) Progress, total int64) Progress {
	if start == nil {
		return noProgress{}
	}
	return start(total)
}

type noProgress struct{}

func (noProgress) Add(int64)  {}
func (noProgress) Done(error) {}

// Copied says what PutFile or GetFile copied.
type Copied struct {
	// File is the file copied from, or written: for GetFile, path/name
	// where path is a directory.
	File string
	// Bytes is the bytes copied.
	Bytes int64
	// Copier is who copied: "daemon", or "client" (this process).
	Copier string
	// CRC32C is the file's CRC-32C, in 8 hexadecimal digits, as PutFile
	// recorded it in the bundle's origin; empty where it recorded none.
	CRC32C string
	// Stats are the copy's.
	Stats gpushm.CopyStats
}

// File is a file to put into a segment (PutFile), opened, its size known:
// a regular file, or standard input spooled to a temporary file. A
// safetensors file's header is checked, and its identity taken for the
// bundle's origin. Close it.
type File struct {
	f    *os.File
	path string
	size int64
	// meta is a tensor bundle's, or nil.
	meta json.RawMessage
	// origin is where a bundle came from, without its checksum; nil
	// from standard input, and for a file that is not a bundle.
	origin *layout.Origin
}

// OpenFile opens path for PutFile: a regular file, or with "-" standard
// input, spooled to a temporary file first to learn its size. A file
// named *.safetensors must be a valid one; any other is a tensor bundle
// only if it is one completely, so that an arbitrary binary is never
// refused for looking a little like one.
//
// ctx done while standard input is read fails it: the writer of a pipe
// usually dies of the same Ctrl-C, and what was read up to then is not
// the whole input. A pipe's read ends at once (through the runtime's
// poller, on a descriptor of its own), whether or not the writer dies;
// other inputs (a file, a terminal, which is the shell's too) are read to
// their end.
func OpenFile(ctx context.Context, path string) (_ *File, err error) {
	f, size, err := openSource(ctx, path)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			f.Close()
		}
	}()
	src := &File{f: f, path: path, size: size}
	if size == 0 {
		return src, nil // an empty segment: no layout, no origin
	}
	// The file's identity, taken before its header is read, for the
	// bundle's origin.
	var origin *layout.Origin
	if path != "-" {
		origin = &layout.Origin{}
		if origin.Dir, err = layout.OriginDir(filepath.Dir(path)); err != nil {
			return nil, err
		}
		id, err := layout.StatFile(f)
		if err != nil {
			return nil, err
		}
		id.Name = filepath.Base(path)
		origin.Files = []layout.Identity{id}
	}
	if src.meta, err = layout.FileMeta(f, size, false); err != nil {
		return nil, err
	}
	if src.meta != nil {
		src.origin = origin // only bundles say where they came from
	}
	return src, nil
}

// Close closes the file (a spooled one is gone with it).
func (f *File) Close() error { return f.f.Close() }

// Size is the file's size, and the segment's.
func (f *File) Size() int64 { return f.size }

// Bundle says whether the file is a tensor bundle: a safetensors file,
// whose segment's meta is its tensors' layout.
func (f *File) Bundle() bool { return f.meta != nil }

// openSource opens path, or spools stdin for "-", and tells its size.
func openSource(ctx context.Context, path string) (*os.File, int64, error) {
	if path != "-" {
		f, err := os.Open(path)
		if err != nil {
			return nil, 0, err
		}
		st, err := f.Stat()
		if err != nil {
			f.Close()
			return nil, 0, err
		}
		if !st.Mode().IsRegular() {
			f.Close()
			return nil, 0, fmt.Errorf("%s is not a regular file (use '-' with a pipe)", path)
		}
		return f, st.Size(), nil
	}
	tmp, err := os.CreateTemp("", "gpushm-put-*")
	if err != nil {
		return nil, 0, fmt.Errorf("spool stdin: %w", err)
	}
	os.Remove(tmp.Name())
	size, err := spool(ctx, tmp)
	if err == nil {
		_, err = tmp.Seek(0, io.SeekStart)
	}
	if err != nil {
		tmp.Close()
		return nil, 0, fmt.Errorf("spool stdin: %w", err)
	}
	return tmp, size, nil
}

// spool copies standard input to dst until its end, or until ctx is done,
// which fails it: what was read is not the whole input.
func spool(ctx context.Context, dst *os.File) (int64, error) {
	in := os.Stdin
	// A terminal's description is the shell's too: left non-blocking by a
	// forced exit, it would be the shell's problem.
	if fd, err := unix.Dup(0); err == nil && !terminal.Is(in) {
		// O_NONBLOCK is the open file description's, shared with
		// descriptor 0: it is set back through 0 before return.
		if unix.SetNonblock(fd, true) == nil {
			defer unix.SetNonblock(0, false)
		}
		in = os.NewFile(uintptr(fd), "standard input")
		defer in.Close()
		stop := context.AfterFunc(ctx, func() { in.SetReadDeadline(time.Now()) })
		defer stop()
	} else if err == nil {
		unix.Close(fd)
	}
	n, err := io.Copy(dst, in)
	if cerr := ctx.Err(); cerr != nil {
		return n, cerr
	}
	return n, err
}

// PutFileOptions are the optional parts of PutFile: PutOptions's (whose
// Copy.Progress PutFile does not use: Progress is its), and those below.
type PutFileOptions struct {
	PutOptions
	// Meta is the segment's user metadata, for a file that is not a
	// tensor bundle (a bundle's meta is its layout).
	Meta json.RawMessage
	// Progress, if set, is called once the segment is made, with the
	// bytes to copy, and what it returns follows the copy.
	Progress func(total int64) Progress
	// Log, if set, is told what the put could not record, and why: a
	// daemon too old to checksum what it copies, or to take meta with a
	// commit, leaves the bundle without its origin, and loaders then read
	// the file itself.
	Log *log.Logger
}

// PutFile creates name holding f's bytes, of exactly f's size. The
// segment is created uncommitted and committed once full, so nobody opens
// it half written; on any failure, ctx done before the commit, or if this
// process dies first, it goes. With NextVersion, the segment becomes
// name's next version, which its commit makes current (the readers of the
// old one refresh onto it).
//
// Whoever copies a tensor bundle (the daemon, or this process) computes
// its CRC-32C while copying, and the commit records where it came from:
// the directory, symbolic links resolved, and the file's identity with its
// checksum (docs/protocol.md, "Where a bundle came from"). A file written
// during the copy fails the put.
//
// An empty file makes an empty segment: a name that holds no memory, as
// an empty file does (docs/protocol.md, "create": empty). Replacing name,
// it is made under a name of its own beside it and renamed over name, one
// step as a next version's commit is; a process killed between the two
// leaves that name, which says what it is.
func PutFile(ctx context.Context, c *gpushm.Client, name string, f *File, o *PutFileOptions) (Copied, error) {
	if o == nil {
		o = &PutFileOptions{}
	}
	res := Copied{File: f.path, Bytes: f.size, Copier: "client"}
	if f.size == 0 {
		return res, putEmpty(ctx, c, name, f, o)
	}
	meta := f.meta
	switch {
	case meta == nil && o.ReadOnlyDefault:
		return res, fmt.Errorf("checkpoint: read-only by default is for tensor bundles, and %s is not a safetensors file", f.path)
	case meta != nil && o.Meta != nil:
		return res, fmt.Errorf("checkpoint: meta for %s, a safetensors file, whose segment's meta is its tensors' layout", f.path)
	case meta == nil:
		meta = o.Meta
	case o.ReadOnlyDefault:
		var err error
		if meta, err = readOnly(meta); err != nil {
			return res, err
		}
	}
	co := &gpushm.CreateOptions{Device: o.Device, Mode: o.Mode, Meta: meta, NextVersion: o.NextVersion, Pin: o.Pin, TTL: o.TTL, Persist: o.Persist, Offer: o.Offer}
	var err error
	res.Stats, res.Copier, err = put(ctx, c, name, f, co, o)
	if err != nil {
		return res, err
	}
	if f.origin != nil && len(res.Stats.CRC32C) == 1 {
		res.CRC32C = crc32c.Format(res.Stats.CRC32C[0])
	}
	return res, nil
}

// readOnly is a bundle's meta (FileMeta's), marked so that clients map it
// read-only unless they ask for write access.
func readOnly(meta json.RawMessage) (json.RawMessage, error) {
	var m layout.Meta
	if err := json.Unmarshal(meta, &m); err != nil {
		return nil, err
	}
	m.ReadOnly = true
	return json.Marshal(m)
}

// put creates name uncommitted and fills it from f, then commits it; on
// any failure, or an interrupt, the segment goes. The daemon copies
// (InDaemon), in steps that progress follows and after which ctx stops
// the copy, or this process, with parallel reads; copier says which did.
// A bundle with an origin is hashed by whoever copies it.
func put(ctx context.Context, c *gpushm.Client, name string, f *File, o *gpushm.CreateOptions, po *PutFileOptions) (st gpushm.CopyStats, copier string, err error) {
	o.Uncommitted = true
	seg, err := c.Create(ctx, name, f.size, o)
	if err != nil {
		return st, "", err
	}
	defer func() {
		// Closed uncommitted, after a failure, the segment goes.
		cerr := seg.Close()
		if err == nil {
			err = cerr
		}
	}()
	p := follow(po.Progress, f.size)
	copier = "daemon"
	if po.InDaemon {
		// The CRC-32C is the whole file's, made of the steps'.
		st, err = xfer.Steps(f.size, p.Add, func(off, k int64) (gpushm.CopyStats, error) {
			return seg.Fill(ctx, f.f, off, off, k)
		})
	}
	if !po.InDaemon || errors.Is(err, syscall.ENOSYS) {
		// This process copies; so does it when the daemon is from before
		// fill.
		copier = "client"
		var m *gpushm.Mapping
		if m, err = seg.Map(); err == nil {
			co := po.Copy
			co.Progress = p.Add
			co.CRC32C = f.origin != nil
			st, err = m.LoadFiles([]gpushm.FileRange{{File: f.f, Len: f.size}}, &co)
		}
	}
	p.Done(err)
	if err != nil {
		return st, copier, err
	}
	return st, copier, commit(ctx, seg, f, o.Meta, po.Log, st.CRC32C)
}

// commit commits seg, with meta gaining f's origin and checksum when it
// has an origin: unless f changed during the copy, which fails the put. A
// daemon that cannot take the meta (it predates commits that carry one),
// or did not hash what it filled, gets a plain commit, and log a notice.
//
// ctx done before the commit is sent fails the put; after, it is too
// late, and the commit is seen through, so that what put says is what
// happened.
func commit(ctx context.Context, seg *gpushm.Segment, f *File, meta json.RawMessage, log *log.Logger, crcs []uint32) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	ctx = context.WithoutCancel(ctx)
	if f.origin == nil {
		return seg.Commit(ctx)
	}
	if err := f.origin.Files[0].Unchanged(f.f); err != nil {
		return err
	}
	if len(crcs) != 1 {
		notice(log, "the daemon did not checksum the file it copied (it predates that): the bundle records no origin, so loaders read the file itself")
		return seg.Commit(ctx)
	}
	o := *f.origin
	o.Files = []layout.Identity{f.origin.Files[0].Sealed(crcs[0])}
	meta, err := layout.WithOrigin(meta, &o)
	if err != nil {
		return err
	}
	err = seg.CommitMeta(ctx, meta)
	if errors.Is(err, syscall.EPROTO) {
		notice(log, "the daemon cannot record where the file came from (it predates commits with meta): the bundle records no origin, so loaders read the file itself")
		return seg.Commit(ctx)
	}
	return err
}

func notice(log *log.Logger, msg string) {
	if log != nil {
		log.Print(msg)
	}
}

// putEmpty makes name an empty segment. Replacing name (NextVersion), it
// takes the owner, and unless Mode the mode, of what it replaces, as a
// next version does.
func putEmpty(ctx context.Context, c *gpushm.Client, name string, f *File, po *PutFileOptions) error {
	if po.ReadOnlyDefault {
		return fmt.Errorf("checkpoint: read-only by default is for tensor bundles, and %s is empty", f.path)
	}
	o := &gpushm.CreateOptions{Device: po.Device, Mode: po.Mode, Meta: po.Meta, Pin: po.Pin, TTL: po.TTL, Persist: po.Persist, Offer: po.Offer}
	target := name
	var cur *gpushm.SegmentInfo
	if po.NextVersion {
		var err error
		cur, err = c.Stat(ctx, name)
		switch {
		case errors.Is(err, syscall.ENOENT):
			cur = nil // nothing to replace
		case err != nil:
			return err
		default:
			target = besideName(name)
			if o.Mode == nil {
				o.Mode = &cur.Mode
			}
		}
	}
	made, _, err := c.CreateOnly(ctx, target, 0, o)
	if errors.Is(err, syscall.EPROTO) {
		return fmt.Errorf("%s is empty, and the daemon predates empty segments (upgrade it): %w", f.path, err)
	}
	if err != nil || cur == nil {
		return err
	}
	// Seen through once begun, as a commit is: an interrupt leaves no
	// stray name behind.
	ctx = context.WithoutCancel(ctx)
	if made.UID != cur.UID || made.GID != cur.GID {
		err = c.Chown(ctx, target, int64(cur.UID), int64(cur.GID))
	}
	if err == nil {
		err = c.Rename(ctx, target, name)
	}
	if err != nil {
		c.Unlink(ctx, target)
	}
	return err
}

// maxName is the longest name the protocol takes, in bytes, as for a file
// name (docs/protocol.md, "Error codes": ENAMETOOLONG).
const maxName = 255

// besideName is a name for a segment made to be renamed over name, hidden
// from globs that do not match a leading dot, and saying what it is, as
// GetFile's temporary files do.
func besideName(name string) string {
	suffix := fmt.Sprintf(".gpushm-put-%08x", rand.Uint32())
	keep := name[:min(len(name), maxName-1-len(suffix))]
	for !utf8.ValidString(keep) {
		keep = keep[:len(keep)-1] // cut inside a character
	}
	return "." + keep + suffix
}
