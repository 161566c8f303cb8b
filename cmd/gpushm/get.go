package main

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

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/checkpoint"
	"github.com/gpushm/gpushm/internal/layout"
)

func getCmd() *cobra.Command {
	var (
		raw      bool
		copyOpts copyFlags
		verbose  bool
		wait     time.Duration
	)
	cmd := &cobra.Command{
		Use:   "get NAME FILE|DIR",
		Short: "Copy a segment into a file, or a checkpoint bundle back into its directory ('-' writes stdout)",
		Long: `Copy segment NAME (its size, not the rounded allocation) into FILE. The
segment is opened read-only. The daemon copies, with its warm copy engine,
unless --copier client (or a tuning flag) has this process copy, with
several copiers in parallel, each through a pinned buffer and its own CUDA
stream. A bar shows the bytes copied, the rate and the time left on a
terminal.

FILE is written under a temporary name beside it and renamed over FILE only
once complete, so that a get that fails or is interrupted (Ctrl-C: exit
130) leaves FILE as it was, or no FILE. A FILE that exists keeps its
permission bits; FIFOs and devices (/dev/null) are written in place.

A bundle made by 'gpushm put NAME DIR' is written back as that directory:
its shard files byte for byte, and its small files. DIR must not exist or
must be empty; if anything fails, or get is interrupted, what was written
is removed. --raw writes the segment's bytes to one file instead, as '-'
does.

A segment still being written ('gpushm put' in progress, listed as
incomplete) is refused; --wait waits that long for it to be complete, or
for the name to appear.

It prints nothing on standard output unless -o asks: -o json and -o yaml
print what was copied, -o name the segment's name.`,
		Example: `  gpushm get weights model.bin
  gpushm get llama ./llama-restored        # a bundle put from a directory
  gpushm get weights - | sha256sum
  gpushm get --wait 5m weights model.bin   # while 'gpushm put' still writes it`,
		Args:              cobra.ExactArgs(2),
		ValidArgsFunction: namesThenFiles(func(*cobra.Command) bool { return true }),
		RunE: func(cmd *cobra.Command, args []string) error {
			name, path := args[0], args[1]
			if wait < 0 {
				return usagef(cmd, "--wait %s: want a positive duration", wait)
			}
			co, err := copyOpts.options()
			if err != nil {
				return usagef(cmd, "%v", err)
			}
			inDaemon, err := copyOpts.inDaemon()
			if err != nil {
				return usagef(cmd, "%v", err)
			}
			ctx, stop := interruptible(cmd.Context())
			defer stop()
			res, err := get(ctx, name, path, getOptions{raw: raw, co: co, inDaemon: inDaemon, verbose: verbose, wait: wait})
			err = failed("get", name, err)
			if errors.Is(err, syscall.EAGAIN) {
				err = fmt.Errorf("%w ('gpushm get --wait 1m %s %s' waits for it)", err, name, path)
			}
			if err != nil {
				return err
			}
			return printCopy(res)
		},
	}
	cmd.Flags().BoolVar(&raw, "raw", false, "write a checkpoint bundle's bytes as one file, not as its directory")
	cmd.Flags().BoolVarP(&verbose, "verbose", "v", false, "print how the copy went")
	cmd.Flags().DurationVar(&wait, "wait", 0, "wait this long (e.g. 30s, 5m; at most 1h) for a segment being written, or not there yet")
	copyOpts.register(cmd)
	addOutput(cmd, false)
	return cmd
}

type getOptions struct {
	raw      bool
	co       *gpushm.CopyOptions
	inDaemon bool
	verbose  bool
	wait     time.Duration
}

