package main

import (
	"fmt"
	"os"
	"text/tabwriter"

	"github.com/spf13/cobra"
)

func infoCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "info",
		Short: "Show the daemon's backend and devices",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := dial(cmd.Context())
			if err != nil {
				return err
			}
			defer c.Close()
			inf, err := c.Info(cmd.Context())
			if err != nil {
				return err
			}
			fmt.Printf("daemon:   gpushm %s at %s\nbackend:  %s\n", inf.Server, c.Socket(), inf.Backend)
			fmt.Printf("segments: %d named, %d holding memory, %s allocated, %d opens\n\n",
				inf.Usage.Named, inf.Usage.Segments, formatSize(inf.Usage.Bytes), inf.Usage.Opens)
			w := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(w, "DEVICE\tNAME\tUUID\tTOTAL\tFREE\tGRANULARITY")
			for _, d := range inf.Devices {
				uuid := d.UUID
				if uuid == "" {
					uuid = "-"
				}
				fmt.Fprintf(w, "%d\t%s\t%s\t%s\t%s\t%s\n", d.Index, d.Name, uuid,
					formatSize(int64(d.TotalBytes)), formatSize(int64(d.FreeBytes)), formatSize(d.Granularity))
			}
			if err := w.Flush(); err != nil {
				return err
			}
			return printGPUs(os.Stdout, inf.GPU)
		},
	}
}
