package cli

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/complete"
	"github.com/gpushm/gpushm/internal/exitcode"
	"github.com/gpushm/gpushm/internal/interrupt"
	"github.com/gpushm/gpushm/internal/report"
	"github.com/gpushm/gpushm/internal/terminal"
)

func lsCmd() *cobra.Command {
	var (
		bytes, wide, watch, noHeaders bool
		interval                      time.Duration
	)
	cmd := &cobra.Command{
		Use:     "ls [NAME|PATTERN]...",
		Aliases: []string{"list"},
		Short:   "List segments, all or those named (PATTERN: a shell glob such as 'llama-*')",
		Long: `List segments: all of them, or those named, and those a PATTERN matches
(a shell glob: *, ? and [...]; quote it, so that the shell does not match
it against files). A NAME that names no segment is an error, reported
after the others are listed; a PATTERN that matches none is not.

LIFETIME says how each ends: "-" when removed, "creator"
with its creator's connection, "ttl" after that long unopened, and
"orphaned" for one that survived a restart in a state the daemon could not
prove (see 'gpushm stat NAME'; 'gpushm rm NAME' frees it), "channel of N"
for a channel of N slots (removed with 'gpushm rm', like a segment), and
"incomplete" for one still being written ('gpushm put' in progress): it
cannot be opened until its writer commits it, and goes if the writer ends
first.

TIER is where the bytes are: "gpu" on the segment's device ("gpu, pinned"
when it never leaves it), or "host" when the daemon evicted it to host
memory to keep its device under budget (the next open brings it back;
docs/architecture.md, "Tiers"). A daemon serving host memory (no GPU)
says "host memory" for the memory it serves, and "evicted" for a segment
moved out of it. OPENED is how long ago it was last opened.

-o wide adds each segment's GPU by name and UUID; -o json (or --json) and
-o yaml print every segment in full, meta included, with the protocol's
field names (docs/cli.md, "Output"), whose "tier" is "gpu" or "host"
whatever the backend; -o name prints the names alone.

--watch lists again every --interval (2s unless given), redrawing the
screen on a terminal, and appending each listing elsewhere, until Ctrl-C,
which ends it with status 0, as watch(1) does. A failure to list is shown
in place of the listing, and the next interval tries again.`,
		Example: `  gpushm ls
  gpushm ls 'llama-*' -o wide
  gpushm ls -o json | jq -r '.[] | select(.tier == "host") | .name'
  gpushm ls -o name | xargs gpushm load
  gpushm ls --watch --interval 1s`,
		ValidArgsFunction: complete.Names(dial),
		RunE: func(cmd *cobra.Command, args []string) error {
			if wide && output == "" {
				output = "wide"
			}
			if cmd.Flags().Changed("interval") && !watch {
				return exitcode.Usagef(cmd, "ls: --interval is for --watch")
			}
			if watch {
				if noHeaders {
					return exitcode.Usagef(cmd, "ls: --no-headers is not for --watch, which draws for a person")
				}
				if interval <= 0 {
					return exitcode.Usagef(cmd, "ls: --interval %s: want a positive duration, such as 2s or 500ms", interval)
				}
				return exitcode.Failed("ls", "", watchList(cmd.Context(), args, bytes, interval))
			}
			out := io.Writer(Stdout)
			if noHeaders {
				if output != "" && output != "wide" {
					return exitcode.Usagef(cmd, "ls: --no-headers is for the table (-o wide or none), not -o %s", output)
				}
				out = &dropFirstLine{w: out}
			}
			return exitcode.Failed("ls", "", list(cmd.Context(), out, args, bytes))
		},
	}
	cmd.Flags().BoolVar(&bytes, "bytes", false, "print sizes in bytes")
	cmd.Flags().BoolVarP(&wide, "wide", "w", false, "short for -o wide")
	cmd.Flags().BoolVar(&watch, "watch", false, "list again every --interval until Ctrl-C (status 0)")
	cmd.Flags().BoolVar(&noHeaders, "no-headers", false, "leave out the table's header line (for scripts that read the columns)")
	cmd.Flags().DurationVar(&interval, "interval", 2*time.Second, "with --watch, how often to list")
	addOutput(cmd, true)
	return cmd
}

