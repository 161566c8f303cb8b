package main

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/spf13/cobra"

	"github.com/gpushm/gpushm"
)

func getCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "get NAME FILE",
		Short: "Copy a segment into a file ('-' writes stdout)",
		Long: `Copy segment NAME (its size, not the rounded allocation) into FILE, which is
created or truncated. The segment is opened read-only. On cuda the bytes pass
through pinned host buffers in 64 MiB chunks.`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			name, path := args[0], args[1]
			ctx := cmd.Context()
			c, err := dial(ctx)
			if err != nil {
				return err
			}
			defer c.Close()
			seg, err := c.Open(ctx, name, &gpushm.OpenOptions{ReadOnly: true})
			if err != nil {
				return err
			}
			defer seg.Close()
			m, err := seg.Map()
			if err != nil {
				return err
			}
			start := time.Now()
			if path == "-" {
				w := bufio.NewWriterSize(os.Stdout, 1<<20)
				_, err = m.WriteTo(progressTo(w, "get "+name, m.Size()))
				if err == nil {
					err = w.Flush()
				}
			} else {
				err = getFile(m, path, func(w io.WriterAt, total int64) io.WriterAt {
					return progressWriterAt(w, "get "+name, total)
				})
			}
			if err != nil {
				return fmt.Errorf("get %s: %w", name, err)
			}
			n := m.Size()
			report("get", name, n, time.Since(start))
			return nil
		},
	}
}

// getFile writes m to a new or truncated regular file with parallel
// writes; a failed copy leaves no partial file behind.
func getFile(m *gpushm.Mapping, path string, wrap func(io.WriterAt, int64) io.WriterAt) (err error) {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	defer func() {
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			os.Remove(path)
		}
	}()
	return m.WriteToAt(wrap(f, m.Size()), m.Size())
}
