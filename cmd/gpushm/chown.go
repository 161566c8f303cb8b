package main

import (
	"fmt"
	"os/user"
	"strconv"
	"strings"

	"github.com/spf13/cobra"

	"github.com/gpushm/gpushm"
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
		Args: cobra.MinimumNArgs(2),
		ValidArgsFunction: func(cmd *cobra.Command, args []string, toComplete string) ([]cobra.Completion, cobra.ShellCompDirective) {
			if len(args) == 0 {
				return nil, cobra.ShellCompDirectiveNoFileComp
			}
			return segmentNames()(cmd, args[1:], toComplete)
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			uid, gid, err := parseOwner(args[0])
			if err != nil {
				return usagef(cmd, "chown: %v", err)
			}
			return eachChanged(cmd.Context(), "chown", args[1:], func(c *gpushm.Client, name string) error {
				return c.Chown(cmd.Context(), name, uid, gid)
			})
		},
	}
	addOutput(cmd, false)
	return cmd
}

// parseOwner reads OWNER, OWNER:GROUP or :GROUP; -1 is "leave as it is".
func parseOwner(s string) (uid, gid int64, err error) {
	u, g, _ := strings.Cut(s, ":")
	if uid, err = lookupID(u, "owner", func(n string) (string, error) {
		pw, err := user.Lookup(n)
		if err != nil {
			return "", err
		}
		return pw.Uid, nil
	}); err != nil {
		return 0, 0, err
	}
	if gid, err = lookupID(g, "group", func(n string) (string, error) {
		gr, err := user.LookupGroup(n)
		if err != nil {
			return "", err
		}
		return gr.Gid, nil
	}); err != nil {
		return 0, 0, err
	}
	if uid < 0 && gid < 0 {
		return 0, 0, fmt.Errorf("%q names neither an owner nor a group", s)
	}
	return uid, gid, nil
}

// lookupID reads a number, or a name through byName; "" is -1.
func lookupID(s, what string, byName func(string) (string, error)) (int64, error) {
	if s == "" {
		return -1, nil
	}
	if n, err := strconv.ParseUint(s, 10, 32); err == nil {
		return int64(n), nil
	}
	id, err := byName(s)
	if err == nil {
		var n int64
		if n, err = strconv.ParseInt(id, 10, 64); err == nil {
			return n, nil
		}
	}
	return 0, fmt.Errorf("%s %q: %w", what, s, err)
}
