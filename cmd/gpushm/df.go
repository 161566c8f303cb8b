package main

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"os"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/bytesize"
	"github.com/gpushm/gpushm/internal/wire"
)

func dfCmd() *cobra.Command {
	var sizes bool
	cmd := &cobra.Command{
		Use:   "df",
		Short: "Show memory in use, and left, on each device and tier, and for each user",
		Long: `Show, as df(1) does for file systems, how much memory each device and tier
holds and how much is left, and what each user holds against its quota.

The first table has a line for each device's own memory (TIER "gpu"; on a
daemon serving host memory, "host memory") and, when segments can be
evicted, one for host memory holding them (TIER "host"; "evicted" on a
daemon serving host memory). SIZE is what bounds USED, as LIMIT says:
"budget" ('gpushm daemon --gpu-budget': a create past it evicts
segments that nobody has open), "max-memory" (--max-memory: a create past
it is refused), "memory" (the device's, when neither is set), or "host
budget" (--host-budget). USED is the bytes of the segments there now,
creates and restores under way included; AVAIL what a create may take
without evicting anything: SIZE less USED, and no more than the device
has free; USE% is USED of SIZE, rounded up as df(1) rounds it; PEAK the
most the device held since the daemon started.

The second table has a line for each user and device where the user holds
something (and for you, whether or not you do): USED counts segments
wherever their bytes are, on the device or evicted, and those unlinked
but still open; QUOTA is the user's ('gpushm daemon --user-quota'), "-"
where none applies (root has none); SEGMENTS is how many the user holds
there ("N of M" against --user-segments; a line for "all" devices carries
the limits that count every device).

-o wide adds each device's name, UUID, free memory and segments, and the
daemon's own segment limit; -o json and -o yaml print the same figures in
bytes (docs/cli.md, "Output").`,
		Example: `  gpushm df
  gpushm df -o wide
  gpushm df -o json | jq '.users[] | select(.user == "alice")'`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			return failed("df", "", df(cmd.Context(), os.Stdout, sizes))
		},
	}
	cmd.Flags().BoolVar(&sizes, "bytes", false, "print sizes in bytes")
	// No names to print: df is about memory, not segments.
	addOutput(cmd, false, "json", "yaml", "wide")
	return cmd
}

// dfReport is what df prints: -o json and -o yaml print it as it is.
type dfReport struct {
	Tiers []dfTier `json:"tiers"`
	Users []dfUser `json:"users"`
	// Segments is the daemon's own limit on segments held, for all users
	// (a channel counts as 2), when one is set.
	Segments *dfCount `json:"segments,omitempty"`
}

// dfTier is one device's own memory (Tier "gpu", as the protocol names
// it whatever the backend), or host memory holding evicted segments
// (Tier "host").
type dfTier struct {
	Tier   string `json:"tier"`
	Device *int   `json:"device,omitempty"`
	Name   string `json:"name,omitempty"`
	UUID   string `json:"uuid,omitempty"`
	// Size bounds Used, as Limit says: "budget", "max_memory", "memory"
	// (the device's) or "host_budget"; 0 with "host_budget" is eviction
	// turned off.
	Size  int64  `json:"size_bytes"`
	Limit string `json:"limit"`
	Used  int64  `json:"used_bytes"`
	Avail int64  `json:"avail_bytes"`
	Peak  int64  `json:"peak_bytes,omitempty"`
	// Free is the device's free memory as the driver (or the kernel)
	// says, everyone's allocations counted.
	Free int64 `json:"free_bytes,omitempty"`
	// Copies is host memory holding copies of segments back on their
	// device, which go first when an eviction needs room.
	Copies   int64 `json:"copy_bytes,omitempty"`
	Segments int   `json:"segments"`
	// Shown is whether the text table has this line: host memory for
	// evicted segments only where something may be evicted.
	shown bool
}

// dfUser is what one user holds, on all devices and on each.
type dfUser struct {
	UID  uint32 `json:"uid"`
	User string `json:"user"`
	// Used and Segments count every device; Quota and SegmentQuota are
	// the limits on them (0: none).
	Used         int64          `json:"used_bytes"`
	Quota        int64          `json:"quota_bytes,omitempty"`
	Segments     int            `json:"segments"`
	SegmentQuota int64          `json:"segment_quota,omitempty"`
	Devices      []dfUserDevice `json:"devices"`
}

