// Package complete completes gpushm's command lines in the shells:
// cobra's 'gpushm completion bash|zsh|fish|powershell' writes the script,
// which calls 'gpushm __complete' for every TAB. Segment names and devices
// come from the daemon that dial reaches; when none answers there are
// none, quietly, since a TAB must never print an error into the command
// line.
package complete

import (
	"context"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/bytesize"
	"github.com/gpushm/gpushm/internal/report"
)

// Dial connects to the daemon, as the command would.
type Dial func(context.Context) (*gpushm.Client, error)

// ask bounds how long a TAB waits for the daemon.
const ask = 2 * time.Second

// Names completes the names of segments: every argument of a command
// that takes names (rm NAME...), or only those at the positions given
// (mv OLD NEW: 0), counting from 0.
func Names(dial Dial, at ...int) cobra.CompletionFunc {
	return func(cmd *cobra.Command, args []string, toComplete string) ([]cobra.Completion, cobra.ShellCompDirective) {
		if len(at) > 0 && !slices.Contains(at, len(args)) {
			return nil, cobra.ShellCompDirectiveNoFileComp
		}
		return listNames(cmd.Context(), dial, toComplete, args), cobra.ShellCompDirectiveNoFileComp
	}
}

// NamesAfter completes the first argument with first (nothing, if nil),
// and the others with segment names (chmod MODE NAME...).
func NamesAfter(dial Dial, first cobra.CompletionFunc) cobra.CompletionFunc {
	return func(cmd *cobra.Command, args []string, toComplete string) ([]cobra.Completion, cobra.ShellCompDirective) {
		if len(args) > 0 {
			return Names(dial)(cmd, args[1:], toComplete)
		}
		if first == nil {
			return nil, cobra.ShellCompDirectiveNoFileComp
		}
		return first(cmd, args, toComplete)
	}
}

// NamesThenFiles completes a segment name, when names says the command
// takes one that exists, then a file (put, get).
func NamesThenFiles(dial Dial, names func(cmd *cobra.Command) bool) cobra.CompletionFunc {
	return func(cmd *cobra.Command, args []string, toComplete string) ([]cobra.Completion, cobra.ShellCompDirective) {
		switch len(args) {
		case 0:
			if !names(cmd) {
				return nil, cobra.ShellCompDirectiveNoFileComp
			}
			return listNames(cmd.Context(), dial, toComplete, nil), cobra.ShellCompDirectiveNoFileComp
		case 1:
			return nil, cobra.ShellCompDirectiveDefault // the shell's own file completion
		}
		return nil, cobra.ShellCompDirectiveNoFileComp
	}
}

// listNames asks the daemon for the names that start with prefix, less
// those given already; nil when none answers.
func listNames(ctx context.Context, dial Dial, prefix string, given []string) []cobra.Completion {
	if ctx == nil {
		ctx = context.Background()
	}
	ctx, cancel := context.WithTimeout(ctx, ask)
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
			out = append(out, cobra.CompletionWithDesc(s.Name, bytesize.Format(s.Size)+", "+report.Tier(c.Backend(), &s)))
		}
	}
	return out
}

// devices completes --device with the daemon's devices: ordinals, and
// GPU UUIDs.
func devices(dial Dial) cobra.CompletionFunc {
	return func(*cobra.Command, []string, string) ([]cobra.Completion, cobra.ShellCompDirective) {
		ctx, cancel := context.WithTimeout(context.Background(), ask)
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
}

// Modes are the permission bits offered for --mode and chmod's MODE.
var Modes = []string{"0600", "0640", "0644", "0660", "0666"}

// flagValues are the values each flag of that name takes, wherever it is.
var flagValues = map[string][]string{
	"backend":   {"auto", "cuda", "host"},
	"copier":    {"auto", "daemon", "client"},
	"direct":    {"auto", "always", "never"},
	"log-level": {"debug", "info", "warn", "error"},
	"nvml":      {"auto", "require", "off"},
	"mode":      Modes,
}

// Flags registers the completion of cmd's flags that take one of a few
// values, or the daemon's devices, or a directory.
func Flags(dial Dial, cmd *cobra.Command) {
	f := cmd.Flags()
	for name, values := range flagValues {
		if f.Lookup(name) != nil {
			cmd.RegisterFlagCompletionFunc(name, cobra.FixedCompletions(values, cobra.ShellCompDirectiveNoFileComp))
		}
	}
	if fl := f.Lookup("device"); fl != nil && fl.Value.Type() == "string" {
		cmd.RegisterFlagCompletionFunc("device", devices(dial))
	}
	if f.Lookup("mount") != nil {
		cmd.RegisterFlagCompletionFunc("mount", func(*cobra.Command, []string, string) ([]cobra.Completion, cobra.ShellCompDirective) {
			return nil, cobra.ShellCompDirectiveFilterDirs
		})
	}
}
