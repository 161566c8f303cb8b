package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/fairshare"
)

// fairUIDs are the users of TestHostileFairShare: eight fill their limits,
// the ninth comes after them.
var fairUIDs = []int{4251, 4252, 4253, 4254, 4255, 4256, 4257, 4258, 4259}

const (
	fairMaxSegments    = 400
	fairMaxConnections = 200
)

// TestHostileFairShare: eight users each fill their segments and their
// connections until refused, one after another; a ninth user and root
// still connect and create, and a user above its fair share is refused
// with the rule and its numbers (docs/security.md, "Fair shares").
func TestHostileFairShare(t *testing.T) {
	requireUsers(t)
	dir := socketDir(t)
	os.Chmod(dir, 0o755)
	sock := filepath.Join(dir, "gpushm.sock")
	startLimited(t, sock, testNOFILE, "--max-segments", strconv.Itoa(fairMaxSegments),
		"--max-connections", strconv.Itoa(fairMaxConnections))
	ctx := context.Background()
	// Root shares a segment, which the users' work reads.
	root, err := gpushm.Dial(ctx, sock)
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	shared, _ := shareRootBytes(t, root, "shared", 4096)
	shared.Close()
	segs := fairshare.Shares{Cap: fairMaxSegments}
	conns := fairshare.Shares{Cap: fairMaxConnections}
	userSegs, userConns := fairMaxSegments/4, fairMaxConnections/4

	var users []*userClient
	for _, uid := range fairUIDs[:8] {
		users = append(users, startUserClient(t, sock, uid))
	}

	t.Run("segments", func(t *testing.T) {
		var took []int
		for i, uc := range users {
			n, code, msg := uc.ask(t, fmt.Sprintf("create s%d- 100000 4096", uc.uid))
			took = append(took, n)
			if code != "ENOSPC" || !strings.Contains(msg, "per user") && !strings.Contains(msg, "fair share of segments") {
				t.Fatalf("uid %d: %d segments, then %s %q; want ENOSPC naming a limit", uc.uid, n, code, msg)
			}
			t.Logf("uid %d: %d segments, then %s", uc.uid, n, msg)
			if i >= 4 && n != int(segs.Small()) {
				t.Errorf("uid %d, past the others' limits, made %d segments, want the reserve's %d", uc.uid, n, segs.Small())
			}
		}
		// With root's one, two users fill half the daemon and go on to
		// their limit (under their fair share, 350/2), a third to its limit
		// (under 350/3), a fourth what is left below the reserve (350), the
		// others Small each from the reserve.
		want := []int{userSegs, userSegs, userSegs, 49, 4, 4, 4, 4}
		if fmt.Sprint(took) != fmt.Sprint(want) {
			t.Errorf("users made %v segments, want %v", took, want)
		}
		// The fourth user holds 49, above its fair share (350/8) and the
		// reserve's Small: refused for the fair share, not a limit of its own.
		fourth := users[3]
		_, code, msg := fourth.ask(t, fmt.Sprintf("create more%d- 1 4096", fourth.uid))
		wantMsg := fmt.Sprintf("fair share of segments (a channel counts as 2): uid %d holds %d and asked for 1 more, while the daemon holds 366 of its limit of %d, and the last %d are kept for users holding at most %d, and for root",
			fourth.uid, took[3], fairMaxSegments, segs.Reserve(), segs.Small())
		if code != "ENOSPC" || !strings.Contains(msg, wantMsg) {
			t.Errorf("a user above its fair share: %s %q, want ENOSPC %q", code, msg, wantMsg)
		}
	})

	t.Run("connections", func(t *testing.T) {
		var held []int
		for _, uc := range users {
			n, code, msg := uc.ask(t, "conns 100000")
			held = append(held, n+1) // and the client's own
			if code != "EAGAIN" || !strings.Contains(msg, "connections per user") && !strings.Contains(msg, "fair share of connections") {
				t.Fatalf("uid %d: %d connections, then %s %q; want EAGAIN naming a limit", uc.uid, n, code, msg)
			}
			t.Logf("uid %d: %d more connections, then %s", uc.uid, n, msg)
		}
		// The first user stopped at its own limit; the second, which went on
		// past half the daemon's limit when others held less, is above its
		// fair share now.
		if held[0] != userConns {
			t.Errorf("uid %d held %d connections, want its limit %d", users[0].uid, held[0], userConns)
		}
		_, code, msg := users[1].ask(t, "conns 1")
		wantMsg := fmt.Sprintf("fair share of connections: uid %d holds %d and asked for 1 more", users[1].uid, held[1])
		if code != "EAGAIN" || !strings.Contains(msg, wantMsg) {
			t.Errorf("a user above its fair share: %s %q, want EAGAIN %q", code, msg, wantMsg)
		}
	})

	t.Run("ninth user", func(t *testing.T) {
		// Its client connects as it starts, then opens one more connection
		// (two of the reserve's, conns.Small()), and works: creates, writes,
		// opens and reads back a segment.
		uc := startUserClient(t, sock, fairUIDs[8])
		if n, code, msg := uc.ask(t, fmt.Sprintf("conns %d", conns.Small()-1)); n != int(conns.Small()-1) || code != "OK" {
			t.Fatalf("uid %d: %d connections: %s %s", uc.uid, n, code, msg)
		}
		if n, code, msg := uc.ask(t, fmt.Sprintf("create s%d- %d 4096", uc.uid, segs.Small()-1)); n != int(segs.Small()-1) || code != "OK" {
			t.Fatalf("uid %d: %d segments: %s %s", uc.uid, n, code, msg)
		}
		uc.works(t, "eight users were at their limits")
	})

	t.Run("root", func(t *testing.T) {
		root, err := gpushm.Dial(ctx, sock)
		if err != nil {
			t.Fatalf("root could not connect with nine users at their limits: %v", err)
		}
		defer root.Close()
		for i := range segs.RootReserve() {
			if _, _, err := root.CreateOnly(ctx, fmt.Sprint("root", i), 4096, nil); err != nil {
				t.Fatalf("root's segment %d of its reserve of %d: %v", i, segs.RootReserve(), err)
			}
		}
	})
}
