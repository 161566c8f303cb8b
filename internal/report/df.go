package report

import (
	"cmp"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/bytesize"
	"github.com/gpushm/gpushm/internal/owner"
	"github.com/gpushm/gpushm/internal/wire"
)

// DF is what df prints: -o json and -o yaml print it as it is.
type DF struct {
	Tiers []DFTier `json:"tiers"`
	Users []DFUser `json:"users"`
	// Segments is the daemon's own limit on segments held, for all users
	// (a channel counts as 2), when one is set.
	Segments *DFCount `json:"segments,omitempty"`
}

// DFTier is one device's own memory (Tier "gpu", as the protocol names
// it whatever the backend), or host memory holding evicted segments
// (Tier "host").
type DFTier struct {
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

// DFUser is what one user holds, on all devices and on each.
type DFUser struct {
	UID  uint32 `json:"uid"`
	User string `json:"user"`
	// Used and Segments count every device; Quota and SegmentQuota are
	// the limits on them (0: none).
	Used         int64          `json:"used_bytes"`
	Quota        int64          `json:"quota_bytes,omitempty"`
	Segments     int            `json:"segments"`
	SegmentQuota int64          `json:"segment_quota,omitempty"`
	Devices      []DFUserDevice `json:"devices"`
}

// DFUserDevice is what a user holds on one device, and its quota there.
type DFUserDevice struct {
	Device   int   `json:"device"`
	Used     int64 `json:"used_bytes"`
	Quota    int64 `json:"quota_bytes,omitempty"`
	Segments int   `json:"segments"`
}

// DFCount is a count against its limit.
type DFCount struct {
	Used  int64 `json:"used"`
	Limit int64 `json:"limit"`
}

// DFOf reads the daemon's info: its devices, tiers, users and quotas.
func DFOf(inf *gpushm.Info) DF {
	var r DF
	maxMemory := map[int]int64{}
	userBytes, userSegs := map[uint32]int64{}, map[uint32]int64{}
	userDev := map[[2]int64]int64{}
	users := map[uint32]*DFUser{}
	user := func(uid uint32) *DFUser {
		if users[uid] == nil {
			users[uid] = &DFUser{UID: uid, User: owner.User(uid)}
		}
		return users[uid]
	}
	device := func(u *DFUser, d int) *DFUserDevice {
		for i := range u.Devices {
			if u.Devices[i].Device == d {
				return &u.Devices[i]
			}
		}
		u.Devices = append(u.Devices, DFUserDevice{Device: d})
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
			r.Segments = &DFCount{q.Used, q.Limit}
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
		slices.SortFunc(u.Devices, func(a, b DFUserDevice) int { return cmp.Compare(a.Device, b.Device) })
		r.Users = append(r.Users, *u)
	}
	slices.SortFunc(r.Users, func(a, b DFUser) int { return cmp.Compare(a.UID, b.UID) })

	tiers := map[int]wire.DeviceTier{}
	evictable := false
	if inf.Tiers != nil {
		for _, t := range inf.Tiers.Devices {
			tiers[t.Device] = t
			evictable = evictable || t.Budget > 0
		}
	}
	for _, d := range inf.Devices {
		t := DFTier{Tier: "gpu", Device: &d.Index, Name: d.Name, UUID: d.UUID, Free: int64(d.FreeBytes),
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
		r.Tiers = append(r.Tiers, DFTier{Tier: "host", Size: h.HostBudget, Limit: "host_budget",
			Used: h.HostBytes, Copies: h.CleanBytes, Avail: max(0, h.HostBudget-h.HostBytes),
			shown: h.HostBudget > 0 && (evictable || h.HostBytes > 0)})
		if d := h.Disk; d != nil {
			t := DFTier{Tier: "disk", Size: d.Budget, Limit: "disk_budget", Used: d.Bytes, Segments: d.Segments, shown: true}
			if d.Budget > 0 {
				t.Avail = max(0, d.Budget-d.Bytes)
			}
			r.Tiers = append(r.Tiers, t)
		}
	}
	return r
}

// Write writes r as df's tables: sizes in bytes with sizes, and with wide
// each device's name, UUID, free memory and segments, and the daemon's
// own segment limit.
func (r DF) Write(out io.Writer, backend string, sizes, wide bool) error {
	size := bytesize.Format
	if sizes {
		size = func(n int64) string { return strconv.FormatInt(n, 10) }
	}
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
		name := Tier(backend, &gpushm.SegmentInfo{Tier: t.Tier})
		sz, avail, limit := size(t.Size), size(t.Avail), strings.ReplaceAll(t.Limit, "_", " ")
		if t.Tier == "disk" && t.Size == 0 {
			sz, avail, limit = "-", "-", "no budget" // what the disk has room for is df's of the directories
		}
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s", dev, name, sz, size(t.Used),
			avail, percent(t.Used, t.Size), peak, limit)
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
