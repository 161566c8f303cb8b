package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/checkpoint"
	layout "github.com/gpushm/gpushm/internal/checkpoint"
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
		Long: `Copy segment NAME (its size, not the rounded allocation) into FILE, which is
created or truncated. The segment is opened read-only. Several copiers work
in parallel, each through a pinned buffer and its own CUDA stream.

A bundle made by 'gpushm put NAME DIR' is written back as that directory:
its shard files byte for byte, and its small files. DIR must not exist or
must be empty; if anything fails, what was written is removed. --raw writes
the segment's bytes to one file instead, as '-' does.

A segment still being written ('gpushm put' in progress, listed as
incomplete) is refused; --wait waits that long for it to be complete, or
for the name to appear.`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			name, path := args[0], args[1]
			co, err := copyOpts.options()
			if err != nil {
				return err
			}
			ctx := cmd.Context()
			c, err := dial(ctx)
			if err != nil {
				return err
			}
			defer c.Close()
			start := time.Now()
			if wait < 0 {
				return fmt.Errorf("--wait %s: want a positive duration", wait)
			}
			seg, err := c.Open(ctx, name, &gpushm.OpenOptions{ReadOnly: true, Wait: wait})
			if errors.Is(err, syscall.EAGAIN) {
				return fmt.Errorf("%w ('gpushm get --wait 1m %s %s' waits for it)", err, name, path)
			}
			if err != nil {
				return err
			}
			defer seg.Close()
			info := seg.Info()
			if meta, ok, _ := layout.ParseMeta(info.Meta, info.Size); ok && meta.Source == "dir" && !raw && path != "-" {
				bar := newProgress("get "+name, info.Size)
				co.Progress = bar.fn()
				st, err := checkpoint.Get(ctx, c, name, path, co)
				bar.finish(err)
				if err != nil {
					return err
				}
				report("get", name, st.Bytes, time.Since(start), st, verbose)
				return nil
			}
			inDaemon, err := copyOpts.inDaemon()
			if err != nil {
				return err
			}
			stream := path == "-" || !daemonWrites(path)
			if !stream && inDaemon {
				st, err := dumpFile(ctx, seg, path)
				if err == nil {
					report("get", name, info.Size, time.Since(start), st, verbose)
					return nil
				}
				if !errors.Is(err, syscall.ENOSYS) {
					return fmt.Errorf("get %s: %w", name, err)
				}
				// A daemon from before dump: copy here.
			}
			m, err := seg.Map()
			if err != nil {
				return err
			}
			bar := newProgress("get "+name, m.Size())
			var st gpushm.CopyStats
			if stream {
				err = streamTo(path, func(out *os.File) error {
					w := bufio.NewWriterSize(out, 1<<20)
					_, err := m.WriteTo(bar.writer(w))
					if err == nil {
						err = w.Flush()
					}
					return err
				})
			} else {
				co.Progress = bar.fn()
				st, err = getFile(m, path, co)
			}
			bar.finish(err)
			if err != nil {
				return fmt.Errorf("get %s: %w", name, err)
			}
			report("get", name, m.Size(), time.Since(start), st, verbose)
			return nil
		},
	}
	cmd.Flags().BoolVar(&raw, "raw", false, "write a checkpoint bundle's bytes as one file, not as its directory")
	cmd.Flags().BoolVarP(&verbose, "verbose", "v", false, "print how the copy went")
	cmd.Flags().DurationVar(&wait, "wait", 0, "wait this long (e.g. 30s, 5m; at most 1h) for a segment being written, or not there yet")
	copyOpts.register(cmd)
	return cmd
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

// dumpFile has the daemon write seg into path (intoFile).
func dumpFile(ctx context.Context, seg *gpushm.Segment, path string) (gpushm.CopyStats, error) {
	return intoFile(path, seg.Size(), func(f *os.File) (gpushm.CopyStats, error) {
		return seg.Dump(ctx, f, 0, 0, seg.Size())
	})
}

// getFile writes m into path with this process's parallel writes
// (intoFile).
func getFile(m *gpushm.Mapping, path string, co *gpushm.CopyOptions) (gpushm.CopyStats, error) {
	return intoFile(path, m.Size(), func(f *os.File) (gpushm.CopyStats, error) {
		return m.StoreFiles([]gpushm.FileRange{{File: f, Len: m.Size()}}, co)
	})
}

// intoFile opens path for write to put n bytes into: a new or truncated
// regular file, sized first so that parallel writes never extend it, or a
// device such as /dev/null. A regular file a failed copy leaves behind is
// removed; a device is never removed.
func intoFile(path string, n int64, write func(*os.File) (gpushm.CopyStats, error)) (st gpushm.CopyStats, err error) {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o666)
	if err != nil {
		return st, err
	}
	fi, serr := f.Stat()
	regular := serr == nil && fi.Mode().IsRegular()
	defer func() {
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil && regular {
			os.Remove(path)
		}
	}()
	if regular {
		if err := f.Truncate(n); err != nil {
			return st, err
		}
	}
	return write(f)
}
