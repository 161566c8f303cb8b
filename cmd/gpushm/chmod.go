package main

import (
	"fmt"
	"strconv"

	"github.com/spf13/cobra"

	"github.com/gpushm/gpushm"
)

func chmodCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "chmod MODE NAME...",
		Short: "Change segments' permission bits (octal, as 0640)",
		Long: `Change the permission bits of segments, as chmod(1) does for files, in octal
only. The owner's bits govern the owner, the group's bits members of the
segment's group, the other bits everyone else: r lets a process open the
segment read-only, rw read-write. Only the owner or root may chmod.`,
		Args: cobra.MinimumNArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			m, err := strconv.ParseUint(args[0], 8, 32)
			if err != nil || m > 0o777 {
				return fmt.Errorf("mode %q: want octal permission bits such as 0640", args[0])
			}
			return eachName(cmd.Context(), args[1:], func(c *gpushm.Client, name string) error {
				return c.Chmod(cmd.Context(), name, uint32(m))
			})
		},
	}
}
