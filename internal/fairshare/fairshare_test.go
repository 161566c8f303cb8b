package fairshare

import (
	"fmt"
	"strings"
	"testing"
)

// pool is a resource with a cap and a per-user limit, used as the daemon
// uses it: the cap first (root too), then the per-user limit, then the
// fair shares.
type pool struct {
	s       Shares
	perUser int64
	held    map[int]int64 // uid: held; 0 is root
	total   int64
}

func newPool(cap, floor, perUser int64) *pool {
	return &pool{s: Shares{Cap: cap, Floor: floor}, perUser: perUser, held: map[int]int64{}}
}

func (p *pool) take(uid int) *Refusal {
	if p.total+1 > p.s.Cap {
		return &Refusal{Kind: -1}
	}
	if uid != 0 {
		if p.held[uid]+1 > p.perUser {
			return &Refusal{Kind: -2}
		}
		users := func() int {
			n := 0
			for u, h := range p.held {
				if u != 0 && (h > 0 || u == uid) {
					n++
				}
			}
			if _, ok := p.held[uid]; !ok {
				n++
			}
			return n
		}
		if r := p.s.Check(p.total, p.held[uid], 1, users); r != nil {
			return r
		}
	}
	p.held[uid]++
	p.total++
	return nil
}

// fill takes one at a time until refused, and returns how many it took
// and the refusal.
func (p *pool) fill(uid int) (int64, *Refusal) {
	for n := int64(0); ; n++ {
		if r := p.take(uid); r != nil {
			return n, r
		}
	}
}

// runs writes counts as runs of equal values: 100 100 4 is "2×100 1×4".
func runs(counts []int64) string {
	var b strings.Builder
	for i := 0; i < len(counts); {
		j := i
		for j < len(counts) && counts[j] == counts[i] {
			j++
		}
		if b.Len() > 0 {
			b.WriteByte(' ')
		}
		fmt.Fprintf(&b, "%d×%d", j-i, counts[i])
		i = j
	}
	return b.String()
}

// TestSmall: Small is the users' part of the reserve among 128 users, or
// the floor where that is more, as long as the floor leaves 8 users
// theirs; never more than that part, and at least 1.
func TestSmall(t *testing.T) {
	for _, tc := range []struct {
		name                    string
		cap, floor              int64
		reserve, rootRes, small int64
	}{
		// The daemon's defaults under a descriptor limit of 20000.
		{"segments-10000", 10000, 16, 2500, 312, 17},
		{"connections-8750", 8750, 4, 2187, 273, 14},
		// The systemd unit's.
		{"segments-6140", 6140, 16, 1535, 191, 16},
		{"connections-55300", 55300, 4, 13825, 1728, 94},
		// The process tests' (testNOFILE 2048, and the worked case).
		{"segments-1024", 1024, 16, 256, 32, 16},
		{"connections-896", 896, 4, 224, 28, 4},
		{"segments-400", 400, 16, 100, 12, 11},
		{"connections-200", 200, 4, 50, 6, 4},
		// A floor the reserve cannot give 8 users: 8 users get less.
		{"segments-64", 64, 16, 16, 2, 1},
		// Bytes of a device (no floor).
		{"bytes-65536", 65536, 0, 16384, 2048, 112},
		// Pollers: half the cores.
		{"pollers-1", 1, 0, 0, 0, 1},
		{"pollers-2", 2, 0, 0, 0, 1},
		{"pollers-4", 4, 0, 1, 0, 1},
		{"pollers-8", 8, 0, 2, 0, 1},
		{"pollers-64", 64, 0, 16, 2, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := Shares{Cap: tc.cap, Floor: tc.floor}
			if s.Reserve() != tc.reserve || s.RootReserve() != tc.rootRes || s.Small() != tc.small {
				t.Errorf("Reserve, RootReserve, Small = %d, %d, %d, want %d, %d, %d",
					s.Reserve(), s.RootReserve(), s.Small(), tc.reserve, tc.rootRes, tc.small)
			}
			if users := s.Reserve() - s.RootReserve(); users > 0 && s.Small() > users {
				t.Errorf("Small = %d, more than the users' part of the reserve, %d", s.Small(), users)
			}
		})
	}
}

