package main

import (
	"context"
	"fmt"
	"time"

	"github.com/gpushm/gpushm/internal/bytesize"
	"github.com/gpushm/gpushm/internal/wire"
	"github.com/spf13/cobra"
)

// pids says which processes hold an earlier version.
func pids(ps []int) string {
	if len(ps) == 0 {
		return ""
	}
	s := fmt.Sprint(ps)
	return " by pid " + s[1:len(s)-1]
}

func statCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "stat NAME",
		Short: "Show one segment in full",
		Long: `Show one segment in full. -o json (or --json) and -o yaml print one object
with the protocol's field names (docs/cli.md, "Output").`,
		Example: `  gpushm stat weights
  gpushm stat weights -o json | jq .meta`,
		Args:              cobra.ExactArgs(1),
		ValidArgsFunction: segmentNames(0),
		RunE: func(cmd *cobra.Command, args []string) error {
			return failed("stat", args[0], stat(cmd.Context(), args[0]))
		},
	}
	addOutput(cmd, true)
	return cmd
}

func stat(ctx context.Context, name string) error {
	c, err := dial(ctx)
	if err != nil {
		return err
	}
	defer c.Close()
	s, err := c.Stat(ctx, name)
	if err != nil {
		return err
	}
	switch {
	case structured():
		return printValue(viewOf(s))
	case output == "name":
		printNames(s.Name)
		return nil
	}
	fmt.Printf("name:        %s\n", s.Name)
	fmt.Printf("id:          %d\n", s.ID)
	fmt.Printf("size:        %d (%s)\n", s.Size, bytesize.Format(s.Size))
	fmt.Printf("allocated:   %d (%s)\n", s.AllocSize, bytesize.Format(s.AllocSize))
	fmt.Printf("device:      %d\n", s.Device)
	if s.UUID != "" {
		fmt.Printf("gpu:         %s\n", s.UUID)
	}
	fmt.Printf("handle:      %s\n", s.HandleType)
	if s.HandleType == wire.HandleCUDA {
		// Whether NIXL, UCX or Mooncake can register it for RDMA.
		fmt.Printf("rdma:        %s\n", map[bool]string{true: "yes (GPUDirect RDMA can register it)", false: "no (the device does not allow it with VMM, or the segment is evicted)"}[s.RDMA])
	}
	fmt.Printf("owner:       %s (%d:%d)\n", owner(s.UID, s.GID), s.UID, s.GID)
	fmt.Printf("mode:        %04o\n", s.Mode)
	fmt.Printf("opens:       %d\n", s.Opens)
	fmt.Printf("version:     %d\n", max(s.Version, 1))
	for _, v := range s.Versions {
		fmt.Printf("held:        version %d (segment %d): %d opens%s\n", v.Version, v.ID, v.Opens, pids(v.PIDs))
	}
	fmt.Printf("tier:        %s\n", tier(c.Backend(), s))
	if s.LastOpen != 0 {
		last := time.Unix(0, s.LastOpen)
		fmt.Printf("last open:   %s (%s ago)\n", last.Format(time.RFC3339), age(time.Since(last)))
	}
	created := time.Unix(0, s.Created)
	fmt.Printf("created:     %s (%s ago)\n", created.Format(time.RFC3339), age(time.Since(created)))
	fmt.Printf("lifetime:    %s\n", lifetime(s))
	if ch := s.Channel; ch != nil {
		fmt.Printf("channel:     %d slots of %s (every %s)\n", ch.Slots, bytesize.Format(ch.SlotBytes), bytesize.Format(ch.SlotStride))
	}
	if s.Uncommitted {
		fmt.Printf("incomplete:  still being written; opens and 'gpushm get' refuse it until its writer commits it, and it goes if the writer ends first\n")
	}
	if s.Orphan != "" {
		fmt.Printf("orphaned:    %s ('gpushm rm %s' frees it)\n", s.Orphan, s.Name)
	}
	if len(s.Meta) > 0 {
		fmt.Printf("meta:        %s\n", s.Meta)
	}
	return nil
}
