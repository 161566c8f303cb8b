package checkpoint

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/layout"
	"github.com/gpushm/gpushm/internal/xfer"
)

// OpenRead opens name read-only, waiting up to wait for it to be
// committed. A nil segment and no error is an empty segment, which holds
// no memory to open (docs/protocol.md, "create": empty), and reads as
// nothing, as an empty file does.
func OpenRead(ctx context.Context, c *gpushm.Client, name string, wait time.Duration) (*gpushm.Segment, error) {
	seg, err := c.Open(ctx, name, &gpushm.OpenOptions{ReadOnly: true, Wait: wait})
	if err == nil || !errors.Is(err, syscall.EINVAL) {
		return seg, err
	}
	// The open path stays one round trip: only a refused open asks
	// whether the segment is empty.
	if s, serr := c.Stat(ctx, name); serr == nil && s.Size == 0 && !s.Uncommitted && s.Orphan == "" {
		return nil, nil
	}
	return nil, err
}

// GetFileOptions are the optional parts of GetFile.
type GetFileOptions struct {
	// Raw writes a checkpoint directory's bundle as one file of the
	// segment's bytes, not as its directory.
	Raw bool
	// Copy tunes this process's copy; GetFile does not use its Progress
	// (Progress is its).
	Copy gpushm.CopyOptions
	// InDaemon has the daemon write a file it can write with offsets
	// (gpushm.Segment.Dump), in steps after which ctx stops the copy;
	// this process writes the others, and all of them when the daemon is
	// from before dump.
	InDaemon bool
	// Wait is how long to wait for a segment still being written, or not
	// there yet.
	Wait time.Duration
	// Progress, if set, is called as the copy starts, with the bytes to
	// copy, and what it returns follows the copy.
	Progress func(total int64) Progress
	// AtExit, if set, is given what undoes the get while it is under way
	// (the removal of a temporary file, or of what it wrote into a
	// directory), and returns the function that takes it back: for a
	// process that may exit before GetFile returns, at a second Ctrl-C.
	AtExit func(undo func()) (cancel func())
}

// GetFile writes segment name (its size, not the rounded allocation) into
// path, or into path/name where path is a directory (or ends in '/'), as
// cp writes a file into a directory; "-" is standard output. The segment
// is opened read-only (OpenRead).
//
// A regular file is written under a temporary name beside it and renamed
// over path only once complete, so that a get that fails, is interrupted
// (ctx) or is killed leaves path as it was, or no file (a killed one
// leaves the temporary file, whose name says what it is); a file it
// replaces keeps its permission bits, and through a symbolic link, the
// file it names is replaced. Devices and FIFOs are written in place:
// /dev/null, /dev/zero and /dev/full with offsets, as a regular file is,
// the others in order.
//
// A bundle put from a directory is written back as that directory (Get),
// unless Raw; if anything fails, or ctx is done, what was written is
// removed.
func GetFile(ctx context.Context, c *gpushm.Client, name, path string, o *GetFileOptions) (res Copied, err error) {
	if o == nil {
		o = &GetFileOptions{}
	}
	seg, err := OpenRead(ctx, c, name, o.Wait)
	if err != nil {
		return res, err
	}
	if seg == nil {
		// Empty: an empty file, as cp makes of one.
		if path, err = inDir(path, name); err != nil {
			return res, err
		}
		res = Copied{File: path, Copier: "client"}
		if path != "-" {
			_, err = intoFile(ctx, path, 0, o.AtExit, func(*os.File) (gpushm.CopyStats, error) { return gpushm.CopyStats{}, nil })
		}
		return res, err
	}
	defer seg.Close()
	info := seg.Info()
	res = Copied{File: path, Bytes: info.Size, Copier: "client"}
	if meta, ok, _ := layout.ParseMeta(info.Meta, info.Size); ok && meta.Source == "dir" && !o.Raw && path != "-" {
		res.Stats, err = getDir(ctx, c, name, path, info.Size, o)
		res.Bytes = res.Stats.Bytes
		return res, err
	}
	if res.File, err = inDir(path, name); err != nil {
		return res, err
	}
	path = res.File
	stream := path == "-" || !daemonWrites(path)
	p := follow(o.Progress, info.Size)
	if !stream && o.InDaemon {
		res.Stats, err = intoFile(ctx, path, info.Size, o.AtExit, func(f *os.File) (gpushm.CopyStats, error) {
			return xfer.Steps(info.Size, p.Add, func(off, k int64) (gpushm.CopyStats, error) {
				return seg.Dump(ctx, f, off, off, k)
			})
		})
		if !errors.Is(err, syscall.ENOSYS) {
			if err == nil {
				res.Copier = "daemon"
			}
			p.Done(err)
			return res, err
		}
		// A daemon from before dump: copy here.
	}
	m, err := seg.Map()
	if err != nil {
		p.Done(err)
		return res, err
	}
	if stream {
		err = streamTo(path, func(out *os.File) error {
			w := bufio.NewWriterSize(ctxWriter{ctx, out}, 1<<20)
			_, err := m.WriteTo(counter{w, p})
			if err == nil {
				err = w.Flush()
			}
			return err
		})
	} else {
		co := o.Copy
		co.Progress = p.Add
		res.Stats, err = intoFile(ctx, path, m.Size(), o.AtExit, func(f *os.File) (gpushm.CopyStats, error) {
			return m.StoreFiles([]gpushm.FileRange{{File: f, Len: m.Size()}}, &co)
		})
	}
	p.Done(err)
	return res, err
}

