package integration

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
	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/server"
	"github.com/gpushm/gpushm/internal/testutil"
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
	dir := testutil.SocketDir(t)
	os.Chmod(dir, 0o755)
	sock := filepath.Join(dir, "gpushm.sock")
	Start(t, Options{Socket: sock, NoFile: testNOFILE, Args: []string{"--max-segments", strconv.Itoa(fairMaxSegments),
		"--max-connections", strconv.Itoa(fairMaxConnections)}})
	ctx := context.Background()
	// Root shares a segment, which the users' work reads.
	root, err := gpushm.Dial(ctx, sock)
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	shared, _ := shareRootBytes(t, root, "shared", 4096)
	shared.Close()
	segs := fairshare.Shares{Cap: fairMaxSegments, Floor: segment.SmallSegments}
	conns := fairshare.Shares{Cap: fairMaxConnections, Floor: server.SmallConnections}
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
			if i >= 3 && n != int(segs.Small()) {
				t.Errorf("uid %d, past the others' limits, made %d segments, want the reserve's %d", uc.uid, n, segs.Small())
			}
		}
		// With root's one, two users fill half the daemon and go on to
		// their limit (under their fair share, 300/2), a third to what is
		// left below the reserve (300, under 300/3), the others Small each
		// from the reserve.
		want := []int{userSegs, userSegs, userSegs - 1, 11, 11, 11, 11, 11}
		if fmt.Sprint(took) != fmt.Sprint(want) {
			t.Errorf("users made %v segments, want %v", took, want)
		}
		// The third user holds 99, under its fair share (300/8 is less,
		// but the reserve is reached first) and above the reserve's Small:
		// refused for the reserve, not a limit of its own.
		third := users[2]
		_, code, msg := third.ask(t, fmt.Sprintf("create more%d- 1 4096", third.uid))
		wantMsg := fmt.Sprintf("fair share of segments (a channel counts as 2): uid %d holds %d and asked for 1 more, while the daemon holds 355 of its limit of %d, and the last %d are kept for users holding at most %d, and for root",
			third.uid, took[2], fairMaxSegments, segs.Reserve(), segs.Small())
		if code != "ENOSPC" || !strings.Contains(msg, wantMsg) {
			t.Errorf("a user above the reserve's Small: %s %q, want ENOSPC %q", code, msg, wantMsg)
		}
	})

	t.Run("connections", func(t *testing.T) { fairConnections(t, users, conns, userConns) })

	t.Run("ninth user", func(t *testing.T) {
		// Its client connects as it starts, then opens the rest of the
		// reserve's Small, and works: creates, writes, opens and reads back
		// a segment, the Small-th.
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

// fairConnections is TestHostileFairShare's test of connections: each of
// users opens all it may, and is refused for its own limit, its fair
// share or the reserve, with the numbers.
func fairConnections(t *testing.T, users []*userClient, conns fairshare.Shares, userConns int) {
	var held []int
	var msgs []string
	for _, uc := range users {
		n, code, msg := uc.ask(t, "conns 100000")
		held, msgs = append(held, n+1), append(msgs, msg) // and the client's own
		if code != "EAGAIN" || !strings.Contains(msg, "connections per user") && !strings.Contains(msg, "fair share of connections") {
			t.Fatalf("uid %d: %d connections, then %s %q; want EAGAIN naming a limit", uc.uid, n, code, msg)
		}
		t.Logf("uid %d: %d more connections, then %s", uc.uid, n, msg)
	}
	// The first user stopped at its own limit; the second, which went on
	// until half the daemon's limit, was then above its fair share among
	// the eight (each client holds one), and refused for it.
	if held[0] != userConns {
		t.Errorf("uid %d held %d connections, want its limit %d", users[0].uid, held[0], userConns)
	}
	wantMsg := fmt.Sprintf("fair share of connections: uid %d holds %d and asked for 1 more, above its fair share of %d (%d shared by 8 users), while the daemon holds %d of its limit of %d (past %d, users above their fair share wait)",
		users[1].uid, held[1], conns.Fair(8), conns.Cap-conns.Reserve(), conns.Open(), conns.Cap, conns.Open())
	if !strings.Contains(msgs[1], wantMsg) {
		t.Errorf("a user above its fair share: %q, want %q", msgs[1], wantMsg)
	}
	// The others took their fair share, and those that came after the
	// fair shares were gone, Small each from the reserve.
	for i, uc := range users[2:] {
		if h := int64(held[i+2]); h > conns.Fair(8) || h < conns.Small() {
			t.Errorf("uid %d held %d connections, want its fair share %d at most, the reserve's Small %d at least", uc.uid, h, conns.Fair(8), conns.Small())
		}
	}
	// The second user, above Small, is refused for the reserve now.
	_, code, msg := users[1].ask(t, "conns 1")
	wantMsg = fmt.Sprintf("fair share of connections: uid %d holds %d and asked for 1 more, while the daemon holds", users[1].uid, held[1])
	if code != "EAGAIN" || !strings.Contains(msg, wantMsg) {
		t.Errorf("a user above the reserve's Small: %s %q, want EAGAIN %q", code, msg, wantMsg)
	}
}

// The daemon of TestHostileSixtyFourUsers runs under a descriptor limit of
// 20000 and its default limits, which follow from it: --max-segments 10000
// (half), --max-connections 8750 (less a sixteenth kept for the daemon),
// --user-segments 2500 and --user-connections 1024 (a quarter of each, at
// most 1024 connections).
const (
	manyNOFILE          = 20000
	manyMaxSegments     = 10000
	manyMaxConnections  = 8750
	manyUserSegments    = 2500
	manyUserConnections = 1024
	manyUsers           = 64
	manyFirstUID        = 4300
)

// TestHostileSixtyFourUsers: 64 users arrive one after another, and each
// fills its segments and its connections until refused, at the daemon's
// default limits; a 65th user still gets the fair shares' floors, 16
// segments and 4 connections at least, and works, and root still connects
// and creates its reserve (docs/security.md, "Fair shares").
func TestHostileSixtyFourUsers(t *testing.T) {
	requireUsers(t)
	dir := testutil.SocketDir(t)
	os.Chmod(dir, 0o755)
	sock := filepath.Join(dir, "gpushm.sock")
	Start(t, Options{Socket: sock, NoFile: manyNOFILE})
	ctx := context.Background()
	root, err := gpushm.Dial(ctx, sock)
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	shared, _ := shareRootBytes(t, root, "shared", 4096)
	shared.Close()
	segs := fairshare.Shares{Cap: manyMaxSegments, Floor: segment.SmallSegments}
	conns := fairshare.Shares{Cap: manyMaxConnections, Floor: server.SmallConnections}

	var tookSegs, tookConns []int
	for i := range manyUsers {
		uc := startUserClient(t, sock, manyFirstUID+i)
		n, code, msg := uc.ask(t, fmt.Sprintf("create s%d- 100000 4096", uc.uid))
		if code != "ENOSPC" || !namesLimit(msg, "segments") {
			t.Fatalf("uid %d: %d segments, then %s %q; want ENOSPC naming a limit", uc.uid, n, code, msg)
		}
		if i == 0 && !strings.Contains(msg, fmt.Sprintf("limit %d", manyUserSegments)) {
			t.Fatalf("the first user: %d segments, then %q; want its default limit, %d", n, msg, manyUserSegments)
		}
		tookSegs = append(tookSegs, n)
		n, code, msg = uc.ask(t, "conns 100000")
		if code != "EAGAIN" || !namesLimit(msg, "connections") {
			t.Fatalf("uid %d: %d connections, then %s %q; want EAGAIN naming a limit", uc.uid, n, code, msg)
		}
		if i == 0 && !strings.Contains(msg, fmt.Sprintf("limit %d", manyUserConnections)) {
			t.Fatalf("the first user: %d connections, then %q; want its default limit, %d", n+1, msg, manyUserConnections)
		}
		tookConns = append(tookConns, n+1) // and the client's own
	}
	t.Logf("%d users made %v segments", manyUsers, tookSegs)
	t.Logf("%d users held %v connections", manyUsers, tookConns)

	t.Run("65th user", func(t *testing.T) {
		uc := startUserClient(t, sock, manyFirstUID+manyUsers)
		uc.works(t, fmt.Sprintf("%d users were at their limits", manyUsers))
		n, code, msg := uc.ask(t, fmt.Sprintf("create s%d- 100000 4096", uc.uid))
		t.Logf("uid %d: %d segments, then %s", uc.uid, n, msg)
		wantMsg := fmt.Sprintf("of its limit of %d, and the last %d are kept for users holding at most %d", segs.Cap, segs.Reserve(), segs.Small())
		if n < segment.SmallSegments || int64(n) != segs.Small() || code != "ENOSPC" || !strings.Contains(msg, wantMsg) {
			t.Errorf("uid %d made %d segments, then %s %q; want the reserve's Small, %d (at least %d), then ENOSPC %q",
				uc.uid, n, code, msg, segs.Small(), segment.SmallSegments, wantMsg)
		}
		n, code, msg = uc.ask(t, "conns 100000")
		t.Logf("uid %d: %d more connections, then %s", uc.uid, n, msg)
		wantMsg = fmt.Sprintf("of its limit of %d, and the last %d are kept for users holding at most %d", conns.Cap, conns.Reserve(), conns.Small())
		if n+1 < server.SmallConnections || int64(n+1) != conns.Small() || code != "EAGAIN" || !strings.Contains(msg, wantMsg) {
			t.Errorf("uid %d held %d connections, then %s %q; want the reserve's Small, %d (at least %d), then EAGAIN %q",
				uc.uid, n+1, code, msg, conns.Small(), server.SmallConnections, wantMsg)
		}
	})

	t.Run("root", func(t *testing.T) {
		root, err := gpushm.Dial(ctx, sock)
		if err != nil {
			t.Fatalf("root could not connect with %d users at their limits: %v", manyUsers+1, err)
		}
		defer root.Close()
		for i := range segs.RootReserve() {
			if _, _, err := root.CreateOnly(ctx, fmt.Sprint("root", i), 4096, nil); err != nil {
				t.Fatalf("root's segment %d of its reserve of %d: %v", i, segs.RootReserve(), err)
			}
		}
	})
}

// namesLimit reports whether msg refuses for a limit of what ("segments",
// "connections"): the user's own, a fair share, or root's reserve.
func namesLimit(msg, what string) bool {
	return strings.Contains(msg, what+" per user") || strings.Contains(msg, "fair share of "+what) || strings.Contains(msg, "reserve of "+what)
}