type dfUserDevice struct {
	Device   int   `json:"device"`
	Used     int64 `json:"used_bytes"`
	Quota    int64 `json:"quota_bytes,omitempty"`
	Segments int   `json:"segments"`
}

type dfCount struct {
	Used  int64 `json:"used"`
	Limit int64 `json:"limit"`
}

func df(ctx context.Context, out io.Writer, sizes bool) error {
	c, err := dial(ctx)
	if err != nil {
		return err
	}
	defer c.Close()
	inf, err := c.Info(ctx)
	if err != nil {
		return err
	}
	r := dfOf(inf)
	if structured() {
		return writeValue(out, r)
	}
	return r.print(out, c.Backend(), sizes)
}

// dfOf reads the daemon's info: its devices, tiers, users and quotas.
func dfOf(inf *gpushm.Info) dfReport {
	var r dfReport
	maxMemory := map[int]int64{}
	userBytes, userSegs := map[uint32]int64{}, map[uint32]int64{}
	userDev := map[[2]int64]int64{}
	users := map[uint32]*dfUser{}
	user := func(uid uint32) *dfUser {
		if users[uid] == nil {
			users[uid] = &dfUser{UID: uid, User: userName(uid)}
		}
		return users[uid]
	}
	device := func(u *dfUser, d int) *dfUserDevice {
		for i := range u.Devices {
			if u.Devices[i].Device == d {
				return &u.Devices[i]
			}
		}
		u.Devices = append(u.Devices, dfUserDevice{Device: d})
		return &u.Devices[len(u.Devices)-1]
	}
	for _, q := range inf.Quotas {
		uid, dev, _ := strings.Cut(q.Scope, "/")
		n, _ := strconv.ParseUint(uid, 10, 32)
		d, _ := strconv.Atoi(dev)
		switch q.Kind {
		case "device_bytes":
			d, _ = strconv.Atoi(q.Scope)
			maxMemory[d] = q.Limit
		case "segments":
			r.Segments = &dfCount{q.Used, q.Limit}
		case "user_bytes":
			userBytes[uint32(n)] = q.Limit
			user(uint32(n))
		case "user_segments":
			userSegs[uint32(n)] = q.Limit
			user(uint32(n))
		case "user_device_bytes":
			userDev[[2]int64{int64(n), int64(d)}] = q.Limit
			device(user(uint32(n)), d)
		}
	}
	perDevice := map[int]int{}
	for _, u := range inf.Users {
		e := user(u.UID)
		e.Used += u.Bytes
		e.Segments += u.Segments
		ud := device(e, u.Device)
		ud.Used, ud.Segments = u.Bytes, u.Segments
		perDevice[u.Device] += u.Segments
	}
	for _, u := range users {
		u.Quota, u.SegmentQuota = userBytes[u.UID], userSegs[u.UID]
		for i := range u.Devices {
			u.Devices[i].Quota = userDev[[2]int64{int64(u.UID), int64(u.Devices[i].Device)}]
		}
		slices.SortFunc(u.Devices, func(a, b dfUserDevice) int { return cmp.Compare(a.Device, b.Device) })
		r.Users = append(r.Users, *u)
	}
	slices.SortFunc(r.Users, func(a, b dfUser) int { return cmp.Compare(a.UID, b.UID) })

	tiers := map[int]wire.DeviceTier{}
	evictable := false
	if inf.Tiers != nil {
		for _, t := range inf.Tiers.Devices {
			tiers[t.Device] = t
			evictable = evictable || t.Budget > 0
		}
	}
	for _, d := range inf.Devices {
		t := dfTier{Tier: "gpu", Device: &d.Index, Name: d.Name, UUID: d.UUID, Free: int64(d.FreeBytes),
			Size: int64(d.TotalBytes), Limit: "memory", Segments: perDevice[d.Index], shown: true}
		dt := tiers[d.Index]
		t.Used, t.Peak = dt.Bytes, dt.Peak
		if b := dt.Budget; b > 0 && b <= t.Size {
			t.Size, t.Limit = b, "budget"
		}
		if m := maxMemory[d.Index]; m > 0 && m < t.Size {
			t.Size, t.Limit = m, "max_memory"
		}
		t.Avail = max(0, min(t.Size-t.Used, t.Free))
		r.Tiers = append(r.Tiers, t)
	}
	if h := inf.Tiers; h != nil {
		r.Tiers = append(r.Tiers, dfTier{Tier: "host", Size: h.HostBudget, Limit: "host_budget",
			Used: h.HostBytes, Copies: h.CleanBytes, Avail: max(0, h.HostBudget-h.HostBytes),
			shown: h.HostBudget > 0 && (evictable || h.HostBytes > 0)})
	}
	return r
}