// inDir is where GetFile writes segment name given path: path/name when
// path is a directory (or says it must be one, ending in '/'), as cp
// writes a file into a directory; else path itself. A checkpoint bundle,
// which is a directory, is written as path instead (getDir).
func inDir(path, name string) (string, error) {
	if path == "-" {
		return path, nil
	}
	st, err := os.Stat(path)
	switch {
	case err == nil && st.IsDir():
		return filepath.Join(path, name), nil
	case strings.HasSuffix(path, "/"):
		// Not there, or not a directory (stat of "file/" fails so).
		var pe *fs.PathError
		if errors.As(err, &pe) {
			err = pe.Err
		}
		return "", &fs.PathError{Op: "open directory", Path: path, Err: err}
	}
	return path, nil
}

// getDir writes a checkpoint bundle back as its directory. Interrupted,
// it removes what it wrote as a failure does: Get copies in this process,
// which a context does not stop, so the copy runs to its end first,
// unless the process exits at once (AtExit).
func getDir(ctx context.Context, c *gpushm.Client, name, dir string, size int64, o *GetFileOptions) (gpushm.CopyStats, error) {
	_, err := os.Lstat(dir)
	existed := err == nil
	undo := func() { removeWritten(dir, existed) }
	defer atExit(o.AtExit, undo)()
	p := follow(o.Progress, size)
	co := o.Copy
	co.Progress = p.Add
	st, err := Get(ctx, c, name, dir, &co)
	if err == nil && ctx.Err() != nil {
		undo()
		err = ctx.Err()
	}
	p.Done(err)
	return st, err
}

// atExit registers undo with register, if any, and returns what takes it
// back.
func atExit(register func(undo func()) (cancel func()), undo func()) (cancel func()) {
	if register == nil {
		return func() {}
	}
	return register(undo)
}

// removeWritten removes what a get wrote into dir: dir itself if it did
// not exist before, else everything in it, which was empty before (Get
// refuses any other).
func removeWritten(dir string, existed bool) {
	if !existed {
		os.RemoveAll(dir)
		return
	}
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		os.RemoveAll(filepath.Join(dir, e.Name()))
	}
}

// ctxWriter fails its writes once ctx is done: a stream written in this
// process stops at an interrupt.
type ctxWriter struct {
	ctx context.Context
	w   io.Writer
}

