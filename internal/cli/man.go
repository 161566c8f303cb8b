package cli

import (
	"fmt"
	"os"

	"github.com/spf13/cobra"
	"github.com/spf13/cobra/doc"
)

func manCmd() *cobra.Command {
	return &cobra.Command{
		Use:     "man DIR",
		Short:   "Write a man page for every command into DIR (gpushm.1, gpushm-put.1, ...)",
		Hidden:  true,
		Args:    cobra.ExactArgs(1),
		Example: `  gpushm man /usr/local/share/man/man1 && man gpushm-put`,
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := os.MkdirAll(args[0], 0o755); err != nil {
				return err
			}
			root := cmd.Root()
			// Pages that do not change with the date they were made on, or
			// with this machine's defaults.
			root.DisableAutoGenTag = true
			hdr := &doc.GenManHeader{Title: "GPUSHM", Section: "1", Source: "gpushm " + version, Manual: "gpushm manual"}
			if err := doc.GenManTree(root, hdr, args[0]); err != nil {
				return fmt.Errorf("man %s: %w", args[0], err)
			}
			return nil
		},
	}
}
