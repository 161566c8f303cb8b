package cli

import (
	"context"
	"errors"
	"fmt"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/gpushm/gpushm/internal/complete"
	"github.com/gpushm/gpushm/internal/exitcode"
	"github.com/gpushm/gpushm/internal/report"
)

func mvCmd() *cobra.Command {
	var noClobber bool
	cmd := &cobra.Command{
		Use:   "mv OLD NEW",
		Short: "Rename a segment (replacing NEW if it exists)",
		Long: `Rename segment OLD to NEW, as mv(1) renames a file: a segment NEW had is
replaced, and freed when the last process that has it open closes it.
Processes that have OLD open keep it. Only the owner or root may rename.
It prints nothing, unless -o asks: the segment under its new name.

With -n (--no-clobber), a NEW that exists is not replaced: the command
fails with status 5 (exists) and nothing changes. The daemon checks and
renames in one step, so of two renames onto one name, one fails. (mv(1)'s
-n leaves NEW silently, with status 0: a script could not tell that
nothing moved, so this one says so, as mv --update=none-fail does.)`,
		Example: `  gpushm mv weights-new weights
  gpushm mv -n staging weights   # only if weights is not there
  gpushm mv a b -o json`,
		Args:              cobra.ExactArgs(2),
		ValidArgsFunction: complete.Names(dial, 0),
		RunE: func(cmd *cobra.Command, args []string) error {
			return exitcode.Failed("mv", args[0], rename(cmd.Context(), args[0], args[1], noClobber))
		},
	}
	cmd.Flags().BoolVarP(&noClobber, "no-clobber", "n", false, "fail, changing nothing, if NEW exists (status 5)")
	addOutput(cmd, false)
	return cmd
}

func rename(ctx context.Context, from, to string, noClobber bool) error {
	c, err := dial(ctx)
	if err != nil {
		return err
	}
	defer c.Close()
	if noClobber {
		err = c.RenameNoReplace(ctx, from, to)
		switch {
		case errors.Is(err, syscall.EEXIST):
			return exitcode.Errnof(syscall.EEXIST, "%s exists (-n leaves it)", exitcode.QuoteName(to))
		case errors.Is(err, syscall.EPROTO):
			return fmt.Errorf("the daemon predates mv -n (upgrade it); nothing renamed: %w", err)
		}
	} else {
		err = c.Rename(ctx, from, to)
	}
	if err != nil {
		return err
	}
	switch output {
	case "json", "yaml":
		s, err := c.Stat(ctx, to)
		if err != nil {
			return fmt.Errorf("renamed to %s, then: %w", exitcode.QuoteName(to), err)
		}
		return printValue(report.SegmentOf(s))
	case "name":
		printNames(to)
	}
	return nil
}
