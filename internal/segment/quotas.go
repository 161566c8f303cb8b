package segment

import (
	"fmt"
	"sort"
	"strconv"
	"syscall"

	"github.com/gpushm/gpushm/internal/fairshare"
)

// Limits are quotas; a zero limit is no limit. They bound what is allocated,
// counting segments whose names are gone but whose memory is still open,
// and creations in progress.
type Limits struct {
	// DeviceBytes bounds the bytes allocated on each device, by everyone.
	DeviceBytes map[int]int64
	// UserBytes bounds the bytes one uid's segments hold, on all devices.
	UserBytes int64
	// UserDeviceBytes bounds the bytes one uid's segments hold on each
	// device.
	UserDeviceBytes map[int]int64
	// UserSegments bounds how many segments one uid holds.
	UserSegments int
	// Segments bounds the segments the daemon holds, for all users, root
	// included. A channel counts as two: it is held by two descriptors
	// (its slots and its control block), and what this limit protects is
	// the descriptor table of the daemon's processes.
	Segments int
}

// Segments and DeviceBytes are shared fairly (internal/fairshare): once
// half is in use, a uid other than root above its fair share is refused
// before the others; the top quarter is kept for uids holding little, and
// the top thirty-second for root. So no group of users at their limits
// can lock out another user, or root.

// SmallSegments is the fair shares' floor for segments (fairshare.Shares):
// the least the reserve of Segments gives a uid holding little, where it
// is large enough. A program needs a few segments to do anything (a
// model's tensors, a channel, which counts as 2); 16 lets it start.
const SmallSegments = 16

// ErrQuota is a quota refusal.
var ErrQuota = &Error{"quota exceeded", syscall.ENOSPC}

// SetLimits replaces the quotas. Segments already over a new limit stay;
// only new allocations are refused.
func (r *Registry) SetLimits(l Limits) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.limits = l
}

// Limits returns the quotas in force.
func (r *Registry) Limits() Limits {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.limits
}

// descriptors is how many descriptors hold s's memory: what it counts
// against Limits.Segments.
func (s *Segment) descriptors() int {
	if s.slots > 0 {
		return 2
	}
	return partsOf(s.mem) + cleanParts(s) // spill memory in parts: one each
}

// usageLocked sums what each device and uid hold, in bytes and segments.
func (r *Registry) usageLocked() (devBytes map[int]int64, userBytes map[uint32]int64, userSegs map[uint32]int, total int) {
	devBytes, userBytes, userSegs = map[int]int64{}, map[uint32]int64{}, map[uint32]int{}
	r.eachHeldLocked(func(s *Segment, bytes int64, descs int) {
		devBytes[s.device] += bytes
		userBytes[s.uid] += bytes
		userSegs[s.uid]++
		total += descs
	})
	return
}

// eachHeldLocked calls fn for every segment that counts against the
// limits, with the bytes and descriptors it holds.
func (r *Registry) eachHeldLocked(fn func(s *Segment, bytes int64, descs int)) {
	for _, s := range r.byID {
		fn(s, memSize(s.mem), s.descriptors())
	}
	for _, s := range r.byName {
		if s.creating {
			fn(s, r.roundSize(s.device, s.size), s.descriptors())
		} else if s.mem == nil {
			fn(s, 0, 0) // an empty file still counts as a segment, holding nothing
		}
	}
}

// tally is what one create is checked against.
type tally struct {
	dev      int64 // bytes on the device, all users
	user     int64 // the uid's bytes, all devices
	userDev  int64 // the uid's bytes on the device
	userSegs int   // the uid's segments
	userDesc int   // the uid's descriptors
	descs    int   // descriptors held, all users
}

// tallyLocked sums, in one pass and without allocating, what checking an
// allocation on device for uid needs: it runs on every create.
func (r *Registry) tallyLocked(uid uint32, device int) tally {
	t := tally{descs: r.tiers.extraParts} // evictions under way may take them
	r.eachHeldLocked(func(s *Segment, bytes int64, descs int) {
		t.descs += descs
		if s.device == device {
			t.dev += bytes
		}
		if s.uid == uid {
			t.user += bytes
			t.userSegs++
			t.userDesc += descs
			if s.device == device {
				t.userDev += bytes
			}
		}
	})
	return t
}

