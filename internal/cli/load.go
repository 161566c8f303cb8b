package cli

import (
	"context"

	"github.com/spf13/cobra"

	"github.com/gpushm/gpushm"
)

func loadCmd() *cobra.Command {
	return tierCmd("load NAME...", "Bring evicted segments back to their GPU ahead of an open (prefetch)",
		tiersHelp+`

'gpushm load' brings a segment back now, so that the next open need not
wait for the copy; a segment on its device already stays. Read access is
enough.`,
		`  gpushm load weights          # before the workers start
  gpushm load $(gpushm ls -o name 'llama-*')`,
		func(ctx context.Context, c *gpushm.Client, name string) (*gpushm.SegmentInfo, error) {
			return c.Load(ctx, name)
		})
}
