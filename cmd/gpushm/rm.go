package main

import (
	"errors"
	"io/fs"

	"github.com/spf13/cobra"
)

func rmCmd() *cobra.Command {
	var force bool
	cmd := &cobra.Command{
		Use:   "rm NAME...",
		Short: "Remove segments (memory is freed when the last process closes it)",
		Args:  cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := dial(cmd.Context())
			if err != nil {
				return err
			}
			defer c.Close()
			var errs []error
			for _, name := range args {
				err := c.Unlink(cmd.Context(), name)
				if force && errors.Is(err, fs.ErrNotExist) {
					continue
				}
				errs = append(errs, err)
			}
			return errors.Join(errs...)
		},
	}
	cmd.Flags().BoolVarP(&force, "force", "f", false, "ignore names that do not exist")
	return cmd
}
