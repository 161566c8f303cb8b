package gpushm_test

import (
	"bytes"
	"context"
	"fmt"
	"testing"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/testdaemon"
)

// takeoverUID is the attacker of TestNameTakeover, the uid of the report
// that found the hole (issue 39).
const takeoverUID = 65011

// TestNameTakeover plays a user who tries to take a name from root with a
// next version (docs/security.md, "Names and versions"): a process of its
// own, as another uid, speaking the protocol by hand on one connection. It
// makes a next version while the name names nothing, or its own segment
// that it then gives up; root then creates the name, and the user commits.
// The commit must be refused, and root's segment stay what the name
// names, root's, with root's bytes. A next version made by the owner of
// what the name names still commits.
func TestNameTakeover(t *testing.T) {
	d := testdaemon.Start(t, "host")
	ctx := context.Background()
	root := dial(t, d.Socket)
	user := startRawUser(t, d.Socket, takeoverUID, takeoverUID)
	mode := uint32(0o644)
	rootBytes := []byte("root's bytes")
	rootWrites := func(seg *gpushm.Segment) uint64 {
		t.Helper()
		defer seg.Close()
		m, err := seg.Map()
		if err != nil {
			t.Fatal(err)
		}
		copy(m.Bytes(), rootBytes)
		return seg.ID()
	}
	rootCreates := func(name string) uint64 {
		t.Helper()
		seg, err := root.Create(ctx, name, 4096, &gpushm.CreateOptions{Mode: &mode})
		if err != nil {
			t.Fatal(err)
		}
		return rootWrites(seg)
	}
	userCreates := func(name string) {
		t.Helper()
		if rep := user.do(t, fmt.Sprintf(`{"op":"create","name":%q,"size":4096,"mode":420}`, name)); rep.Error != nil {
			t.Fatalf("uid %d creates %q: %v", takeoverUID, name, rep.Error)
		}
	}
	tests := []struct {
		name    string
		mine    bool // the user has the name when it makes the next version
		between func(name string) (rootID uint64)
		want    string // the commit's error code; "" for none
	}{
		{"a name nobody has, then root creates it", false,
			func(name string) uint64 { return rootCreates(name) }, "EEXIST"},
		{"its own name, unlinked, then root creates it", true,
			func(name string) uint64 {
				if rep := user.do(t, fmt.Sprintf(`{"op":"unlink","name":%q}`, name)); rep.Error != nil {
					t.Fatal(rep.Error)
				}
				return rootCreates(name)
			}, "EEXIST"},
		{"its own name, renamed away, then root creates it", true,
			func(name string) uint64 {
				if rep := user.do(t, fmt.Sprintf(`{"op":"rename","name":%q,"to":%q}`, name, name+"-away")); rep.Error != nil {
					t.Fatal(rep.Error)
				}
				return rootCreates(name)
			}, "EEXIST"},
		{"its own name, then given to root", true,
			func(name string) uint64 {
				if err := root.Chown(ctx, name, 0, 0); err != nil {
					t.Fatal(err)
				}
				seg, err := root.Open(ctx, name, nil)
				if err != nil {
					t.Fatal(err)
				}
				return rootWrites(seg)
			}, "EPERM"},
		{"its own name, kept", true, nil, ""},
	}
	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			name := fmt.Sprint("v", i+1)
			if tc.mine {
				userCreates(name)
			}
			rep := user.do(t, fmt.Sprintf(`{"op":"create","name":%q,"size":4096,"open":true,"uncommitted":true,"next_version":true}`, name))
			if rep.Error != nil {
				t.Fatalf("uid %d makes a next version of %q: %v", takeoverUID, name, rep.Error)
			}
			next := rep.Segment.ID
			var rootID uint64
			if tc.between != nil {
				rootID = tc.between(name)
			}
			rep = user.do(t, fmt.Sprintf(`{"op":"commit","segment":%d}`, next))
			inf, err := root.Stat(ctx, name)
			if err != nil {
				t.Fatal(err)
			}
			if tc.want == "" {
				if rep.Error != nil || inf.ID != next || inf.UID != takeoverUID || inf.Version != 2 {
					t.Fatalf("the owner's commit = %v; the name names %d (uid %d, version %d), want %d, version 2",
						rep.Error, inf.ID, inf.UID, inf.Version, next)
				}
				return
			}
			if rep.Error == nil || rep.Error.Code != tc.want {
				t.Fatalf("uid %d's commit over root's %q = %+v, want %s", takeoverUID, name, rep.Error, tc.want)
			}
			t.Logf("refused: %s", rep.Error.Message)
			if inf.ID != rootID || inf.UID != 0 || inf.GID != 0 {
				t.Fatalf("after the refused commit %q names %d (owner %d:%d), want root's %d", name, inf.ID, inf.UID, inf.GID, rootID)
			}
			seg, err := root.Open(ctx, name, &gpushm.OpenOptions{ReadOnly: true})
			if err != nil {
				t.Fatal(err)
			}
			defer seg.Close()
			m, err := seg.Map()
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.HasPrefix(m.Bytes(), rootBytes) {
				t.Fatalf("root's %q holds %q", name, m.Bytes()[:len(rootBytes)])
			}
		})
	}
}