// TestZones: what one request is told in each zone, at a cap of 400 and
// at the pollers' small caps.
func TestZones(t *testing.T) {
	for _, tc := range []struct {
		name             string
		cap, floor       int64
		total, held, ask int64
		users            int
		kind             Kind
	}{
		{"open", 400, 16, 199, 199, 1, 2, 0},
		{"open-full", 400, 16, 199, 0, 2, 2, 0},
		{"fair", 400, 16, 250, 149, 1, 2, 0},
		{"above-fair", 400, 16, 250, 150, 1, 2, AboveShare},
		{"fair-top", 400, 16, 299, 0, 1, 2, 0},
		{"reserve-small", 400, 16, 300, 10, 1, 2, 0},
		{"reserve-above-small", 400, 16, 300, 11, 1, 2, Reserved},
		{"reserve-channel", 400, 16, 300, 10, 2, 2, Reserved},
		{"reserve-top", 400, 16, 387, 0, 1, 2, 0},
		{"root-only", 400, 16, 388, 0, 1, 2, RootOnly},
		// One poller: nobody else polls, so the user's fair share is it.
		{"pollers-1", 1, 0, 0, 0, 1, 1, 0},
		// Two: the second goes to a user up to its fair share, 1 of 2.
		{"pollers-2-second", 2, 0, 1, 0, 1, 2, 0},
		{"pollers-2-second-own", 2, 0, 1, 1, 1, 2, AboveShare},
		// Four: the third up to the fair share of 3, the fourth only to a
		// user polling none.
		{"pollers-4-third", 4, 0, 2, 0, 1, 2, 0},
		{"pollers-4-third-own", 4, 0, 2, 1, 1, 2, AboveShare},
		{"pollers-4-fourth", 4, 0, 3, 0, 1, 2, 0},
		{"pollers-4-fourth-own", 4, 0, 3, 1, 1, 1, Reserved},
		// Eight: the seventh and eighth only to users polling none.
		{"pollers-8-sixth", 8, 0, 5, 2, 1, 2, 0},
		{"pollers-8-seventh-own", 8, 0, 6, 1, 1, 1, Reserved},
		{"pollers-8-eighth", 8, 0, 7, 0, 1, 2, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := Shares{Cap: tc.cap, Floor: tc.floor}
			r := s.Check(tc.total, tc.held, tc.ask, func() int { return tc.users })
			if tc.kind == 0 && r != nil {
				t.Fatalf("Check(%d, %d, %d) = %s, want nil", tc.total, tc.held, tc.ask, r.Describe("segments", "free", 1001))
			}
			if tc.kind != 0 && (r == nil || r.Kind != tc.kind) {
				t.Fatalf("Check(%d, %d, %d) = %+v, want kind %d", tc.total, tc.held, tc.ask, r, tc.kind)
			}
		})
	}
	if r := (Shares{}).Check(10, 10, 1, func() int { return 1 }); r != nil {
		t.Errorf("no cap: Check = %+v, want nil", r)
	}
}

// TestSixtyFourUsers plays the attacker of the daemon's defaults: 64
// users arrive one after another, each taking until refused; a 65th still
// gets Small, at least the floor, and root at least its reserve, up to
// the cap.
func TestSixtyFourUsers(t *testing.T) {
	for _, tc := range []struct {
		name                string
		cap, floor, perUser int64
		took                string // what the 64 took, in runs
	}{
		// --max-segments 10000, --user-segments 2500 (a descriptor limit of
		// 20000): three users fill the fair shares; the others take Small
		// each from the reserve.
		{"segments-10000", 10000, 16, 2500, "3×2500 61×17"},
		// --max-connections 8750, --user-connections 1024: six at their
		// limit, a seventh what the fair shares leave.
		{"connections-8750", 8750, 4, 1024, "6×1024 1×419 57×14"},
		// The systemd unit's: 6140 segments, 1535 a user; 55300
		// connections, 1024 a user.
		{"segments-6140", 6140, 16, 1535, "3×1535 61×16"},
		{"connections-55300", 55300, 4, 1024, "40×1024 1×515 23×94"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newPool(tc.cap, tc.floor, tc.perUser)
			var took []int64
			for uid := 1; uid <= 64; uid++ {
				n, _ := p.fill(uid)
				took = append(took, n)
			}
			if got := runs(took); got != tc.took {
				t.Errorf("64 users took %s, want %s", got, tc.took)
			}
			n, r := p.fill(65)
			if n < tc.floor || n != p.s.Small() {
				t.Errorf("the 65th user got %d (then %+v), want Small = %d, at least %d", n, r, p.s.Small(), tc.floor)
			}
			before := p.total
			n, r = p.fill(0)
			if n < p.s.RootReserve() || p.total != tc.cap || r.Kind != -1 {
				t.Errorf("root got %d (from %d in use to %d, refusal %d), want at least its reserve %d, up to the cap %d",
					n, before, p.total, r.Kind, p.s.RootReserve(), tc.cap)
			}
			t.Logf("cap %d, Small %d: 64 users took %s, the 65th %d; root %d", tc.cap, p.s.Small(), runs(took), p.held[65], p.held[0])
		})
	}
}

