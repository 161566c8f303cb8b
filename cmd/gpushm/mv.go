package main

import (
	"context"
	"fmt"

	"github.com/spf13/cobra"
)

func mvCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "mv OLD NEW",
		Short: "Rename a segment (replacing NEW if it exists)",
		Long: `Rename segment OLD to NEW, as mv(1) renames a file: a segment NEW had is
replaced, and freed when the last process that has it open closes it.
Processes that have OLD open keep it. Only the owner or root may rename.
It prints nothing, unless -o asks: the segment under its new name.`,
		Example: `  gpushm mv weights-new weights
  gpushm mv a b -o json`,
		Args:              cobra.ExactArgs(2),
		ValidArgsFunction: segmentNames(0),
		RunE: func(cmd *cobra.Command, args []string) error {
			return failed("mv", args[0], rename(cmd.Context(), args[0], args[1]))
		},
	}
	addOutput(cmd, false)
	return cmd
}

func rename(ctx context.Context, from, to string) error {
	c, err := dial(ctx)
	if err != nil {
		return err
	}
	defer c.Close()
	if err := c.Rename(ctx, from, to); err != nil {
		return err
	}
	switch output {
	case "json", "yaml":
		s, err := c.Stat(ctx, to)
		if err != nil {
			return fmt.Errorf("renamed to %s, then: %w", quoteName(to), err)
		}
		return printValue(viewOf(s))
	case "name":
		printNames(to)
	}
	return nil
}
