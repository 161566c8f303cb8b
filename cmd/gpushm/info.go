package main

import (
	"fmt"
	"os"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/bytesize"
)

func infoCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "info",
		Short: "Show the daemon's backend, devices and processes",
		Long: `Show the daemon's backend, devices and processes. It exits 0 only when a
daemon answers, so it doubles as a health check.

-o json (or --json) and -o yaml print one document with the protocol's
field names (docs/protocol.md, "info"), including "pid", the process serving the socket
(the one a crash would take down), and "supervisor_pid", the one holding
every segment across restarts of the serving process.`,
		Example: `  gpushm info
  gpushm info -o json | jq .usage
  until gpushm info >/dev/null 2>&1; do sleep 1; done   # wait for the daemon`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			return failed("info", "", info(cmd))
		},
	}
	addOutput(cmd, true, "json", "yaml", "wide")
	return cmd
}

func info(cmd *cobra.Command) error {
	c, err := dial(cmd.Context())
	if err != nil {
		return err
	}
	defer c.Close()
	inf, err := c.Info(cmd.Context())
	if err != nil {
		return err
	}
	if structured() {
		return printValue(inf)
	}
	fmt.Printf("daemon:   gpushm %s at %s\nbackend:  %s\n", inf.Server, c.Socket(), inf.Backend)
	fmt.Printf("process:  serving %d, supervisor %d, %d restart(s)", inf.PID, inf.SupervisorPID, inf.Restarts)
	if inf.Grace > 0 {
		fmt.Printf(", %s left to reclaim leases", inf.Grace.Round(100*time.Millisecond))
	}
	fmt.Println()
	fmt.Printf("segments: %d named, %d holding memory, %s allocated, %d opens\n",
		inf.Usage.Named, inf.Usage.Segments, bytesize.Format(inf.Usage.Bytes), inf.Usage.Opens)
	if p := inf.Pool; p != nil {
		// Counted as free below: a create takes it first.
		fmt.Printf("pool:     %d allocations made ahead of time, %s\n", p.Ready, bytesize.Format(p.Bytes))
	}
	if t := inf.Tiers; t != nil {
		// Named as ls names them: a daemon serving host memory has no GPU.
		onDevice := tier(inf.Backend, &gpushm.SegmentInfo{Tier: "gpu"})
		evicted := tier(inf.Backend, &gpushm.SegmentInfo{Tier: "host"})
		back := "back on their GPU"
		if inf.Backend == "host" {
			back = "back in place"
		}
		for _, d := range t.Devices {
			budget := "no budget"
			if d.Budget > 0 {
				budget = "budget " + bytesize.Format(d.Budget)
			}
			fmt.Printf("tier %s: device %d: %s on it, %s (peak %s)\n", onDevice, d.Device, bytesize.Format(d.Bytes), budget, bytesize.Format(d.Peak))
		}
		hostBudget := "eviction off (--host-budget 0)"
		if t.HostBudget > 0 {
			hostBudget = "budget " + bytesize.Format(t.HostBudget)
		}
		fmt.Printf("tier %s: %s evicted, %s in copies of segments %s, %s; %d evictions (%s), %d restores (%s)\n",
			evicted, bytesize.Format(t.HostBytes), bytesize.Format(t.CleanBytes), back, hostBudget, t.Evictions,
			bytesize.Format(t.EvictedBytes), t.Restores, bytesize.Format(t.RestoredBytes))
		if t.ReserveTarget > 0 {
			fmt.Printf("reserve:  %s of %s of host memory made ahead of evictions (--host-reserve); evictions served from it: %d\n",
				bytesize.Format(t.ReserveBytes), bytesize.Format(t.ReserveTarget), t.ReserveTakes)
		}
	}
	fmt.Println()
	w := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "DEVICE\tNAME\tUUID\tTOTAL\tFREE\tGRANULARITY")
	for _, d := range inf.Devices {
		uuid := d.UUID
		if uuid == "" {
			uuid = "-"
		}
		fmt.Fprintf(w, "%d\t%s\t%s\t%s\t%s\t%s\n", d.Index, d.Name, uuid,
			bytesize.Format(int64(d.TotalBytes)), bytesize.Format(int64(d.FreeBytes)), bytesize.Format(d.Granularity))
	}
	if err := w.Flush(); err != nil {
		return err
	}
	return printGPUs(os.Stdout, inf.GPU)
}