// TestNoLockOut: however many users fill their limits one after another,
// each takes at most Small from the reserve; a newcomer gets Small as long
// as fewer than R/Small users reached the reserve before it, and root gets
// the rest.
func TestNoLockOut(t *testing.T) {
	for _, tc := range []struct {
		name                string
		cap, floor, perUser int64
		users               int
	}{
		{"segments-400", 400, 16, 100, 12},
		{"connections-200", 200, 4, 50, 16},
		{"per-user-cap-off", 1000, 1, 1 << 40, 40},
		{"many-users", 8188, 16, 2047, 200},
		{"floor-above-reserve", 64, 16, 16, 20},
		{"large", 1 << 20, 1, 1 << 18, 300},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newPool(tc.cap, tc.floor, tc.perUser)
			fairTop := p.s.Cap - p.s.Reserve()
			reached := int64(0) // users that reached the reserve
			for uid := 1; uid <= tc.users; uid++ {
				before, had := p.total, p.held[uid]
				p.fill(uid)
				fromReserve := p.total - max(before, fairTop)
				if fromReserve > p.s.Small() {
					t.Fatalf("uid %d took %d from the reserve, more than Small = %d", uid, fromReserve, p.s.Small())
				}
				if p.total > fairTop && had == 0 {
					reached++
				}
			}
			users := p.s.Reserve() - p.s.RootReserve()
			n, r := p.fill(1000)
			if reached < users/p.s.Small() && n != p.s.Small() {
				t.Fatalf("a new user got %d (refusal %+v) after %d users reached the reserve, which serves %d (%d in use of %d)",
					n, r, reached, users/p.s.Small(), p.total, tc.cap)
			}
			before := p.total
			n, r = p.fill(0)
			if n < p.s.RootReserve() || p.total != tc.cap || r.Kind != -1 {
				t.Errorf("root got %d (from %d in use to %d, refusal %d), want at least its reserve %d and the cap %d",
					n, before, p.total, r.Kind, p.s.RootReserve(), tc.cap)
			}
			for uid, h := range p.held {
				if uid != 0 && h > max(p.s.Fair(len(p.held)-1), p.perUser) && h > tc.cap/2 {
					t.Errorf("uid %d holds %d, more than half the cap and its fair share", uid, h)
				}
			}
		})
	}
}

// TestWorkedCase is the case the daemon's process tests run
// (integration/fairshare_test.go): --max-segments 400, 100 a user, root
// holding one; 8 users at their limits, then a ninth user and root.
func TestWorkedCase(t *testing.T) {
	p := newPool(400, 16, 100)
	p.take(0)
	var got []int64
	for uid := 1; uid <= 9; uid++ {
		n, _ := p.fill(uid)
		got = append(got, n)
	}
	// Two users reach half the cap and their limit; the third stops where
	// the reserve begins (300), the others take Small = 11 each from it.
	if want := "2×100 1×99 6×11"; runs(got) != want {
		t.Fatalf("users took %s, want %s", runs(got), want)
	}
	if n, _ := p.fill(0); n != 400-366 {
		t.Errorf("root took %d, want %d", n, 400-366)
	}
}

func TestRefusals(t *testing.T) {
	s := Shares{Cap: 400, Floor: 16}
	four := func() int { return 4 }
	for _, tc := range []struct {
		name             string
		total, held, ask int64
		kind             Kind
		want             string
	}{
		{"above-share", 250, 75, 1, AboveShare, "fair share of segments: uid 1001 holds 75 and asked for 1 more, above its fair share of 75 (300 shared by 4 users), while the daemon holds 250 of its limit of 400 (past 200, users above their fair share wait)"},
		{"reserved", 350, 11, 1, Reserved, "fair share of segments: uid 1001 holds 11 and asked for 1 more, while the daemon holds 350 of its limit of 400, and the last 100 are kept for users holding at most 11, and for root"},
		{"root-only", 388, 0, 1, RootOnly, "reserve of segments for root: uid 1001 asked for 1 more, while the daemon holds 388 of its limit of 400, and the last 12 are kept for root"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := s.Check(tc.total, tc.held, tc.ask, four)
			if r == nil || r.Kind != tc.kind {
				t.Fatalf("Check = %+v, want kind %d", r, tc.kind)
			}
			if got := r.Describe("segments", "free", 1001); !strings.HasPrefix(got, tc.want) {
				t.Errorf("Describe = %q, want it to begin %q", got, tc.want)
			}
		})
	}
}