func (r dfReport) print(out io.Writer, backend string, sizes bool) error {
	size := bytesize.Format
	if sizes {
		size = func(n int64) string { return strconv.FormatInt(n, 10) }
	}
	wide := output == "wide"
	w := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	header := "DEVICE\tTIER\tSIZE\tUSED\tAVAIL\tUSE%\tPEAK\tLIMIT"
	if wide {
		header += "\tSEGMENTS\tFREE\tNAME\tUUID"
	}
	fmt.Fprintln(w, header)
	for _, t := range r.Tiers {
		if !t.shown {
			continue
		}
		dev, peak := "-", "-"
		if t.Device != nil {
			dev, peak = strconv.Itoa(*t.Device), size(t.Peak)
		}
		name := tier(backend, &gpushm.SegmentInfo{Tier: t.Tier})
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s", dev, name, size(t.Size), size(t.Used),
			size(t.Avail), percent(t.Used, t.Size), peak, strings.ReplaceAll(t.Limit, "_", " "))
		if wide {
			segs, free := "-", "-"
			if t.Device != nil {
				segs, free = strconv.Itoa(t.Segments), size(t.Free)
			}
			fmt.Fprintf(w, "\t%s\t%s\t%s\t%s", segs, free, orDash(t.Name), orDash(t.UUID))
		}
		fmt.Fprintln(w)
	}
	if err := w.Flush(); err != nil {
		return err
	}
	if len(r.Users) > 0 {
		fmt.Fprintln(out)
		w = tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
		fmt.Fprintln(w, "USER\tDEVICE\tUSED\tQUOTA\tAVAIL\tUSE%\tSEGMENTS")
		row := func(who, dev string, used, quota int64, segs int, segQuota int64) {
			q, avail, pct := "-", "-", "-"
			if quota > 0 {
				q, avail, pct = size(quota), size(max(0, quota-used)), percent(used, quota)
			}
			n := strconv.Itoa(segs)
			if segQuota > 0 {
				n += " of " + strconv.FormatInt(segQuota, 10)
			}
			fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", who, dev, size(used), q, avail, pct, n)
		}
		for _, u := range r.Users {
			// The limits that count every device take a line of their
			// own, unless the user is on one device, whose line then
			// says how many segments of its limit it holds.
			all := u.Quota > 0 || u.SegmentQuota > 0 && len(u.Devices) > 1
			for _, d := range u.Devices {
				segQuota := int64(0)
				if !all {
					segQuota = u.SegmentQuota
				}
				row(u.User, strconv.Itoa(d.Device), d.Used, d.Quota, d.Segments, segQuota)
			}
			if all || len(u.Devices) == 0 {
				row(u.User, "all", u.Used, u.Quota, u.Segments, u.SegmentQuota)
			}
		}
		if err := w.Flush(); err != nil {
			return err
		}
	}
	if wide && r.Segments != nil {
		fmt.Fprintf(out, "\nsegments: %d of the daemon's %d (all users; a channel counts as 2)\n", r.Segments.Used, r.Segments.Limit)
	}
	return nil
}

// percent is used of total as df(1) prints it: rounded up, so that 1 byte
// in use is not 0%; "-" of nothing.
func percent(used, total int64) string {
	if total <= 0 {
		return "-"
	}
	return strconv.FormatInt((used*100+total-1)/total, 10) + "%"
}