func list(ctx context.Context, w io.Writer, args []string, bytes bool) error {
	if err := report.CheckPatterns(args); err != nil {
		return err
	}
	c, err := dial(ctx)
	if err != nil {
		return err
	}
	defer c.Close()
	return listWith(ctx, c, w, args, bytes)
}

// listWith writes the segments args name or match to w, as -o asks, and
// returns an error for each name that names none.
func listWith(ctx context.Context, c *gpushm.Client, w io.Writer, args []string, bytes bool) error {
	all, err := c.List(ctx)
	if err != nil {
		return err
	}
	segs, missing := report.Select(all, args)
	var errs []error
	for _, a := range missing {
		errs = append(errs, exitcode.Failed("ls", a, elsewhere(c, exitcode.Errnof(syscall.ENOENT, "no such segment"))))
	}
	if len(segs) > 0 || len(args) == 0 || structured() {
		if err := printList(ctx, c, w, segs, bytes); err != nil {
			return err
		}
	}
	return errors.Join(errs...)
}

func printList(ctx context.Context, c *gpushm.Client, out io.Writer, segs []gpushm.SegmentInfo, bytes bool) error {
	switch output {
	case "json", "yaml":
		// A list carries no meta (docs/protocol.md): each segment's stat
		// does. One gone meanwhile is listed as the list saw it.
		for i := range segs {
			if s, err := c.Stat(ctx, segs[i].Name); err == nil && s.ID == segs[i].ID {
				segs[i].Meta = s.Meta
			}
		}
		return report.WriteValue(out, output, report.Segments(segs))
	case "name":
		for _, s := range segs {
			fmt.Fprintln(out, s.Name)
		}
		return nil
	}
	wide := output == "wide"
	var devices []gpushm.Device
	if wide {
		inf, err := c.Info(ctx)
		if err != nil {
			return err
		}
		devices = inf.Devices
	}
	return report.List(out, segs, c.Backend(), devices, bytes, wide)
}

// watchList lists as ls does every interval, as watch(1) runs a command,
// until SIGINT (Ctrl-C), which ends it with status 0, as watch(1) users
// expect: it is how one stops watching, not a failure. SIGTERM ends it with
// 143. On a terminal each listing is drawn over the last, cut to the
// screen's height; elsewhere listings follow one another.
func watchList(ctx context.Context, args []string, sizes bool, every time.Duration) error {
	if err := report.CheckPatterns(args); err != nil {
		return err
	}
	ctx, stop := interrupt.Context(ctx)
	defer stop()
	c, err := dial(ctx)
	if err != nil {
		return err
	}
	defer c.Close()
	sep := "\n" // between listings in text
	switch output {
	case "json":
		sep = ""
	case "yaml":
		sep = "---\n"
	}
	terminal.Repeat(ctx, Stdout, every, sep, func(w io.Writer) bool {
		if output == "" || output == "wide" {
			what := strings.TrimSpace("gpushm ls " + strings.Join(args, " "))
			fmt.Fprintf(w, "Every %s: %s    %s\n\n", every, what, time.Now().Format(time.DateTime))
		}
		if err := listWith(ctx, c, w, args, sizes); err != nil {
			if ctx.Err() != nil {
				return false // interrupted while listing: no frame to show
			}
			exitcode.WriteText(w, exitcode.Failed("ls", "", err))
		}
		return true
	})
	if interrupt.Signal() == syscall.SIGINT {
		return nil
	}
	return ctx.Err()
}

// dropFirstLine writes what it is given to w but for the first line (a
// table's header).
type dropFirstLine struct {
	w    io.Writer
	past bool
}

func (d *dropFirstLine) Write(b []byte) (int, error) {
	n := len(b)
	if !d.past {
		i := bytes.IndexByte(b, '\n')
		if i < 0 {
			return n, nil
		}
		d.past, b = true, b[i+1:]
	}
	if len(b) == 0 {
		return n, nil
	}
	if _, err := d.w.Write(b); err != nil {
		return 0, err
	}
	return n, nil
}
