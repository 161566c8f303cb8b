package cli

import (
	"errors"
	"io/fs"

	"github.com/spf13/cobra"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/complete"
	"github.com/gpushm/gpushm/internal/exitcode"
	"github.com/gpushm/gpushm/internal/report"
)

func rmCmd() *cobra.Command {
	var force bool
	cmd := &cobra.Command{
		Use:   "rm NAME...",
		Short: "Remove segments (memory is freed when the last process closes it)",
		Long: `Remove segments by name, as rm(1) removes files: the name goes at once, and
the memory is freed when the last process that has the segment open closes
it. Only the owner or root may remove a segment. It prints nothing, unless
-o asks: -o name prints each name removed, -o json and -o yaml a list of
{"name", "removed"}.`,
		Example: `  gpushm rm weights
  gpushm rm -f scratch-1 scratch-2
  gpushm ls -o name 'tmp-*' | xargs -r gpushm rm`,
		Args:              cobra.MinimumNArgs(1),
		ValidArgsFunction: complete.Names(dial),
		RunE: func(cmd *cobra.Command, args []string) error {
			var done []report.Removed
			err := eachName(cmd.Context(), "rm", args, func(c *gpushm.Client, name string) error {
				err := c.Unlink(cmd.Context(), name)
				if force && errors.Is(err, fs.ErrNotExist) {
					done = append(done, report.Removed{Name: name})
					return nil
				}
				if err == nil {
					done = append(done, report.Removed{Name: name, Removed: true})
				}
				return err
			})
			if exitcode.IsNoDaemon(err) {
				return err // nothing was asked of a daemon
			}
			switch output {
			case "json", "yaml":
				if done == nil {
					done = []report.Removed{}
				}
				if perr := printValue(done); err == nil {
					err = perr
				}
			case "name":
				for _, r := range done {
					if r.Removed {
						printNames(r.Name)
					}
				}
			}
			return err
		},
	}
	cmd.Flags().BoolVarP(&force, "force", "f", false, "ignore names that do not exist")
	addOutput(cmd, false)
	return cmd
}
