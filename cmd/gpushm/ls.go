package main

import (
	"fmt"
	"os"
	"os/user"
	"strconv"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/bytesize"
)

func lsCmd() *cobra.Command {
	var bytes, wide, asJSON bool
	cmd := &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List segments",
		Long: `List segments. LIFETIME says how each ends: "-" when removed, "creator"
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
docs/architecture.md, "Tiers"). OPENED is how long ago it was last opened.

With --json it prints one JSON array of segment objects with the protocol's
field names (docs/protocol.md).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := dial(cmd.Context())
			if err != nil {
				return err
			}
			defer c.Close()
			segs, err := c.List(cmd.Context())
			if err != nil {
				return err
			}
			if asJSON {
				if segs == nil {
					segs = []gpushm.SegmentInfo{}
				}
				return printJSON(segs)
			}
			devName := map[int]string{}
			if wide {
				inf, err := c.Info(cmd.Context())
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
			w := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
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
					owner(s.UID, s.GID), s.Mode, s.Opens, tier(&s), opened(&s),
					age(time.Since(time.Unix(0, s.Created))), lifetime(&s))
				if wide {
					fmt.Fprintf(w, "\t%s", devName[s.Device])
				}
				fmt.Fprintln(w)
			}
			return w.Flush()
		},
	}
	cmd.Flags().BoolVar(&bytes, "bytes", false, "print sizes in bytes")
	cmd.Flags().BoolVarP(&wide, "wide", "w", false, "also show each segment's GPU by name and UUID")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print one JSON array (the protocol's field names)")
	return cmd
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
func tier(s *gpushm.SegmentInfo) string {
	switch {
	case s.Tier == "":
		return "-" // a daemon without tiers
	case s.Pinned:
		return s.Tier + ", pinned"
	}
	return s.Tier
}

// opened is how long ago a segment was last opened ("-" if unknown).
func opened(s *gpushm.SegmentInfo) string {
	if s.LastOpen == 0 {
		return "-"
	}
	return age(time.Since(time.Unix(0, s.LastOpen)))
}

func owner(uid, gid uint32) string {
	u := strconv.FormatUint(uint64(uid), 10)
	if pw, err := user.LookupId(u); err == nil {
		u = pw.Username
	}
	g := strconv.FormatUint(uint64(gid), 10)
	if gr, err := user.LookupGroupId(g); err == nil {
		g = gr.Name
	}
	return u + ":" + g
}

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