func get(ctx context.Context, name, path string, o getOptions) (res copyResult, err error) {
	c, err := dial(ctx)
	if err != nil {
		return res, err
	}
	defer c.Close()
	start := time.Now()
	seg, err := openForRead(ctx, c, name, o.wait)
	if err != nil {
		return res, err
	}
	if seg == nil {
		// Empty: an empty file, as cp makes of one.
		if path, err = inDir(path, name); err != nil {
			return res, err
		}
		res = copyResult{Name: name, File: path, Copier: "client"}
		if path != "-" {
			_, err = intoFile(ctx, path, 0, func(*os.File) (gpushm.CopyStats, error) { return gpushm.CopyStats{}, nil })
		}
		res.finish(start)
		return res, err
	}
	defer seg.Close()
	info := seg.Info()
	res = copyResult{Name: name, File: path, Bytes: info.Size, Copier: "client"}
	if meta, ok, _ := layout.ParseMeta(info.Meta, info.Size); ok && meta.Source == "dir" && !o.raw && path != "-" {
		st, err := getDir(ctx, c, name, path, info.Size, o.co)
		if err != nil {
			return res, err
		}
		res.Bytes = st.Bytes
		res.finish(start)
		report("get", name, st.Bytes, time.Since(start), st, o.verbose)
		return res, nil
	}
	if path, err = inDir(path, name); err != nil {
		return res, err
	}
	res.File = path
	stream := path == "-" || !daemonWrites(path)
	bar := newProgress("get "+name, info.Size)
	var st gpushm.CopyStats
	if !stream && o.inDaemon {
		st, err = intoFile(ctx, path, info.Size, func(f *os.File) (gpushm.CopyStats, error) {
			return dumpSteps(ctx, seg, f, info.Size, bar)
		})
		if err == nil {
			bar.finish(nil)
			res.Copier = "daemon"
			res.finish(start)
			report("get", name, info.Size, time.Since(start), st, o.verbose)
			return res, nil
		}
		if !errors.Is(err, syscall.ENOSYS) {
			bar.finish(err)
			return res, err
		}
		// A daemon from before dump: copy here.
	}
	m, err := seg.Map()
	if err != nil {
		bar.finish(err)
		return res, err
	}
	if stream {
		err = streamTo(path, func(out *os.File) error {
			w := bufio.NewWriterSize(ctxWriter{ctx, out}, 1<<20)
			_, err := m.WriteTo(bar.writer(w))
			if err == nil {
				err = w.Flush()
			}
			return err
		})
	} else {
		o.co.Progress = bar.fn()
		st, err = getFile(ctx, m, path, o.co)
	}
	bar.finish(err)
	if err != nil {
		return res, err
	}
	res.finish(start)
	report("get", name, m.Size(), time.Since(start), st, o.verbose)
	return res, nil
}

// inDir is where get writes segment name given path: path/name when path
// is a directory (or says it must be one, ending in '/'), as cp writes a
// file into a directory; else path itself. A checkpoint bundle, which is
// a directory, is written as path instead (getDir).
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
// it removes what it wrote as a failure does: checkpoint.Get copies in
// this process, which a context does not stop, so the copy runs to its
// end first, unless a second signal ends the process at once.
func getDir(ctx context.Context, c *gpushm.Client, name, dir string, size int64, co *gpushm.CopyOptions) (gpushm.CopyStats, error) {
	_, err := os.Lstat(dir)
	existed := err == nil
	undo := func() { removeWritten(dir, existed) }
	defer atForcedExit(undo)()
	bar := newProgress("get "+name, size)
	co.Progress = bar.fn()
	st, err := checkpoint.Get(ctx, c, name, dir, co)
	if err == nil && ctx.Err() != nil {
		undo()
		err = ctx.Err()
	}
	bar.finish(err)
	return st, err
}

// removeWritten removes what a get wrote into dir: dir itself if it did
// not exist before, else everything in it, which was empty before (get
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

func (w ctxWriter) Write(b []byte) (int, error) {
	if err := w.ctx.Err(); err != nil {
		return 0, err
	}
	return w.w.Write(b)
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

// getFile writes m into path with this process's parallel writes
// (intoFile).
func getFile(ctx context.Context, m *gpushm.Mapping, path string, co *gpushm.CopyOptions) (gpushm.CopyStats, error) {
	return intoFile(ctx, path, m.Size(), func(f *os.File) (gpushm.CopyStats, error) {
		return m.StoreFiles([]gpushm.FileRange{{File: f, Len: m.Size()}}, co)
	})
}

// intoFile has write put n bytes into path. A regular file (or none yet)
// is written as a new file beside it, sized first so that parallel writes
// never extend it, and renamed over path once complete and not
// interrupted: a get that fails, is interrupted or is killed leaves path
// as it was (a killed one leaves the temporary file, whose name says what
// it is). Through a symbolic link, the file it names is replaced. A device
// such as /dev/null is written in place.
func intoFile(ctx context.Context, path string, n int64, write func(*os.File) (gpushm.CopyStats, error)) (st gpushm.CopyStats, err error) {
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
	defer atForcedExit(func() { os.Remove(f.Name()) })()
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
