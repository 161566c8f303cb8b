package cli

import (
	"context"
	"io"

	"github.com/spf13/cobra"

	"github.com/gpushm/gpushm/internal/exitcode"
	"github.com/gpushm/gpushm/internal/report"
)

func dfCmd() *cobra.Command {
	var sizes bool
	cmd := &cobra.Command{
		Use:   "df",
		Short: "Show memory in use, and left, on each device and tier, and for each user",
		Long: `Show, as df(1) does for file systems, how much memory each device and tier
holds and how much is left, and what each user holds against its quota.

The first table has a line for each device's own memory (TIER "gpu"; on a
daemon serving host memory, "host memory") and, when segments can be
evicted, one for host memory holding them (TIER "host"; "evicted" on a
daemon serving host memory). SIZE is what bounds USED, as LIMIT says:
"budget" ('gpushm daemon --gpu-budget': a create past it evicts
segments that nobody has open), "max-memory" (--max-memory: a create past
it is refused), "memory" (the device's, when neither is set), or "host
budget" (--host-budget). USED is the bytes of the segments there now,
creates and restores under way included; AVAIL what a create may take
without evicting anything: SIZE less USED, and no more than the device
has free; USE% is USED of SIZE, rounded up as df(1) rounds it; PEAK the
most the device held since the daemon started.

The second table has a line for each user and device where the user holds
something (and for you, whether or not you do): USED counts segments
wherever their bytes are, on the device or evicted, and those unlinked
but still open; QUOTA is the user's ('gpushm daemon --user-quota'), "-"
where none applies (root has none); SEGMENTS is how many the user holds
there ("N of M" against --user-segments; a line for "all" devices carries
the limits that count every device).

-o wide adds each device's name, UUID, free memory and segments, and the
daemon's own segment limit; -o json and -o yaml print the same figures in
bytes (docs/cli.md, "Output").`,
		Example: `  gpushm df
  gpushm df -o wide
  gpushm df -o json | jq '.users[] | select(.user == "alice")'`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			return exitcode.Failed("df", "", df(cmd.Context(), Stdout, sizes))
		},
	}
	cmd.Flags().BoolVar(&sizes, "bytes", false, "print sizes in bytes")
	// No names to print: df is about memory, not segments.
	addOutput(cmd, false, "json", "yaml", "wide")
	return cmd
}

func df(ctx context.Context, out io.Writer, sizes bool) error {
	c, err := dial(ctx)
	if err != nil {
		return err
	}
	defer c.Close()
	inf, err := c.Info(ctx)
	if err != nil {
		return err
	}
	r := report.DFOf(inf)
	if structured() {
		return report.WriteValue(out, output, r)
	}
	return r.Write(out, c.Backend(), sizes, output == "wide")
}