// checkLimitsLocked refuses, with ENOSPC naming the limit and saying what
// was asked, what is used and what the limit is, an allocation of bytes
// more on device for c's uid, held by descs more descriptors (and, with
// newSegment, one more segment). Root is held to the limits of the device
// and of the daemon only.
func (r *Registry) checkLimitsLocked(c Cred, device int, bytes int64, descs int, newSegment bool) error {
	l := r.limits
	if len(l.DeviceBytes) == 0 && l.UserBytes == 0 && len(l.UserDeviceBytes) == 0 && l.UserSegments == 0 && l.Segments == 0 {
		return nil
	}
	t := r.tallyLocked(c.UID, device)
	if max := l.DeviceBytes[device]; max > 0 && t.dev+bytes > max {
		return fmt.Errorf("%w: bytes on device %d (all users): asked %d bytes, %d in use, limit %d", ErrQuota, device, bytes, t.dev, max)
	}
	if descs > 0 && l.Segments > 0 && t.descs+descs > l.Segments {
		return fmt.Errorf("%w: segments of the daemon (all users; a channel counts as 2): asked for %d, %d held, limit %d", ErrQuota, descs, t.descs, l.Segments)
	}
	if c.UID == 0 {
		return nil
	}
	if max := l.UserDeviceBytes[device]; max > 0 && t.userDev+bytes > max {
		return fmt.Errorf("%w: bytes per user on device %d: uid %d: asked %d bytes, %d in use, limit %d", ErrQuota, device, c.UID, bytes, t.userDev, max)
	}
	if l.UserBytes > 0 && t.user+bytes > l.UserBytes {
		return fmt.Errorf("%w: bytes per user: uid %d: asked %d bytes, %d in use, limit %d", ErrQuota, c.UID, bytes, t.user, l.UserBytes)
	}
	if newSegment && l.UserSegments > 0 && t.userSegs+1 > l.UserSegments {
		return fmt.Errorf("%w: segments per user: uid %d: asked for a segment, %d held, limit %d", ErrQuota, c.UID, t.userSegs, l.UserSegments)
	}
	if max := l.DeviceBytes[device]; max > 0 {
		holders := func() int {
			return r.holdersLocked(c.UID, func(s *Segment, bytes int64, _ int) bool { return s.device == device && bytes > 0 })
		}
		if no := (fairshare.Shares{Cap: max}).Check(t.dev, t.userDev, bytes, holders); no != nil {
			return fmt.Errorf("%w: %s", ErrQuota, no.Describe("bytes on device "+strconv.Itoa(device), "free", c.UID))
		}
	}
	if l.Segments > 0 {
		holders := func() int {
			return r.holdersLocked(c.UID, func(_ *Segment, _ int64, descs int) bool { return descs > 0 })
		}
		if no := (fairshare.Shares{Cap: int64(l.Segments), Floor: SmallSegments}).Check(int64(t.descs), int64(t.userDesc), int64(descs), holders); no != nil {
			return fmt.Errorf("%w: %s", ErrQuota, no.Describe("segments (a channel counts as 2)", "free", c.UID))
		}
	}
	return nil
}

// holdersLocked counts the uids other than root holding a segment that
// holds says counts, and uid (the asker) whether it holds one or not. It
// runs only once half a limit is in use.
func (r *Registry) holdersLocked(uid uint32, holds func(s *Segment, bytes int64, descs int) bool) int {
	seen := map[uint32]bool{uid: true}
	r.eachHeldLocked(func(s *Segment, bytes int64, descs int) {
		if s.uid != 0 && holds(s, bytes, descs) {
			seen[s.uid] = true
		}
	})
	return len(seen)
}

// QuotaUse is one limit in force and its use.
type QuotaUse struct {
	Kind  string // "device_bytes", "segments", "user_bytes", "user_device_bytes", "user_segments"
	Scope string // device index, uid, uid/device, or "" for the daemon
	Used  int64
	Limit int64
}

// Quotas lists every limit in force with its use: device limits for each
// limited device, the daemon's segment limit, user limits for each uid
// holding something.
func (r *Registry) Quotas() []QuotaUse { return r.quotas(nil) }

// QuotasFor is Quotas with uid's user limits too, whether it holds
// something or not: the one asking wants to know its room.
func (r *Registry) QuotasFor(uid uint32) []QuotaUse { return r.quotas(&uid) }

func (r *Registry) quotas(also *uint32) []QuotaUse {
	r.mu.Lock()
	defer r.mu.Unlock()
	l := r.limits
	dev, user, segs, total := r.usageLocked()
	if also != nil {
		segs[*also] += 0 // listed, holding nothing or not
	}
	var out []QuotaUse
	for d, max := range l.DeviceBytes {
		if max > 0 {
			out = append(out, QuotaUse{"device_bytes", strconv.Itoa(d), dev[d], max})
		}
	}
	if l.Segments > 0 {
		out = append(out, QuotaUse{"segments", "", int64(total), int64(l.Segments)})
	}
	var userDev map[string]int64
	if len(l.UserDeviceBytes) > 0 {
		userDev = map[string]int64{}
		r.eachHeldLocked(func(s *Segment, bytes int64, _ int) {
			userDev[strconv.FormatUint(uint64(s.uid), 10)+"/"+strconv.Itoa(s.device)] += bytes
		})
	}
	for uid := range segs {
		if uid == 0 {
			continue
		}
		scope := strconv.FormatUint(uint64(uid), 10)
		if l.UserBytes > 0 {
			out = append(out, QuotaUse{"user_bytes", scope, user[uid], l.UserBytes})
		}
		for d, max := range l.UserDeviceBytes {
			if max > 0 {
				s := scope + "/" + strconv.Itoa(d)
				out = append(out, QuotaUse{"user_device_bytes", s, userDev[s], max})
			}
		}
		if l.UserSegments > 0 {
			out = append(out, QuotaUse{"user_segments", scope, int64(segs[uid]), int64(l.UserSegments)})
		}
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Kind != out[j].Kind {
			return out[i].Kind < out[j].Kind
		}
		return out[i].Scope < out[j].Scope
	})
	return out
}

// UserUse is what one uid's segments hold on one device.
type UserUse struct {
	UID      uint32
	Device   int
	Bytes    int64 // on the device or evicted to host memory
	Segments int   // empty ones, which hold no memory, included
}

// Users lists what each uid holds on each device, counted as the limits
// count it, by uid and then device.
func (r *Registry) Users() []UserUse {
	r.mu.Lock()
	defer r.mu.Unlock()
	type key struct {
		uid    uint32
		device int
	}
	use := map[key]*UserUse{}
	r.eachHeldLocked(func(s *Segment, bytes int64, _ int) {
		k := key{s.uid, s.device}
		u := use[k]
		if u == nil {
			u = &UserUse{UID: s.uid, Device: s.device}
			use[k] = u
		}
		u.Bytes += bytes
		u.Segments++
	})
	out := make([]UserUse, 0, len(use))
	for _, u := range use {
		out = append(out, *u)
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].UID != out[j].UID {
			return out[i].UID < out[j].UID
		}
		return out[i].Device < out[j].Device
	})
	return out
}
