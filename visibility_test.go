package gpushm_test

import (
	"context"
	"fmt"
	"os"
	"slices"
	"testing"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/testdaemon"
	"github.com/gpushm/gpushm/internal/wire"
)

// TestOthersSee plays a user reading what the daemon says of root's
// segments (docs/security.md, "What others may see"), as a process of its
// own under another uid, by hand on the socket: of a 0600 segment it sees
// what ls -l shows of a file (name, size, owner, mode, version, leases),
// not its meta (a bundle's origin paths) nor the pids of the processes
// holding its old versions; of a 0644 one it sees those too.
func TestOthersSee(t *testing.T) {
	d := testdaemon.Start(t, "host")
	ctx := context.Background()
	root := dial(t, d.Socket)
	meta := func(dir string) []byte { return fmt.Appendf(nil, `{"origin":{"dir":%q}}`, dir) }
	for name, mode := range map[string]uint32{"secret": 0o600, "shared": 0o644} {
		// Version 1, held open by this process, then version 2.
		if _, _, err := root.CreateOnly(ctx, name, 4096, &gpushm.CreateOptions{Mode: &mode, Meta: meta("/root/" + name + "/1")}); err != nil {
			t.Fatal(err)
		}
		held, err := root.Open(ctx, name, &gpushm.OpenOptions{ReadOnly: true})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { held.Close() })
		next, err := root.Create(ctx, name, 4096, &gpushm.CreateOptions{NextVersion: true, Meta: meta("/root/" + name + "/2")})
		if err != nil {
			t.Fatal(err)
		}
		if err := next.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		next.Close()
	}
	user := startRawUser(t, d.Socket, 65012, 65012)
	listed := map[string]wire.Segment{}
	rep := user.do(t, `{"op":"list"}`)
	if rep.Error != nil {
		t.Fatal(rep.Error)
	}
	for _, s := range rep.Segments {
		listed[s.Name] = s
	}
	for _, tc := range []struct {
		name     string
		mode     uint32
		readable bool
	}{{"secret", 0o600, false}, {"shared", 0o644, true}} {
		rep := user.do(t, fmt.Sprintf(`{"op":"stat","name":%q}`, tc.name))
		if rep.Error != nil {
			t.Fatalf("stat %q as another user: %v", tc.name, rep.Error)
		}
		s := rep.Segment
		// What ls -l shows, readable or not.
		if s.Name != tc.name || s.Size != 4096 || s.UID != 0 || s.GID != 0 || s.Mode != tc.mode || s.Version != 2 ||
			s.Created == 0 || s.Tier == "" || len(s.Versions) != 1 || s.Versions[0].Opens != 1 {
			t.Fatalf("stat %q as another user: %+v", tc.name, s)
		}
		pids := s.Versions[0].PIDs
		if tc.readable {
			if string(s.Meta) != string(meta("/root/"+tc.name+"/2")) || !slices.Contains(pids, os.Getpid()) {
				t.Fatalf("a %#o segment's meta %s and holders %v, want %s and %d among them", tc.mode, s.Meta, pids, meta("/root/"+tc.name+"/2"), os.Getpid())
			}
		} else if s.Meta != nil || pids != nil {
			t.Fatalf("another user sees a %#o segment's meta %s and holders %v, want neither", tc.mode, s.Meta, pids)
		}
		if l, ok := listed[tc.name]; !ok || l.Meta != nil || l.Mode != tc.mode || l.UID != 0 {
			t.Fatalf("list as another user shows %q as %+v (listed: %v)", tc.name, l, ok)
		}
	}
	// Root sees everything.
	inf, err := root.Stat(ctx, "secret")
	if err != nil {
		t.Fatal(err)
	}
	if inf.Meta == nil || len(inf.Versions) != 1 || !slices.Contains(inf.Versions[0].PIDs, os.Getpid()) {
		t.Fatalf("root's stat of its 0600 segment: %+v", inf)
	}
}
