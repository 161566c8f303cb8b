package cli

import (
	"fmt"
	"slices"
	"strings"

	"github.com/spf13/cobra"

	"github.com/gpushm/gpushm/internal/exitcode"
	"github.com/gpushm/gpushm/internal/report"
)

// output is the -o of the command that runs: "" (text), "json", "yaml",
// "wide" or "name", as kubectl has them. Every command that prints takes
// it, and an error is printed in its format too (exitcode.Write), so it
// is one variable for the process.
var output string

// outputFormats are the values of -o, as completion offers them.
var outputFormats = []string{"json", "yaml", "wide", "name"}

// addOutput gives cmd -o (and --json, which some of them had first).
// Formats a command has no use for are refused: info has no names.
func addOutput(cmd *cobra.Command, json bool, formats ...string) {
	if len(formats) == 0 {
		formats = outputFormats
	}
	f := cmd.Flags()
	f.StringVarP(&output, "output", "o", "", "print "+strings.Join(formats, ", ")+" (docs/cli.md, \"Output\")")
	cmd.RegisterFlagCompletionFunc("output", cobra.FixedCompletions(formats, cobra.ShellCompDirectiveNoFileComp))
	if json {
		f.Bool("json", false, "short for -o json")
	}
	prev := cmd.PreRunE
	cmd.PreRunE = func(cmd *cobra.Command, args []string) error {
		if on, _ := cmd.Flags().GetBool("json"); on {
			if cmd.Flags().Changed("output") && output != "json" {
				return exitcode.Usagef(cmd, "%s: give -o %s or --json, not both", cmd.Name(), output)
			}
			output = "json"
		}
		if output != "" && !slices.Contains(formats, output) {
			return exitcode.Usagef(cmd, "%s: -o %s: want %s", cmd.Name(), output, strings.Join(formats, ", "))
		}
		if prev != nil {
			return prev(cmd, args)
		}
		return nil
	}
}

// structured says whether output is for programs (json or yaml).
func structured() bool { return output == "json" || output == "yaml" }

// printValue writes v to standard output as JSON (indented) or YAML.
func printValue(v any) error {
	return report.WriteValue(Stdout, output, v)
}

// printNames writes each name on a line of its own (-o name).
func printNames(names ...string) {
	for _, n := range names {
		fmt.Fprintln(Stdout, n)
	}
}

// printCopy prints r as -o asks: nothing for text, where put and get say
// what they did on standard error, and on a terminal only.
func printCopy(r report.Copy) error {
	switch {
	case structured():
		return printValue(r)
	case output == "name":
		printNames(r.Name)
	}
	return nil
}
