package cli

import (
	"context"

	"github.com/spf13/cobra"

	"github.com/gpushm/gpushm/internal/complete"
	"github.com/gpushm/gpushm/internal/exitcode"
	"github.com/gpushm/gpushm/internal/report"
)

func statCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "stat NAME",
		Short: "Show one segment in full",
		Long: `Show one segment in full. -o json (or --json) and -o yaml print one object
with the protocol's field names (docs/cli.md, "Output").`,
		Example: `  gpushm stat weights
  gpushm stat weights -o json | jq .meta`,
		Args:              cobra.ExactArgs(1),
		ValidArgsFunction: complete.Names(dial, 0),
		RunE: func(cmd *cobra.Command, args []string) error {
			return exitcode.Failed("stat", args[0], stat(cmd.Context(), args[0]))
		},
	}
	addOutput(cmd, true)
	return cmd
}

func stat(ctx context.Context, name string) error {
	c, err := dial(ctx)
	if err != nil {
		return err
	}
	defer c.Close()
	s, err := c.Stat(ctx, name)
	if err != nil {
		return elsewhere(c, err)
	}
	switch {
	case structured():
		return printValue(report.SegmentOf(s))
	case output == "name":
		printNames(s.Name)
		return nil
	}
	report.Stat(Stdout, s, c.Backend())
	return nil
}
