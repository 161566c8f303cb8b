package main

import (
	"bufio"
	"fmt"
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
			f := os.Stdout
			if path != "-" {
				if f, err = os.Create(path); err != nil {
					return err
				}
				defer f.Close()
			}
			w := bufio.NewWriterSize(f, 1<<20)
			start := time.Now()
			n, err := m.WriteTo(progressTo(w, "get "+name, m.Size()))
			if err == nil {
				err = w.Flush()
			}
			if err == nil && path != "-" {
				err = f.Close()
			}
			if err != nil {
				return fmt.Errorf("get %s: %w", name, err)
			}
			report("get", name, n, time.Since(start))
			return nil
		},
	}
}