// ctxPiece is what ctxWriter writes at a time: a write blocks until the
// reader takes it all, so a piece bounds how long a write into a slow pipe
// (get NAME - | slow) goes on after Ctrl-C or SIGTERM.
const ctxPiece = 256 << 10

func (w ctxWriter) Write(b []byte) (int, error) {
	n := 0
	for len(b) > 0 {
		if err := w.ctx.Err(); err != nil {
			return n, err
		}
		k, err := w.w.Write(b[:min(len(b), ctxPiece)])
		n += k
		if err != nil {
			return n, err
		}
		b = b[k:]
	}
	return n, nil
}

// counter tells p of what passes through w.
type counter struct {
	w io.Writer
	p Progress
}

func (c counter) Write(b []byte) (int, error) {
	n, err := c.w.Write(b)
	c.p.Add(int64(n))
	return n, err
}

// streamTo has write write to standard output ("-") or to path, a FIFO or
// a device, in order.
func streamTo(path string, write func(*os.File) error) error {
	if path == "-" {
		return write(os.Stdout)
	}
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	err = write(f)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

// daemonWrites says whether path is a file to write with offsets, by the
// daemon (docs/protocol.md, "fill and dump") or this process's parallel
// writes: a regular file (or none yet), /dev/null, /dev/zero or
// /dev/full. Other devices and FIFOs are written in order, by this process.
func daemonWrites(path string) bool {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return true
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFREG:
		return true
	case unix.S_IFCHR:
		min := unix.Minor(st.Rdev)
		return unix.Major(st.Rdev) == 1 && (min == 3 || min == 5 || min == 7)
	}
	return false
}

// intoFile has write put n bytes into path. A regular file (or none yet)
// is written as a new file beside it, sized first so that parallel writes
// never extend it, and renamed over path once complete and ctx not done;
// register (AtExit) is given its removal meanwhile. A device such as
// /dev/null is written in place.
func intoFile(ctx context.Context, path string, n int64, register func(func()) func(), write func(*os.File) (gpushm.CopyStats, error)) (st gpushm.CopyStats, err error) {
	target := path
	if t, err := filepath.EvalSymlinks(path); err == nil {
		target = t
	}
	old, err := os.Stat(target)
	switch {
	case err == nil && !old.Mode().IsRegular():
		f, err := os.OpenFile(target, os.O_WRONLY, 0)
		if err != nil {
			return st, err
		}
		st, err = write(f)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		return st, err
	case err != nil && !errors.Is(err, fs.ErrNotExist):
		return st, err
	}
	f, err := createBeside(target)
	if err != nil {
		var pe *fs.PathError
		if errors.As(err, &pe) {
			err = &fs.PathError{Op: "create", Path: path, Err: pe.Err}
		}
		return st, err
	}
	defer atExit(register, func() { os.Remove(f.Name()) })()
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(f.Name())
		}
	}()
	if old != nil {
		// Replaced, the file keeps its permission bits, as cp's does.
		if err := f.Chmod(old.Mode().Perm()); err != nil {
			return st, err
		}
	}
	if err := f.Truncate(n); err != nil {
		return st, err
	}
	if st, err = write(f); err != nil {
		return st, err
	}
	if err := f.Close(); err != nil {
		return st, err
	}
	if err := ctx.Err(); err != nil {
		return st, err
	}
	return st, os.Rename(f.Name(), target)
}

// createBeside creates a new file in path's directory, named after path
// and hidden, with the permission bits a new file gets (0666 less the
// umask).
func createBeside(path string) (*os.File, error) {
	dir, base := filepath.Split(path)
	for {
		name := filepath.Join(dir, fmt.Sprintf(".%s.gpushm-get-%08x", base, rand.Uint32()))
		f, err := os.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o666)
		if !errors.Is(err, fs.ErrExist) {
			return f, err
		}
	}
}
