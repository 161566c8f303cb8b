package main

import (
	"context"
	"strconv"

	"github.com/spf13/cobra"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/complete"
	"github.com/gpushm/gpushm/internal/exitcode"
	"github.com/gpushm/gpushm/internal/report"
)

func chmodCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "chmod MODE NAME...",
		Short: "Change segments' permission bits (octal, as 0640)",
		Long: `Change the permission bits of segments, as chmod(1) does for files, in octal
only. The owner's bits govern the owner, the group's bits members of the
segment's group, the other bits everyone else: r lets a process open the
segment read-only, rw read-write. Only the owner or root may chmod. It
prints nothing, unless -o asks: each segment as it is now.`,
		Example: `  gpushm chmod 0640 weights
  gpushm chmod 0644 $(gpushm ls -o name 'shared-*')`,
		Args:              cobra.MinimumNArgs(2),
		ValidArgsFunction: complete.NamesAfter(dial, cobra.FixedCompletions(complete.Modes, cobra.ShellCompDirectiveNoFileComp)),
		RunE: func(cmd *cobra.Command, args []string) error {
			m, err := strconv.ParseUint(args[0], 8, 32)
			if err != nil || m > 0o777 {
				return exitcode.Usagef(cmd, "chmod: mode %q: want octal permission bits such as 0640", args[0])
			}
			return eachChanged(cmd.Context(), "chmod", args[1:], func(c *gpushm.Client, name string) error {
				return c.Chmod(cmd.Context(), name, uint32(m))
			})
		},
	}
	addOutput(cmd, false)
	return cmd
}

// eachChanged runs fn for every name as eachName does, then prints the
// segments changed as -o asks.
func eachChanged(ctx context.Context, verb string, names []string, fn func(c *gpushm.Client, name string) error) error {
	var changed []gpushm.SegmentInfo
	err := eachName(ctx, verb, names, func(c *gpushm.Client, name string) error {
		if err := fn(c, name); err != nil {
			return err
		}
		if output == "" || output == "wide" {
			return nil
		}
		s, err := c.Stat(ctx, name)
		if err != nil {
			return err
		}
		changed = append(changed, *s)
		return nil
	})
	if exitcode.IsNoDaemon(err) {
		return err // nothing was asked of a daemon
	}
	switch output {
	case "json", "yaml":
		if perr := printValue(report.Segments(changed)); err == nil {
			err = perr
		}
	case "name":
		for _, s := range changed {
			printNames(s.Name)
		}
	}
	return err
}
