package segment

import (
	"fmt"
	"sort"
	"strconv"
	"syscall"
)

// Limits are quotas; a zero limit is no limit. They bound what is allocated,
// counting segments whose names are gone but whose memory is still open,
// and creations in progress.
type Limits struct {
	// DeviceBytes bounds the bytes allocated on each device, by everyone.
	DeviceBytes map[int]int64
	// UserBytes bounds the bytes one uid's segments hold, on all devices.
	UserBytes int64
	// UserSegments bounds how many segments one uid holds.
	UserSegments int
}

// ErrQuota is a quota refusal.
var ErrQuota = &Error{"quota exceeded", syscall.ENOSPC}

// SetLimits replaces the quotas. Segments already over a new limit stay;
// only new allocations are refused.
func (r *Registry) SetLimits(l Limits) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.limits = l
}

// usageLocked sums what dev (or, with dev < 0, every device) and uid hold,
// in bytes and segments.
func (r *Registry) usageLocked() (devBytes map[int]int64, userBytes map[uint32]int64, userSegs map[uint32]int) {
	devBytes, userBytes, userSegs = map[int]int64{}, map[uint32]int64{}, map[uint32]int{}
	count := func(s *Segment, bytes int64) {
		devBytes[s.device] += bytes
		userBytes[s.uid] += bytes
		userSegs[s.uid]++
	}
	for _, s := range r.byID {
		count(s, memSize(s.mem))
	}
	for _, s := range r.byName {
		if s.creating {
			count(s, r.roundSize(s.device, s.size))
		} else if s.mem == nil {
			count(s, 0) // an empty file still counts as a segment
		}
	}
	return
}

// checkLimitsLocked refuses, with ENOSPC saying what was asked, what is used
// and what the limit is, an allocation of bytes more on device for c's uid
// (and, with newSegment, one more segment). Root is subject to the device
// limits only.
func (r *Registry) checkLimitsLocked(c Cred, device int, bytes int64, newSegment bool) error {
	l := r.limits
	if len(l.DeviceBytes) == 0 && l.UserBytes == 0 && l.UserSegments == 0 {
		return nil
	}
	dev, user, segs := r.usageLocked()
	if max := l.DeviceBytes[device]; max > 0 && dev[device]+bytes > max {
		return fmt.Errorf("%w: device %d: asked %d bytes, %d in use, limit %d", ErrQuota, device, bytes, dev[device], max)
	}
	if c.UID == 0 {
		return nil
	}
	if l.UserBytes > 0 && user[c.UID]+bytes > l.UserBytes {
		return fmt.Errorf("%w: uid %d: asked %d bytes, %d in use, limit %d", ErrQuota, c.UID, bytes, user[c.UID], l.UserBytes)
	}
	if newSegment && l.UserSegments > 0 && segs[c.UID]+1 > l.UserSegments {
		return fmt.Errorf("%w: uid %d: asked for a segment, %d held, limit %d", ErrQuota, c.UID, segs[c.UID], l.UserSegments)
	}
	return nil
}

// QuotaUse is one limit in force and its use.
type QuotaUse struct {
	Kind  string // "device_bytes", "user_bytes", "user_segments"
	Scope string // device index or uid
	Used  int64
	Limit int64
}

// Quotas lists every limit in force with its use: device limits for each
// limited device, user limits for each uid holding something.
func (r *Registry) Quotas() []QuotaUse {
	r.mu.Lock()
	defer r.mu.Unlock()
	l := r.limits
	dev, user, segs := r.usageLocked()
	var out []QuotaUse
	for d, max := range l.DeviceBytes {
		if max > 0 {
			out = append(out, QuotaUse{"device_bytes", strconv.Itoa(d), dev[d], max})
		}
	}
	for uid := range segs {
		if uid == 0 {
			continue
		}
		scope := strconv.FormatUint(uint64(uid), 10)
		if l.UserBytes > 0 {
			out = append(out, QuotaUse{"user_bytes", scope, user[uid], l.UserBytes})
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
