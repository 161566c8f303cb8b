package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"strconv"
	"sync"
	"time"

	"github.com/spf13/cobra"

	"github.com/gpushm/gpushm"
)

func putCmd() *cobra.Command {
	var (
		device string
		mode   string
	)
	cmd := &cobra.Command{
		Use:   "put NAME FILE",
		Short: "Copy a file into a new segment of the file's size ('-' reads stdin)",
		Long: `Copy FILE into a new segment NAME of exactly the file's size. With FILE '-',
standard input is spooled to a temporary file first, to learn its size. On
cuda the bytes pass through pinned host buffers in 64 MiB chunks. If the copy
fails, the segment is removed again.`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			name, path := args[0], args[1]
			f, size, cleanup, err := openSource(path)
			if err != nil {
				return err
			}
			defer cleanup()
			if size == 0 {
				return fmt.Errorf("put %s: %s is empty, and a segment has at least one byte", name, path)
			}
			o := &gpushm.CreateOptions{}
			if o.Meta, _, err = safetensorsMeta(f, size); err != nil {
				return fmt.Errorf("put %s: %w", name, err)
			}
			if mode != "" {
				m, err := strconv.ParseUint(mode, 8, 32)
				if err != nil {
					return fmt.Errorf("--mode %q: want octal permission bits such as 0640", mode)
				}
				m32 := uint32(m)
				o.Mode = &m32
			}
			ctx := cmd.Context()
			c, err := dial(ctx)
			if err != nil {
				return err
			}
			defer c.Close()
			if o.Device, err = resolveDevice(cmd.Context(), c, device); err != nil {
				return err
			}
			start := time.Now()
			n, err := put(ctx, c, name, f, size, o)
			if err != nil {
				return err
			}
			report("put", name, n, time.Since(start))
			return nil
		},
	}
	cmd.Flags().StringVar(&device, "device", "", "GPU ordinal or UUID (default: the daemon's first device)")
	cmd.Flags().StringVar(&mode, "mode", "", "permission bits in octal (default 0600)")
	return cmd
}

// put creates name and fills it from f, a regular file, with parallel
// reads; on any failure the segment goes.
func put(ctx context.Context, c *gpushm.Client, name string, f *os.File, size int64, o *gpushm.CreateOptions) (n int64, err error) {
	seg, err := c.Create(ctx, name, size, o)
	if err != nil {
		return 0, err
	}
	defer func() {
		cerr := seg.Close()
		if err == nil {
			err = cerr
		}
		if err != nil {
			c.Unlink(context.Background(), name)
		}
	}()
	m, err := seg.Map()
	if err != nil {
		return 0, err
	}
	if err := m.ReadFromAt(progressAt(f, "put "+name, size), size); err != nil {
		return 0, fmt.Errorf("put %s: %w", name, err)
	}
	return size, nil
}

// openSource opens path, or spools stdin for "-", and tells its size.
func openSource(path string) (*os.File, int64, func(), error) {
	if path != "-" {
		f, err := os.Open(path)
		if err != nil {
			return nil, 0, nil, err
		}
		st, err := f.Stat()
		if err != nil {
			f.Close()
			return nil, 0, nil, err
		}
		if !st.Mode().IsRegular() {
			f.Close()
			return nil, 0, nil, fmt.Errorf("%s is not a regular file (use '-' with a pipe)", path)
		}
		return f, st.Size(), func() { f.Close() }, nil
	}
	tmp, err := os.CreateTemp("", "gpushm-put-*")
	if err != nil {
		return nil, 0, nil, fmt.Errorf("spool stdin: %w", err)
	}
	os.Remove(tmp.Name())
	size, err := io.Copy(tmp, os.Stdin)
	if err == nil {
		_, err = tmp.Seek(0, io.SeekStart)
	}
	if err != nil {
		tmp.Close()
		return nil, 0, nil, fmt.Errorf("spool stdin: %w", err)
	}
	return tmp, size, func() { tmp.Close() }, nil
}

func report(verb, name string, n int64, d time.Duration) {
	if !isTerminal(os.Stderr) {
		return
	}
	fmt.Fprintf(os.Stderr, "%s %s: %s in %.2fs (%.2f GB/s)\n", verb, name, formatSize(n), d.Seconds(), float64(n)/d.Seconds()/1e9)
}

// progressAt is progress for a file read at offsets, in parallel.
func progressAt(r io.ReaderAt, what string, total int64) io.ReaderAt {
	if total < 256<<20 || !isTerminal(os.Stderr) {
		return r
	}
	return &progressReaderAt{r, &meter{what: what, total: total, start: time.Now()}}
}

// progressWriterAt is progress for a file written at offsets, in parallel.
func progressWriterAt(w io.WriterAt, what string, total int64) io.WriterAt {
	if total < 256<<20 || !isTerminal(os.Stderr) {
		return w
	}
	return &progressAtWriter{w, &meter{what: what, total: total, start: time.Now()}}
}

type progressReaderAt struct {
	r io.ReaderAt
	m *meter
}

func (p *progressReaderAt) ReadAt(b []byte, off int64) (int, error) {
	n, err := p.r.ReadAt(b, off)
	p.m.add(n)
	return n, err
}

type progressAtWriter struct {
	w io.WriterAt
	m *meter
}

func (p *progressAtWriter) WriteAt(b []byte, off int64) (int, error) {
	n, err := p.w.WriteAt(b, off)
	p.m.add(n)
	return n, err
}

// progressTo is progress for a writer.
func progressTo(w io.Writer, what string, total int64) io.Writer {
	if total < 256<<20 || !isTerminal(os.Stderr) {
		return w
	}
	return &progressWriter{w, &meter{what: what, total: total, start: time.Now()}}
}

type meter struct {
	mu          sync.Mutex // parallel copies report at once
	what        string
	total, done int64
	start, last time.Time
}

func (m *meter) add(n int) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.done += int64(n)
	now := time.Now()
	if now.Sub(m.last) < 200*time.Millisecond && m.done < m.total {
		return
	}
	m.last = now
	fmt.Fprintf(os.Stderr, "\r%s: %s / %s (%.0f%%) %.2f GB/s  ", m.what, formatSize(m.done), formatSize(m.total),
		100*float64(m.done)/float64(m.total), float64(m.done)/now.Sub(m.start).Seconds()/1e9)
	if m.done >= m.total {
		fmt.Fprintln(os.Stderr)
	}
}

type progressWriter struct {
	w io.Writer
	m *meter
}

func (p *progressWriter) Write(b []byte) (int, error) {
	n, err := p.w.Write(b)
	p.m.add(n)
	return n, err
}
