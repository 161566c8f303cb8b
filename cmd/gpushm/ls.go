package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/bytesize"
	"github.com/gpushm/gpushm/internal/segment"
)

func lsCmd() *cobra.Command {
	var (
		bytes, wide, watch bool
		interval           time.Duration
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
		ValidArgsFunction: segmentNames(),
		RunE: func(cmd *cobra.Command, args []string) error {
			if wide && output == "" {
				output = "wide"
			}
			if cmd.Flags().Changed("interval") && !watch {
				return usagef(cmd, "ls: --interval is for --watch")
			}
			if watch {
				if interval <= 0 {
					return usagef(cmd, "ls: --interval %s: want a positive duration, such as 2s or 500ms", interval)
				}
				return failed("ls", "", watchList(cmd.Context(), args, bytes, interval))
			}
			return failed("ls", "", list(cmd.Context(), os.Stdout, args, bytes))
		},
	}
	cmd.Flags().BoolVar(&bytes, "bytes", false, "print sizes in bytes")
	cmd.Flags().BoolVarP(&wide, "wide", "w", false, "short for -o wide")
	cmd.Flags().BoolVar(&watch, "watch", false, "list again every --interval until Ctrl-C (status 0)")
	cmd.Flags().DurationVar(&interval, "interval", 2*time.Second, "with --watch, how often to list")
	addOutput(cmd, true)
	return cmd
}

// isPattern says whether an argument of ls is a glob rather than a name.
func isPattern(arg string) bool { return strings.ContainsAny(arg, "*?[\\") }

// checkPatterns refuses a pattern path.Match cannot read.
func checkPatterns(args []string) error {
	for _, a := range args {
		if _, err := path.Match(a, ""); err != nil {
			return fmt.Errorf("pattern %q: %w", a, err)
		}
	}
	return nil
}

func list(ctx context.Context, w io.Writer, args []string, bytes bool) error {
	if err := checkPatterns(args); err != nil {
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
	var segs []gpushm.SegmentInfo
	matched := make([]bool, len(args))
	for _, s := range all {
		keep := len(args) == 0
		for i, a := range args {
			if ok, _ := path.Match(a, s.Name); ok {
				matched[i], keep = true, true
			}
		}
		if keep {
			segs = append(segs, s)
		}
	}
	var errs []error
	for i, a := range args {
		if !matched[i] && !isPattern(a) {
			errs = append(errs, failed("ls", a, segment.ErrNotFound))
		}
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
		return writeValue(out, viewsOf(segs))
	case "name":
		for _, s := range segs {
			fmt.Fprintln(out, s.Name)
		}
		return nil
	}
	wide := output == "wide"
	devName := map[int]string{}
	if wide {
		inf, err := c.Info(ctx)
		if err != nil {
			return err
		}
		for _, d := range inf.Devices {
			id := d.UUID
			if id == "" {
				id = "-"
			}
			devName[d.Index] = d.Name + "\t" + id
		}
	}
	w := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	header := "NAME\tSIZE\tDEVICE\tOWNER\tMODE\tOPENS\tTIER\tOPENED\tAGE\tLIFETIME"
	if wide {
		header += "\tGPU\tUUID"
	}
	fmt.Fprintln(w, header)
	for _, s := range segs {
		size := bytesize.Format(s.Size)
		if bytes {
			size = strconv.FormatInt(s.Size, 10)
		}
		fmt.Fprintf(w, "%s\t%s\t%d\t%s\t%04o\t%d\t%s\t%s\t%s\t%s", s.Name, size, s.Device,
			owner(s.UID, s.GID), s.Mode, s.Opens, tier(c.Backend(), &s), opened(&s),
			age(time.Since(time.Unix(0, s.Created))), lifetime(&s))
		if wide {
			fmt.Fprintf(w, "\t%s", devName[s.Device])
		}
		fmt.Fprintln(w)
	}
	return w.Flush()
}

// lifetime says how a segment ends: "-" (when removed), "creator" (with
// its creator's connection), or "ttl 10m (4m left)".
func lifetime(s *gpushm.SegmentInfo) string {
	switch {
	case s.Orphan != "":
		return "orphaned"
	case s.Uncommitted:
		return "incomplete"
	case s.Channel != nil && s.Lifetime != "connection" && s.TTL == 0:
		return fmt.Sprintf("channel of %d", s.Channel.Slots)
	case s.Lifetime == "connection":
		return "creator"
	case s.TTL > 0:
		ttl := time.Duration(s.TTL * float64(time.Second))
		if s.Opens > 0 {
			return fmt.Sprintf("ttl %s (open)", ttl)
		}
		left := max(ttl-time.Since(time.Unix(0, s.Idle)), 0)
		return fmt.Sprintf("ttl %s (%s left)", ttl, left.Round(time.Second))
	}
	return "-"
}

// tier says where a segment's bytes are: "gpu", "gpu, pinned" or "host".
// The protocol's "gpu" is the device's own memory, which a daemon of the
// host backend serves from host memory: it says so, and "evicted" for a
// segment moved out of it, lest a user without a GPU read "gpu".
func tier(backend string, s *gpushm.SegmentInfo) string {
	t := s.Tier
	switch {
	case t == "":
		return "-" // a daemon without tiers
	case backend == "host" && t == "gpu":
		t = "host memory"
	case backend == "host" && t == "host":
		t = "evicted"
	}
	if s.Pinned {
		return t + ", pinned"
	}
	return t
}

// opened is how long ago a segment was last opened ("-" if unknown).
func opened(s *gpushm.SegmentInfo) string {
	if s.LastOpen == 0 {
		return "-"
	}
	return age(time.Since(time.Unix(0, s.LastOpen)))
}

func owner(uid, gid uint32) string { return userName(uid) + ":" + groupName(gid) }

func age(d time.Duration) string {
	switch {
	case d < time.Minute:
		return fmt.Sprintf("%ds", int(d.Seconds()))
	case d < time.Hour:
		return fmt.Sprintf("%dm", int(d.Minutes()))
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh", int(d.Hours()))
	}
	return fmt.Sprintf("%dd", int(d.Hours()/24))
}
