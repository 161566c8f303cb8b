package main

import (
	"errors"
	"io/fs"

	"github.com/spf13/cobra"

	"github.com/gpushm/gpushm"
)

func rmCmd() *cobra.Command {
	var force bool
	cmd := &cobra.Command{
		Use:   "rm NAME...",
		Short: "Remove segments (memory is freed when the last process closes it)",
		Args:  cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return eachName(cmd.Context(), args, func(c *gpushm.Client, name string) error {
				err := c.Unlink(cmd.Context(), name)
				if force && errors.Is(err, fs.ErrNotExist) {
					return nil
				}
				return err
			})
		},
	}
	cmd.Flags().BoolVarP(&force, "force", "f", false, "ignore names that do not exist")
	return cmd
}
