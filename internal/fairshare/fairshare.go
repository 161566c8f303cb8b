// Package fairshare decides who may take more of a resource the daemon
// holds for its users (connections, segments, bytes of a device, pollers)
// once it nears its cap, so that no group of users can lock out another.
//
// A resource of cap C is cut into four zones, by what would be in use after
// a request:
//
//	up to C/2           anyone within its per-user limit
//	up to C - C/4       a user other than root only up to its fair share,
//	                    (C - C/4) / the users holding some (itself included)
//	up to C - C/32      a user other than root only while it holds at most
//	                    Small: room kept for users holding little (a new
//	                    user, say)
//	up to C             root only
//
// Small cuts the users' part of the reserve, R = C/4 - C/32, among 128
// users (R/128), or is the resource's Floor (16 segments, 4 connections:
// what a user needs to do anything) where that is more, as long as the
// Floor leaves 8 users Small each (R/8); it is at least 1.
//
// What follows, however many users are at their limits: users other than
// root never take the last C/32, so root is served. A user takes from the
// reserve only while it would hold at most Small, so at most Small of it
// in all, and the first R/Small users to reach the reserve (8 at least,
// where R is; 128 where R/128 is at least the Floor) each get up to Small
// however many users hold the rest: 64 users at their limits leave a
// 65th Small wherever R is at least 65 Floors. And once half the cap is
// in use, users above their fair share are refused before users below
// it, who keep growing to theirs. The caller checks the cap itself (for
// root too) and its per-user limits; the per-user limit bounds what one
// user takes while the daemon is below half its cap.
package fairshare

import "fmt"

// Shares is the policy for a resource of cap Cap (0: no cap, no policy).
type Shares struct {
	Cap int64
	// Floor is the least Small may be, where the reserve allows (see
	// Small): what a user needs of this resource to do anything; 0: none.
	Floor int64
}

// Open is what may be in use before fair shares apply.
func (s Shares) Open() int64 { return s.Cap / 2 }

// Reserve is the part of the cap above which users other than root take
// only while holding at most Small; RootReserve, its top part, is root's.
func (s Shares) Reserve() int64 { return s.Cap / 4 }

// RootReserve is the top part of the cap that only root takes.
func (s Shares) RootReserve() int64 { return s.Cap / 32 }

// Small is the most a user may hold and still take from the reserve: the
// users' part of it among smallUsers users, or the Floor where that is
// more while it leaves fewUsers users Small each, and at least 1. So it
// never exceeds the users' part of the reserve where there is one, and a
// Floor never leaves it to fewer than fewUsers users: under a small cap
// they get less than the Floor.
func (s Shares) Small() int64 {
	users := s.Reserve() - s.RootReserve()
	return max(1, users/smallUsers, min(s.Floor, users/fewUsers))
}

const (
	// smallUsers is how many users holding nothing the reserve serves,
	// each up to Small, however many others are at their limits, where
	// its share among them is at least the Floor.
	smallUsers = 128
	// fewUsers is how many it serves at least, the Floor notwithstanding.
	fewUsers = 8
)

// Fair is one user's fair share among users holding some (itself
// included): what lies below the reserve, in equal parts.
func (s Shares) Fair(users int) int64 { return (s.Cap - s.Reserve()) / int64(max(users, 1)) }

// Kind says which rule refused a request.
type Kind int

const (
	// AboveShare: past Open, the user would hold more than its fair share.
	AboveShare Kind = iota + 1
	// Reserved: the reserve is kept for users holding at most Small.
	Reserved
	// RootOnly: the last RootReserve is root's.
	RootOnly
)

// Refusal is a request the policy turned away, with its numbers.
type Refusal struct {
	Kind   Kind
	Shares Shares
	// Held and Ask: what the user holds and asked for more; Total: what
	// all users hold together, root included; Users: the users other than
	// root that hold some, the asker included.
	Held, Ask, Total int64
	Users            int
}

// Check says whether a user other than root, holding held, may take ask
// more while all users together hold total. users is called, only when
// the fair share is needed, for how many users other than root hold some,
// the asker included. The cap itself is the caller's to check.
func (s Shares) Check(total, held, ask int64, users func() int) *Refusal {
	after := total + ask
	if s.Cap <= 0 || ask <= 0 || after <= s.Open() {
		return nil
	}
	r := &Refusal{Shares: s, Held: held, Ask: ask, Total: total}
	switch {
	case after > s.Cap-s.RootReserve():
		r.Kind = RootOnly
	case after > s.Cap-s.Reserve():
		if held+ask <= s.Small() {
			return nil
		}
		r.Kind = Reserved
	default:
		r.Users = users()
		if held+ask <= s.Fair(r.Users) {
			return nil
		}
		r.Kind = AboveShare
	}
	return r
}

// Describe says what was refused, in the daemon's words, and what to do:
// noun names the resource ("segments", "connections", "bytes on device
// 0"), free how a user gives some back ("free", "close"), uid the user.
func (r *Refusal) Describe(noun, free string, uid uint32) string {
	s := r.Shares
	switch r.Kind {
	case AboveShare:
		return fmt.Sprintf("fair share of %s: uid %d holds %d and asked for %d more, above its fair share of %d (%d shared by %d users), while the daemon holds %d of its limit of %d (past %d, users above their fair share wait); %s some and try again",
			noun, uid, r.Held, r.Ask, s.Fair(r.Users), s.Cap-s.Reserve(), r.Users, r.Total, s.Cap, s.Open(), free)
	case Reserved:
		return fmt.Sprintf("fair share of %s: uid %d holds %d and asked for %d more, while the daemon holds %d of its limit of %d, and the last %d are kept for users holding at most %d, and for root; %s some and try again",
			noun, uid, r.Held, r.Ask, r.Total, s.Cap, s.Reserve(), s.Small(), free)
	default:
		return fmt.Sprintf("reserve of %s for root: uid %d asked for %d more, while the daemon holds %d of its limit of %d, and the last %d are kept for root; try again later",
			noun, uid, r.Ask, r.Total, s.Cap, s.RootReserve())
	}
}
