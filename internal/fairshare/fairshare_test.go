package fairshare

import (
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

// TestNoLockOut: users fill their limits one after another, as many as
// there are; each newcomer still gets Small, as long as fewer than 8
// newcomers came after the users had filled the cap, and root gets the
// rest.
func TestNoLockOut(t *testing.T) {
	for _, tc := range []struct {
		name         string
		cap, perUser int64
		users        int
	}{
		{"segments-400", 400, 100, 8},
		{"connections-200", 200, 50, 8},
		{"per-user-cap-off", 1000, 1 << 40, 8},
		{"many-users", 8188, 2047, 40},
		{"large", 1 << 20, 1 << 18, 64},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := &pool{s: Shares{Cap: tc.cap}, perUser: tc.perUser, held: map[int]int64{}}
			for uid := 1; uid <= tc.users; uid++ {
				p.fill(uid)
			}
			// The users past the cap have each taken Small at most: those
			// beyond the first smallUsers newcomers may find the reserve
			// taken. A newcomer now, with only the big users above and the
			// reserve's share of newcomers (smallUsers) below it, is served.
			newcomers := 0
			for uid := 1; uid <= tc.users; uid++ {
				if p.held[uid] <= p.s.Small() {
					newcomers++
				}
			}
			n, r := p.fill(1000)
			if newcomers < smallUsers && n < 1 {
				t.Fatalf("a new user got %d (refusal %+v) after %d users filled their limits (%d of %d in use)", n, r, tc.users, p.total, tc.cap)
			}
			if n > p.s.Small() {
				t.Errorf("a new user got %d past the others' limits, want at most Small = %d", n, p.s.Small())
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

// TestNineUsers is the case the daemon's tests run: 8 users at their
// limits of 100 of 400, then a ninth user and root.
func TestNineUsers(t *testing.T) {
	p := &pool{s: Shares{Cap: 400}, perUser: 100, held: map[int]int64{}}
	var got []int64
	for uid := 1; uid <= 9; uid++ {
		n, _ := p.fill(uid)
		got = append(got, n)
	}
	// Two users reach half the cap; the third its limit, under its fair
	// share of 116; the fourth stops where the reserve begins (350); the
	// others take Small = 4 of the reserve each.
	want := []int64{100, 100, 100, 50, 4, 4, 4, 4, 4}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("users took %v, want %v", got, want)
		}
	}
	if n, _ := p.fill(0); n != 400-370 {
		t.Errorf("root took %d, want %d", n, 400-370)
	}
}

func TestRefusals(t *testing.T) {
	s := Shares{Cap: 400}
	one := func() int { return 4 }
	for _, tc := range []struct {
		name             string
		total, held, ask int64
		kind             Kind
		want             string
	}{
		{"open", 199, 150, 1, 0, ""},
		{"below-share", 300, 80, 1, 0, ""},
		{"above-share", 300, 87, 1, AboveShare, "fair share of segments: uid 1001 holds 87 and asked for 1 more, above its fair share of 87 (350 shared by 4 users), while the daemon holds 300 of its limit of 400 (past 200, users above their fair share wait)"},
		{"small", 350, 3, 1, 0, ""},
		{"reserved", 350, 4, 1, Reserved, "fair share of segments: uid 1001 holds 4 and asked for 1 more, while the daemon holds 350 of its limit of 400, and the last 50 are kept for users holding at most 4, and for root"},
		{"root-only", 388, 0, 1, RootOnly, "reserve of segments for root: uid 1001 asked for 1 more, while the daemon holds 388 of its limit of 400, and the last 12 are kept for root"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := s.Check(tc.total, tc.held, tc.ask, one)
			if tc.kind == 0 {
				if r != nil {
					t.Fatalf("Check = %s, want nil", r.Describe("segments", "free", 1001))
				}
				return
			}
			if r == nil || r.Kind != tc.kind {
				t.Fatalf("Check = %+v, want kind %d", r, tc.kind)
			}
			if got := r.Describe("segments", "free", 1001); !strings.HasPrefix(got, tc.want) {
				t.Errorf("Describe = %q, want it to begin %q", got, tc.want)
			}
		})
	}
	if r := (Shares{}).Check(10, 10, 1, one); r != nil {
		t.Errorf("no cap: Check = %+v, want nil", r)
	}
}
