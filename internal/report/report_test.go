package report

import (
	"bytes"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/wire"
)

// TestSelect: names and globs select segments; a name that names none is
// missing, a pattern that matches none is not.
func TestSelect(t *testing.T) {
	all := []gpushm.SegmentInfo{{Name: "llama-7b"}, {Name: "llama-70b"}, {Name: "kv"}}
	names := func(segs []gpushm.SegmentInfo) string {
		var s []string
		for _, g := range segs {
			s = append(s, g.Name)
		}
		return strings.Join(s, " ")
	}
	for _, tc := range []struct {
		args          []string
		want, missing string
	}{
		{nil, "llama-7b llama-70b kv", ""},
		{[]string{"llama-*"}, "llama-7b llama-70b", ""},
		{[]string{"kv", "nope", "x*"}, "kv", "nope"},
	} {
		segs, missing := Select(all, tc.args)
		if names(segs) != tc.want || strings.Join(missing, " ") != tc.missing {
			t.Errorf("Select(%q) = %q, missing %q; want %q, missing %q", tc.args, names(segs), missing, tc.want, tc.missing)
		}
	}
	if err := CheckPatterns([]string{"a[", "b"}); err == nil {
		t.Error("CheckPatterns took a pattern path.Match cannot read")
	}
}

// TestWords: how a segment ends and where it is, in the words ls uses,
// which name host memory as such on the host backend.
func TestWords(t *testing.T) {
	idle := time.Now().Add(-4 * time.Minute).UnixNano()
	for _, tc := range []struct {
		s    gpushm.SegmentInfo
		want string
	}{
		{gpushm.SegmentInfo{}, "-"},
		{gpushm.SegmentInfo{Lifetime: "connection"}, "creator"},
		{gpushm.SegmentInfo{Uncommitted: true}, "incomplete"},
		{gpushm.SegmentInfo{Orphan: "its creator's lease was not reclaimed"}, "orphaned"},
		{gpushm.SegmentInfo{Channel: &wire.Channel{Slots: 4}}, "channel of 4"},
		{gpushm.SegmentInfo{TTL: 600, Opens: 1}, "ttl 10m0s (open)"},
		{gpushm.SegmentInfo{TTL: 600, Idle: idle}, "ttl 10m0s (6m0s left)"},
	} {
		if got := Lifetime(&tc.s); got != tc.want {
			t.Errorf("Lifetime(%+v) = %q, want %q", tc.s, got, tc.want)
		}
	}
	for _, tc := range []struct {
		backend, tier string
		pinned        bool
		want          string
	}{
		{"cuda", "gpu", true, "gpu, pinned"},
		{"cuda", "host", false, "host"},
		{"host", "gpu", false, "host memory"},
		{"host", "host", false, "evicted"},
		{"cuda", "", false, "-"},
	} {
		if got := Tier(tc.backend, &gpushm.SegmentInfo{Tier: tc.tier, Pinned: tc.pinned}); got != tc.want {
			t.Errorf("Tier(%s, %s, pinned %v) = %q, want %q", tc.backend, tc.tier, tc.pinned, got, tc.want)
		}
	}
	for d, want := range map[time.Duration]string{59 * time.Second: "59s", 90 * time.Minute: "1h", 47 * time.Hour: "47h", 72 * time.Hour: "3d"} {
		if got := age(d); got != want {
			t.Errorf("age(%s) = %q, want %q", d, got, want)
		}
	}
}

// TestDF: df's figures from the daemon's info: a budget bounds a device
// where it is below its memory, a user's use adds up over devices, and
// USE% rounds up.
func TestDF(t *testing.T) {
	inf := &gpushm.Info{
		Devices: []gpushm.Device{{Index: 0, Name: "H100", TotalBytes: 80 << 30, FreeBytes: 70 << 30}},
		Tiers:   &gpushm.Tiers{Devices: []wire.DeviceTier{{Device: 0, Budget: 64 << 30, Bytes: 1, Peak: 2 << 30}}, HostBudget: 1 << 40},
		Users:   []gpushm.UserUse{{UID: 0, Device: 0, Bytes: 1, Segments: 1}},
		Quotas:  []gpushm.Quota{{Kind: "user_bytes", Scope: "0", Limit: 10 << 30}},
	}
	r := DFOf(inf)
	if len(r.Tiers) != 2 || r.Tiers[0].Limit != "budget" || r.Tiers[0].Size != 64<<30 || r.Tiers[0].Avail != 64<<30-1 {
		t.Fatalf("DFOf: tiers %+v", r.Tiers)
	}
	if len(r.Users) != 1 || r.Users[0].Used != 1 || r.Users[0].Quota != 10<<30 || len(r.Users[0].Devices) != 1 {
		t.Fatalf("DFOf: users %+v", r.Users)
	}
	var b bytes.Buffer
	if err := r.Write(&b, "cuda", false, false); err != nil {
		t.Fatal(err)
	}
	if !regexp.MustCompile(`(?m)^0 +gpu +64 GiB +1 B +64\.0 GiB +1% +2 GiB +budget$`).MatchString(b.String()) {
		t.Errorf("df's table:\n%s", b.String())
	}
}
