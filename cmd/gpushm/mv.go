package main

import (
	"github.com/spf13/cobra"
)

func mvCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "mv OLD NEW",
		Short: "Rename a segment (replacing NEW if it exists)",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := dial(cmd.Context())
			if err != nil {
				return err
			}
			defer c.Close()
			return c.Rename(cmd.Context(), args[0], args[1])
		},
	}
}
