package main

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/cobra/doc"

	"github.com/gpushm/gpushm/internal/bytesize"
)

// Shell completion: cobra's 'gpushm completion bash|zsh|fish|powershell'
// writes the script, which calls 'gpushm __complete' for every TAB. Segment
// names come from the daemon; when none answers there are none, quietly,
// since a TAB must never print an error into the command line.

// completeAsk bounds how long a TAB waits for the daemon.
const completeAsk = 2 * time.Second

// segmentNames completes the names of segments: every argument of a
// command that takes names (rm NAME...), or only those at the positions
// given (mv OLD NEW: 0), counting from 0.
func segmentNames(at ...int) cobra.CompletionFunc {
	return func(cmd *cobra.Command, args []string, toComplete string) ([]cobra.Completion, cobra.ShellCompDirective) {
		if len(at) > 0 && !slices.Contains(at, len(args)) {
			return nil, cobra.ShellCompDirectiveNoFileComp
		}
		return listNames(cmd.Context(), toComplete, args), cobra.ShellCompDirectiveNoFileComp
	}
}

// namesThenFiles completes a segment name, then a file (put, get).
func namesThenFiles(names func(cmd *cobra.Command) bool) cobra.CompletionFunc {
	return func(cmd *cobra.Command, args []string, toComplete string) ([]cobra.Completion, cobra.ShellCompDirective) {
		switch len(args) {
		case 0:
			if !names(cmd) {
				return nil, cobra.ShellCompDirectiveNoFileComp
			}
			return listNames(cmd.Context(), toComplete, nil), cobra.ShellCompDirectiveNoFileComp
		case 1:
			return nil, cobra.ShellCompDirectiveDefault // the shell's own file completion
		}
		return nil, cobra.ShellCompDirectiveNoFileComp
	}
}

// listNames asks the daemon for the names that start with prefix, less
// those given already; nil when none answers.
func listNames(ctx context.Context, prefix string, given []string) []cobra.Completion {
	if ctx == nil {
		ctx = context.Background()
	}
	ctx, cancel := context.WithTimeout(ctx, completeAsk)
	defer cancel()
	c, err := dial(ctx)
	if err != nil {
		return nil
	}
	defer c.Close()
	segs, err := c.List(ctx)
	if err != nil {
		return nil
	}
	var out []cobra.Completion
	for _, s := range segs {
		if strings.HasPrefix(s.Name, prefix) && !slices.Contains(given, s.Name) {
			out = append(out, cobra.CompletionWithDesc(s.Name, bytesize.Format(s.Size)+", "+tier(c.Backend(), &s)))
		}
	}
	return out
}

// deviceValues completes --device with the daemon's devices: ordinals,
// and GPU UUIDs.
func deviceValues(cmd *cobra.Command, args []string, toComplete string) ([]cobra.Completion, cobra.ShellCompDirective) {
	ctx, cancel := context.WithTimeout(context.Background(), completeAsk)
	defer cancel()
	c, err := dial(ctx)
	if err != nil {
		return nil, cobra.ShellCompDirectiveNoFileComp
	}
	defer c.Close()
	inf, err := c.Info(ctx)
	if err != nil {
		return nil, cobra.ShellCompDirectiveNoFileComp
	}
	var out []cobra.Completion
	for _, d := range inf.Devices {
		out = append(out, cobra.CompletionWithDesc(strconv.Itoa(d.Index), d.Name))
		if d.UUID != "" {
			out = append(out, cobra.CompletionWithDesc(d.UUID, d.Name))
		}
	}
	return out, cobra.ShellCompDirectiveNoFileComp
}

// flagValues are the values each flag of that name takes, wherever it is.
var flagValues = map[string][]string{
	"backend":   {"auto", "cuda", "host"},
	"copier":    {"auto", "daemon", "client"},
	"direct":    {"auto", "always", "never"},
	"log-level": {"debug", "info", "warn", "error"},
	"nvml":      {"auto", "require", "off"},
	"mode":      {"0600", "0640", "0644", "0660", "0666"},
}

// completeFlags registers the completion of cmd's flags that take one of
// a few values, or the daemon's devices, or a directory.
func completeFlags(cmd *cobra.Command) {
	f := cmd.Flags()
	for name, values := range flagValues {
		if f.Lookup(name) != nil {
			cmd.RegisterFlagCompletionFunc(name, cobra.FixedCompletions(values, cobra.ShellCompDirectiveNoFileComp))
		}
	}
	if fl := f.Lookup("device"); fl != nil && fl.Value.Type() == "string" {
		cmd.RegisterFlagCompletionFunc("device", deviceValues)
	}
	if f.Lookup("mount") != nil {
		cmd.RegisterFlagCompletionFunc("mount", func(*cobra.Command, []string, string) ([]cobra.Completion, cobra.ShellCompDirective) {
			return nil, cobra.ShellCompDirectiveFilterDirs
		})
	}
}

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
