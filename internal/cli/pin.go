package cli

import (
	"context"

	"github.com/spf13/cobra"

	"github.com/gpushm/gpushm"
)

func pinCmd(on bool) *cobra.Command {
	use, short, long, example := "pin NAME...", "Keep segments on their GPU: never evict them",
		"\n\n'gpushm pin' keeps a segment on its device (bringing it back first if it was\nevicted) until 'gpushm unpin'. The owner or root may pin.",
		"  gpushm pin weights"
	if !on {
		use, short, long, example = "unpin NAME...", "Let pinned segments be evicted again",
			"\n\n'gpushm unpin' undoes 'gpushm pin' (or 'gpushm create --pin'). The owner or\nroot may unpin.",
			"  gpushm unpin weights"
	}
	return tierCmd(use, short, tiersHelp+long, example,
		func(ctx context.Context, c *gpushm.Client, name string) (*gpushm.SegmentInfo, error) {
			return c.Pin(ctx, name, on)
		})
}
