package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/user"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"sigs.k8s.io/yaml"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/wire"
)

// output is the -o of the command that runs: "" (text), "json", "yaml",
// "wide" or "name", as kubectl has them. Every command that prints takes
// it, and an error is printed in its format too (exit.go), so it is one
// variable for the process.
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
				return usagef(cmd, "%s: give -o %s or --json, not both", cmd.Name(), output)
			}
			output = "json"
		}
		if output != "" && !slices.Contains(formats, output) {
			return usagef(cmd, "%s: -o %s: want %s", cmd.Name(), output, strings.Join(formats, ", "))
		}
		if prev != nil {
			return prev(cmd, args)
		}
		return nil
	}
}

// scanOutput finds -o in args before cobra parses them, so that an error
// in parsing (an unknown flag) is printed in the format asked for too.
func scanOutput(args []string) string {
	for i, a := range args {
		switch {
		case a == "--":
			return ""
		case a == "--json":
			return "json"
		case (a == "-o" || a == "--output") && i+1 < len(args):
			return args[i+1]
		case strings.HasPrefix(a, "--output="):
			return strings.TrimPrefix(a, "--output=")
		case strings.HasPrefix(a, "-o"):
			return strings.TrimPrefix(strings.TrimPrefix(a, "-o"), "=")
		}
	}
	return ""
}

// structured says whether output is for programs (json or yaml).
func structured() bool { return output == "json" || output == "yaml" }

// printValue writes v to standard output as JSON (indented) or YAML.
func printValue(v any) error {
	return writeValue(os.Stdout, v)
}

func writeValue(w io.Writer, v any) error {
	if output == "yaml" {
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

// printNames writes each name on a line of its own (-o name).
func printNames(names ...string) {
	for _, n := range names {
		fmt.Println(n)
	}
}

// segmentView is a segment as -o json and -o yaml print it: the
// protocol's fields (docs/protocol.md, "Segment object") by their names,
// but for people as much as programs: the mode in octal as chmod takes it,
// times in RFC 3339, and the owner's and group's names beside their
// numbers.
type segmentView struct {
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
	Version     uint64             `json:"version,omitempty"`
	Versions    []wire.HeldVersion `json:"versions,omitempty"`
}

func viewOf(s *gpushm.SegmentInfo) segmentView {
	return segmentView{
		ID: s.ID, Name: s.Name, Size: s.Size, AllocSize: s.AllocSize, Device: s.Device, UUID: s.UUID,
		HandleType: s.HandleType, UID: s.UID, Owner: userName(s.UID), GID: s.GID, Group: groupName(s.GID),
		Mode: fmt.Sprintf("%04o", s.Mode), Opens: s.Opens, Created: unixTime(s.Created), Meta: s.Meta,
		Lifetime: s.Lifetime, TTL: s.TTL, IdleSince: optTime(s.Idle), Orphan: s.Orphan, Channel: s.Channel,
		Uncommitted: s.Uncommitted, Tier: s.Tier, LastOpen: optTime(s.LastOpen), Pinned: s.Pinned,
		Version: s.Version, Versions: s.Versions,
	}
}

func viewsOf(segs []gpushm.SegmentInfo) []segmentView {
	out := make([]segmentView, 0, len(segs))
	for i := range segs {
		out = append(out, viewOf(&segs[i]))
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

// groupName is gid's name, or the number.
func groupName(gid uint32) string {
	id := strconv.FormatUint(uint64(gid), 10)
	if g, err := user.LookupGroupId(id); err == nil {
		return g.Name
	}
	return id
}

// copyResult is what put and get say with -o json and -o yaml.
type copyResult struct {
	Name string `json:"name"`
	// File is the file, or the directory, copied from or to: "-" for
	// standard input or output.
	File    string  `json:"file"`
	Bytes   int64   `json:"bytes"`
	Seconds float64 `json:"seconds"`
	// Copier is who copied: "daemon" or "client" (this process).
	Copier string `json:"copier"`
	// CRC32C is the file's CRC-32C as put recorded it in the bundle's
	// origin (safetensors files read by name).
	CRC32C string `json:"crc32c,omitempty"`
	// Segment is the segment put made, as committed.
	Segment *segmentView `json:"segment,omitempty"`
}

func (r *copyResult) finish(start time.Time) { r.Seconds = time.Since(start).Seconds() }

// printCopy prints r as -o asks: nothing for text, where put and get say
// what they did on standard error, and on a terminal only.
func printCopy(r copyResult) error {
	switch {
	case structured():
		return printValue(r)
	case output == "name":
		printNames(r.Name)
	}
	return nil
}
