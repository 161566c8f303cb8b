package main

import (
	"context"

	"github.com/spf13/cobra"

	"github.com/gpushm/gpushm"
)

func pinCmd(on bool) *cobra.Command {
	use, short, long := "pin NAME...", "Keep segments on their GPU: never evict them",
		"\n\n'gpushm pin' keeps a segment on its device (bringing it back first if it was\nevicted) until 'gpushm unpin'. The owner or root may pin."
	if !on {
		use, short, long = "unpin NAME...", "Let pinned segments be evicted again",
			"\n\n'gpushm unpin' undoes 'gpushm pin' (or 'gpushm create --pin'). The owner or\nroot may unpin."
	}
	return tierCmd(use, short, tiersHelp+long,
		func(ctx context.Context, c *gpushm.Client, name string) (*gpushm.SegmentInfo, error) {
			return c.Pin(ctx, name, on)
		})
}
