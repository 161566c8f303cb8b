package cli

import (
	"github.com/spf13/cobra"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/complete"
	"github.com/gpushm/gpushm/internal/exitcode"
	"github.com/gpushm/gpushm/internal/owner"
)

func chownCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "chown [OWNER][:GROUP] NAME...",
		Short: "Change segments' owner and group (names or numbers)",
		Long: `Change the owner and group of segments, as chown(1) does for files. Only root
may change the owner; the owner may change the group to its own group. It
prints nothing, unless -o asks: each segment as it is now.`,
		Example: `  gpushm chown alice:ml weights
  gpushm chown :ml weights tokenizer`,
		Args:              cobra.MinimumNArgs(2),
		ValidArgsFunction: complete.NamesAfter(dial, nil),
		RunE: func(cmd *cobra.Command, args []string) error {
			uid, gid, err := owner.Parse(args[0])
			if err != nil {
				return exitcode.Usagef(cmd, "chown: %v", err)
			}
			return eachChanged(cmd.Context(), "chown", args[1:], func(c *gpushm.Client, name string) error {
				return c.Chown(cmd.Context(), name, uid, gid)
			})
		},
	}
	addOutput(cmd, false)
	return cmd
}
