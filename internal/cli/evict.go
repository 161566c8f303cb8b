package cli

import (
	"context"
	"fmt"
	"strings"

	"github.com/spf13/cobra"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/bytesize"
	"github.com/gpushm/gpushm/internal/complete"
	"github.com/gpushm/gpushm/internal/exitcode"
	"github.com/gpushm/gpushm/internal/report"
)

const tiersHelp = `A segment lives on its device (tier gpu) or, evicted, in host memory (tier
host). The daemon evicts by itself when a create or a restore would take a
device past its budget (gpushm daemon --gpu-budget), least recently opened
first, and only segments nobody has open, not pinned, not channels; an
open of an evicted segment brings it back before it returns
(docs/architecture.md, "Tiers").`

func evictCmd() *cobra.Command {
	var to string
	cmd := tierCmd("evict NAME...", "Move segments nobody has open to host memory (or to disk) now, freeing their GPU memory",
		tiersHelp+`

'gpushm evict' does it now: the segment's bytes are copied to host memory
and its device memory is freed. With --to disk they go to the daemon's
disk tier (gpushm daemon --disk) instead, from the GPU or from host
memory, and their memory is freed; an open reads them back into GPU
memory. A segment open somewhere, pinned or a channel is refused (EBUSY);
one in host memory already stays there. The owner or root may evict.`,
		`  gpushm evict old-model
  gpushm evict --to disk old-model
  gpushm evict $(gpushm ls -o name 'ckpt-*')`,
		func(ctx context.Context, c *gpushm.Client, name string) (*gpushm.SegmentInfo, error) {
			return c.EvictTo(ctx, name, to)
		})
	cmd.Flags().StringVar(&to, "to", "host", "where to: host (memory) or disk (the daemon's --disk directories)")
	return cmd
}

func syncCmd() *cobra.Command {
	return tierCmd("sync NAME...", "Write durable segments to disk now",
		`A durable segment (gpushm create --persist, put --persist) keeps a copy in
the daemon's disk tier (gpushm daemon --disk), which a daemon started after
a reboot lists again. Its bytes go there in the background after each
commit (a put, a next version); writes through a mapping reach the copy
only at the next 'gpushm sync', which returns once the copy is durable
(written aside, fsynced, renamed in). Writes made while it runs may or may
not be in it. See docs/disk.md.`,
		`  gpushm create --persist state 1GiB && ... && gpushm sync state`,
		func(ctx context.Context, c *gpushm.Client, name string) (*gpushm.SegmentInfo, error) {
			return c.Sync(ctx, name)
		})
}

// tierCmd runs op on every name and says where each segment is now.
func tierCmd(use, short, long, example string, op func(context.Context, *gpushm.Client, string) (*gpushm.SegmentInfo, error)) *cobra.Command {
	verb, _, _ := strings.Cut(use, " ")
	cmd := &cobra.Command{
		Use:               use,
		Short:             short,
		Long:              long,
		Example:           example,
		Args:              cobra.MinimumNArgs(1),
		ValidArgsFunction: complete.Names(dial),
		RunE: func(cmd *cobra.Command, args []string) error {
			var done []gpushm.SegmentInfo
			err := eachName(cmd.Context(), verb, args, func(c *gpushm.Client, name string) error {
				s, err := op(cmd.Context(), c, name)
				if err != nil {
					return err
				}
				switch output {
				case "json", "yaml":
					done = append(done, *s)
				case "name":
					printNames(s.Name)
				default:
					fmt.Fprintf(Stdout, "%s: %s, %s\n", s.Name, bytesize.Format(s.AllocSize), report.Tier(c.Backend(), s))
				}
				return nil
			})
			if structured() && !exitcode.IsNoDaemon(err) {
				if perr := printValue(report.Segments(done)); err == nil {
					err = perr
				}
			}
			return err
		},
	}
	addOutput(cmd, false)
	return cmd
}
