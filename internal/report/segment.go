// Package report is what the commands print about segments, devices and
// copies: the views -o json and -o yaml print, with the protocol's field
// names, and the text tables and lines people read (ls, stat, df, info).
// The commands ask the daemon; this package only says what they got.
package report

import (
	"encoding/json"
	"fmt"
	"io"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/owner"
	"github.com/gpushm/gpushm/internal/wire"
)

// WriteValue writes v to w as format asks: YAML for "yaml", else JSON,
// indented.
func WriteValue(w io.Writer, format string, v any) error {
	if format == "yaml" {
		b, err := yaml.Marshal(v)
		if err != nil {
			return err
		}
		_, err = w.Write(b)
		return err
	}
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// Segment is a segment as -o json and -o yaml print it: the protocol's
// fields (docs/protocol.md, "Segment object") by their names, but for
// people as much as programs: the mode in octal as chmod takes it, times
// in RFC 3339, and the owner's and group's names beside their numbers.
type Segment struct {
	ID          uint64             `json:"id"`
	Name        string             `json:"name"`
	Size        int64              `json:"size"`
	AllocSize   int64              `json:"alloc_size"`
	Device      int                `json:"device"`
	UUID        string             `json:"uuid,omitempty"`
	HandleType  string             `json:"handle_type,omitempty"`
	UID         uint32             `json:"uid"`
	Owner       string             `json:"owner"`
	GID         uint32             `json:"gid"`
	Group       string             `json:"group"`
	Mode        string             `json:"mode"`
	Opens       int                `json:"opens"`
	Created     time.Time          `json:"created"`
	Meta        json.RawMessage    `json:"meta,omitempty"`
	Lifetime    string             `json:"lifetime,omitempty"`
	TTL         float64            `json:"ttl_seconds,omitempty"`
	IdleSince   *time.Time         `json:"idle_since,omitempty"`
	Orphan      string             `json:"orphan,omitempty"`
	Channel     *wire.Channel      `json:"channel,omitempty"`
	Uncommitted bool               `json:"uncommitted,omitempty"`
	Tier        string             `json:"tier,omitempty"`
	LastOpen    *time.Time         `json:"last_open,omitempty"`
	Pinned      bool               `json:"pinned,omitempty"`
	Persist     bool               `json:"persist,omitempty"`
	Synced      *time.Time         `json:"synced,omitempty"`
	Stale       bool               `json:"stale,omitempty"`
	Version     uint64             `json:"version,omitempty"`
	Versions    []wire.HeldVersion `json:"versions,omitempty"`
}

// SegmentOf is s as -o json and -o yaml print it.
func SegmentOf(s *gpushm.SegmentInfo) Segment {
	return Segment{
		ID: s.ID, Name: s.Name, Size: s.Size, AllocSize: s.AllocSize, Device: s.Device, UUID: s.UUID,
		HandleType: s.HandleType, UID: s.UID, Owner: owner.User(s.UID), GID: s.GID, Group: owner.Group(s.GID),
		Mode: fmt.Sprintf("%04o", s.Mode), Opens: s.Opens, Created: unixTime(s.Created), Meta: s.Meta,
		Lifetime: s.Lifetime, TTL: s.TTL, IdleSince: optTime(s.Idle), Orphan: s.Orphan, Channel: s.Channel,
		Uncommitted: s.Uncommitted, Tier: s.Tier, LastOpen: optTime(s.LastOpen), Pinned: s.Pinned,
		Persist: s.Persist, Synced: optTime(s.Synced), Stale: s.Stale,
		Version: s.Version, Versions: s.Versions,
	}
}

// Segments is SegmentOf of each of segs: an empty list, not null, for
// none.
func Segments(segs []gpushm.SegmentInfo) []Segment {
	out := make([]Segment, 0, len(segs))
	for i := range segs {
		out = append(out, SegmentOf(&segs[i]))
	}
	return out
}

// unixTime is a protocol time (Unix nanoseconds) in UTC, which JSON
// writes in RFC 3339.
func unixTime(ns int64) time.Time { return time.Unix(0, ns).UTC() }

// optTime is unixTime, or nil for 0 (never).
func optTime(ns int64) *time.Time {
	if ns == 0 {
		return nil
	}
	t := unixTime(ns)
	return &t
}

// Lifetime says how a segment ends: "-" (when removed), "creator" (with
// its creator's connection), or "ttl 10m (4m left)".
func Lifetime(s *gpushm.SegmentInfo) string {
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

// Tier says where a segment's bytes are: "gpu", "gpu, pinned" or "host".
// The protocol's "gpu" is the device's own memory, which a daemon of the
// host backend serves from host memory: it says so, and "evicted" for a
// segment moved out of it, lest a user without a GPU read "gpu".
func Tier(backend string, s *gpushm.SegmentInfo) string {
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

// Durable says where a durable segment's copy on disk stands.
func Durable(s *gpushm.SegmentInfo) string {
	switch {
	case s.Synced == 0:
		return "yes, not on disk yet"
	case s.Stale:
		return fmt.Sprintf("yes, on disk as of %s, opened to be written since (gpushm sync writes it again)", time.Unix(0, s.Synced).Format(time.RFC3339))
	}
	return fmt.Sprintf("yes, on disk as of %s", time.Unix(0, s.Synced).Format(time.RFC3339))
}

// opened is how long ago a segment was last opened ("-" if unknown).
func opened(s *gpushm.SegmentInfo) string {
	if s.LastOpen == 0 {
		return "-"
	}
	return age(time.Since(time.Unix(0, s.LastOpen)))
}

// age is d in its largest whole unit, as ls -l would put it in a column.
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

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
