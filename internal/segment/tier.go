package segment

import (
	"errors"
	"fmt"
	"sort"
	"syscall"
	"time"
)

// Tiers: a segment's bytes live on its device (a GPU, or the served memory
// of the host backend) or, evicted, in host memory. A budget per device
// bounds the bytes on it; a create, or a restore, that would go over it
// first moves the least recently opened segments that nobody holds to host
// memory, and an open of a segment on host moves it back before the
// descriptor goes out. Only segments that nobody maps are moved: no open
// lease, no pin of the daemon's own (a file open in the FUSE view), not
// kept resident, not a channel, not published memory (its publisher may
// still write it), not uncommitted, not in doubt after a restart, not an
// orphan. Moves are journaled like any change of memory: the record says
// where the segment lives and travels with its new descriptor, so a kill
// at any moment leaves it whole in exactly one place.

// Tier says where a segment's bytes live.
type Tier uint8

const (
	OnDevice Tier = iota // on its device, ready to map
	OnHost               // evicted to host memory
)

func (t Tier) String() string {
	switch t {
	case OnHost:
		return "host"
	case OnDisk:
		return "disk"
	}
	return "gpu"
}

// Mover copies n bytes from src to dst, where one is memory of the
// registry's allocator and the other of the spill allocator.
type Mover interface {
	Move(dst, src Memory, n int64) error
}

// ScratchAllocator is a spill allocator that can hand out memory whose
// bytes are left over from an earlier segment, for a caller that
// overwrites all of them (an eviction), faster than new memory. parts is
// the most descriptors the memory may take (Parted): each is one more for
// the daemon and its supervisor to hold.
type ScratchAllocator interface {
	AllocateScratch(device int, size int64, parts int) (Memory, error)
}

// Syncer is a Journal whose keeper can say when it has applied every
// change so far (supervisor.Link): once an eviction's record is applied,
// the keeper has let go of the device memory, which is then free for good.
type Syncer interface {
	Sync(timeout time.Duration)
}

// Tiers configures eviction (SetTiers).
type Tiers struct {
	// Budgets bounds the bytes on each device's own memory; a device
	// missing, or at 0, has no budget.
	Budgets map[int]int64
	// HostBudget bounds the bytes evicted to host memory; 0 turns
	// eviction off (budgets still refuse, with ErrNoRoom).
	HostBudget int64
	// Spill allocates host memory (device 0); Mover copies to and from it.
	Spill Allocator
	Mover Mover
	// Observe, if set, is told of every move, outside the lock: "evict",
	// "restore", "evict-disk", "restore-disk" or "sync", the segment's
	// name, its bytes and how long it took.
	Observe func(kind, name string, bytes int64, d time.Duration)
	// Disk, if set, is the disk tier (disk.go); Failed is told of what
	// failed in the background (a durable segment's write after its
	// commit): the segment stays in memory.
	Disk   Disk
	Failed func(op, name string, err error)
}

// ErrNoRoom: the budget cannot hold what was asked, even after moving
// every segment that may move.
var ErrNoRoom = &Error{"no room under the budget", syscall.ENOSPC}

// ErrPinned: the segment may not move (it is open, pinned, a channel...).
var ErrPinned = &Error{"segment cannot move", syscall.EBUSY}

// TierStats is what the tiers hold, for info and metrics.
type TierStats struct {
	Devices []DeviceTier
	// HostBudget and HostBytes: the spill's bound and what evicted
	// segments hold of it; CleanBytes what it holds of copies of segments
	// back on their device (dropped first when room is needed).
	HostBudget, HostBytes, CleanBytes int64
	// Spare and SpareBytes: host memory let go of and kept, by the spill
	// allocator, for the next eviction of its size.
	Spare      int
	SpareBytes int64
	// Reserve is the host memory the spill allocator keeps made ahead.
	Reserve Reserve
	// Evictions and Restores count moves since the process started;
	// EvictedBytes and RestoredBytes their bytes.
	Evictions, Restores         uint64
	EvictedBytes, RestoredBytes int64
	// The disk tier: DiskBytes and DiskBudget are what its copies take and
	// may take (0: none); DiskSegments the segments whose bytes are only
	// there, Durable the durable segments; DiskWrites and DiskReads count
	// copies written and read since the process started.
	Disk                            bool
	DiskBytes, DiskBudget           int64
	DiskSegments, Durable           int
	DiskWrites, DiskReads           uint64
	DiskWrittenBytes, DiskReadBytes int64
}

// Reserve is host memory a spill allocator keeps made ahead of evictions
// (backend.Spill.Reserve): Target bytes when full, Bytes in Memfds now;
// Takes allocations served from it since the process started, TakenBytes
// their bytes.
type Reserve struct {
	Target, Bytes int64
	Memfds        int
	Takes         uint64
	TakenBytes    int64
}

// DeviceTier is one device's budget and use.
type DeviceTier struct {
	Device int
	// Budget is 0 for none. Bytes is what the device holds now, Peak the
	// most it ever held (with creates, restores and growths in flight
	// counted from the moment they were let in).
	Budget, Bytes, Peak int64
}

// tierState is the registry's part of the tiers; Registry.mu guards it.
type tierState struct {
	cfg      Tiers
	reserved map[int]int64 // device bytes of restores and growths in flight
	spilling int64         // host bytes of evictions in flight
	// extraParts counts the descriptors beyond the first that evictions
	// in flight may take (spillPartsLocked), held back until their
	// memory is the segment's.
	extraParts int
	peak       map[int]int64
	stats      TierStats
}

// SetTiers turns on budgets and eviction; call it before the registry is
// used, or again to change the budgets.
func (r *Registry) SetTiers(t Tiers) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.tiers.cfg = t
}

// TierStats reports budgets, use and moves.
func (r *Registry) TierStats() TierStats {
	r.mu.Lock()
	defer r.mu.Unlock()
	st := r.tiers.stats
	st.HostBudget = r.tiers.cfg.HostBudget
	st.HostBytes, st.CleanBytes = r.hostBytesLocked()
	if k, ok := r.tiers.cfg.Spill.(interface{ Kept() (int, int64) }); ok {
		st.Spare, st.SpareBytes = k.Kept()
	}
	if k, ok := r.tiers.cfg.Spill.(interface{ Reserved() Reserve }); ok {
		st.Reserve = k.Reserved()
	}
	if d := r.tiers.cfg.Disk; d != nil {
		st.Disk = true
		st.DiskBytes, st.DiskBudget = d.Usage()
		for _, s := range r.byID {
			if s.tier == OnDisk {
				st.DiskSegments++
			}
			if s.persist {
				st.Durable++
			}
		}
	}
	devs := map[int]bool{}
	for d := range r.tiers.cfg.Budgets {
		devs[d] = true
	}
	for _, s := range r.byID {
		devs[s.device] = true
	}
	for d := range devs {
		st.Devices = append(st.Devices, DeviceTier{Device: d, Budget: r.tiers.cfg.Budgets[d],
			Bytes: r.deviceUseLocked(d), Peak: r.tiers.peak[d]})
	}
	sort.Slice(st.Devices, func(i, j int) bool { return st.Devices[i].Device < st.Devices[j].Device })
	return st
}

// NextEviction is the host memory the largest eviction in sight would
// need: the largest segment on a device with a budget (evictions come
// only under one) that may be evicted some day (not pinned to it, not a
// channel, not published, not orphaned: none of those ever moves) and
// has no copy in host memory, where the host budget has room for it
// now; else 0. The host reserve grows to it (backend.Spill.SetDemand).
func (r *Registry) NextEviction() int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	var n int64
	for _, s := range r.byID {
		if s.tier == OnDevice && r.tiers.cfg.Budgets[s.device] > 0 && s.clean == nil && !s.resident &&
			s.slots == 0 && !s.published && s.orphan == "" && !s.gone {
			n = max(n, memSize(s.mem))
		}
	}
	// Clean copies count as room: they are dropped first when needed.
	evicted, _ := r.hostBytesLocked()
	if n > r.tiers.cfg.HostBudget-evicted-r.tiers.spilling {
		return 0 // no room, or eviction off (a budget of 0)
	}
	return n
}

// deviceUseLocked is what device d holds, or has let in: segments on it,
// creates in progress, restores in flight.
func (r *Registry) deviceUseLocked(d int) int64 {
	var n int64
	for _, s := range r.byID {
		if s.device == d && s.tier == OnDevice {
			n += memSize(s.mem)
		}
	}
	for _, s := range r.byName {
		if s.creating && s.device == d {
			n += r.roundSize(d, s.size)
		}
	}
	return n + r.tiers.reserved[d]
}

// hostUseLocked is what host memory holds of evicted segments and of
// clean copies, or has let in for evictions in flight. A segment on its
// way back to its device counts as gone: the eviction its restore makes
// room with takes its place (and its copy stays only while it is clean).
func (r *Registry) hostUseLocked() int64 {
	evicted, clean := r.hostBytesLocked()
	return evicted + clean + r.tiers.spilling
}

// hostBytesLocked is what host memory holds of evicted segments (not on
// their way back) and of clean copies.
func (r *Registry) hostBytesLocked() (evicted, clean int64) {
	for _, s := range r.byID {
		if s.tier == OnHost && s.moving == nil {
			evicted += memSize(s.mem)
		}
		clean += memSize(s.clean)
	}
	return evicted, clean
}

// dirtyLocked forgets s's clean copy: s may be written now (a read-write
// open, a write, a resize) or is going. The copy is freed in the
// background.
func (r *Registry) dirtyLocked(s *Segment) {
	if s.clean == nil {
		return
	}
	m := s.clean
	s.clean = nil
	r.freeLater(m)
}

// freeLater frees m off the caller's path; Close waits for it.
func (r *Registry) freeLater(m Memory) {
	r.background.Add(1)
	go func() {
		defer r.background.Done()
		free(m)
	}()
}

// hostRoomLocked makes room for need more bytes under the host budget by
// dropping clean copies, those of the least recently opened segments
// first, and reports whether they fit.
func (r *Registry) hostRoomLocked(need int64) bool {
	budget := r.tiers.cfg.HostBudget
	for r.hostUseLocked()+need > budget {
		v := r.oldestLocked(func(s *Segment) bool { return s.clean != nil })
		if v == nil {
			return false
		}
		r.dirtyLocked(v)
	}
	return true
}

// unmovableLocked says why s cannot be evicted now, or "".
func (r *Registry) unmovableLocked(s *Segment) string {
	switch {
	case s.gone || s.creating:
		return "it is being created or removed"
	case s.mem == nil:
		return "it holds no memory"
	case s.moving != nil:
		return "it is moving already"
	case s.opens > 0:
		return fmt.Sprintf("it is open (%d)", s.opens)
	case s.pins > 0:
		return "the daemon is using it (a file open in the FUSE view)"
	case s.resident:
		return "it is pinned to its device"
	case s.slots > 0:
		return "it is a channel"
	case s.published:
		return "its memory was published by a client, which may still write it"
	case s.uncommitted:
		return "its writer has not committed it"
	case s.orphan != "":
		return "it is orphaned"
	case s.doubt:
		// Last: a segment held by nothing else moves once the grace
		// period ends (afterGraceLocked).
		return whyDoubt
	}
	return ""
}

const whyDoubt = "the daemon restarted, and clients may still have it mapped"

// afterGraceLocked reports whether only the grace period, still running,
// keeps s from moving.
func (r *Registry) afterGraceLocked(s *Segment) bool {
	return r.graceRunningLocked() && r.unmovableLocked(s) == whyDoubt
}

// victimLocked is the least recently opened segment on device d that may
// move, or nil.
func (r *Registry) victimLocked(d int) *Segment {
	return r.oldestLocked(func(s *Segment) bool {
		return s.device == d && s.tier == OnDevice && r.unmovableLocked(s) == ""
	})
}

// oldestLocked is the least recently opened segment that ok takes, or nil.
func (r *Registry) oldestLocked(ok func(*Segment) bool) *Segment {
	var v *Segment
	for _, s := range r.byID {
		if ok(s) && (v == nil || s.lastOpen.Before(v.lastOpen) || s.lastOpen.Equal(v.lastOpen) && s.id < v.id) {
			v = s
		}
	}
	return v
}

// graceRunningLocked reports whether the grace period has not been ended
// yet; a few seconds past its time, it counts as ended even if nobody
// called EndGrace.
func (r *Registry) graceRunningLocked() bool {
	return !r.graceUntil.IsZero() && time.Since(r.graceUntil) < 5*time.Second
}

// freeableLocked is what device d could give up: segments that may move,
// evictions under way, and segments only the grace period keeps.
func (r *Registry) freeableLocked(d int) int64 {
	var n int64
	for _, s := range r.byID {
		if s.device != d || s.tier != OnDevice {
			continue
		}
		if r.unmovableLocked(s) == "" || s.moving != nil && s.copying || r.afterGraceLocked(s) {
			n += memSize(s.mem)
		}
	}
	return n
}

// inDoubtOnLocked reports whether device d holds segments that only the
// grace period, still running, keeps from moving.
func (r *Registry) inDoubtOnLocked(d int) bool {
	for _, s := range r.byID {
		if s.device == d && s.tier == OnDevice && r.afterGraceLocked(s) {
			return true
		}
	}
	return false
}

// waitLocked waits for ch to close, with mu dropped meanwhile.
func (r *Registry) waitLocked(ch chan struct{}) {
	r.mu.Unlock()
	<-ch
	r.mu.Lock()
}

// movingOnLocked returns the channel of a move in flight to or from
// device d other than self's, or nil: when it ends, room may have come
// free (an eviction done, a restore's reservation turned into a segment
// that its opener may have let go again). Only moves past waiting for room
// count, so that two restores never wait for each other.
func (r *Registry) movingOnLocked(d int, self *Segment) chan struct{} {
	for _, s := range r.byID {
		if s.device == d && s.moving != nil && s.copying && s != self {
			return s.moving
		}
	}
	return nil
}

// roomLocked makes what device d holds and has let in fit its budget,
// evicting the least recently opened segments that may move. The caller
// has already counted what it asks for, need bytes (a creating segment, a
// restore's reservation of self). When nothing may move, it waits for moves in
// flight, and for the grace period after a restart; then it fails. mu is
// held, and dropped while segments move.
func (r *Registry) roomLocked(d int, self *Segment, need int64, what string) error {
	budget := r.tiers.cfg.Budgets[d]
	for {
		used := r.deviceUseLocked(d)
		if budget <= 0 || used <= budget {
			// Kept with a budget or without: info's peak says how much
			// a device held, which is what a budget is chosen from.
			r.tiers.peak[d] = max(r.tiers.peak[d], used)
			return nil
		}
		if need > budget {
			// (A create was refused before it came here.)
			return fmt.Errorf("%w: %s: %d bytes exceeds device %d's budget of %d bytes", ErrNoRoom, what, need, d, budget)
		}
		if used-r.freeableLocked(d) > budget {
			// Evicting all that may go would not be enough: evict nothing.
			return r.noRoomLocked(d, what, used, budget)
		}
		v := r.victimLocked(d)
		if v == nil {
			if ch := r.movingOnLocked(d, self); ch != nil {
				r.waitLocked(ch)
				continue
			}
			if r.inDoubtOnLocked(d) {
				// After a restart nobody knows yet which segments clients
				// still map: those that nobody reclaims may move once the
				// grace period ends (EndGrace).
				r.mu.Unlock()
				time.Sleep(20 * time.Millisecond)
				r.mu.Lock()
				continue
			}
			return r.noRoomLocked(d, what, used, budget)
		}
		if err := r.evictLocked(v); err != nil && !errors.Is(err, ErrNotFound) {
			// (A victim removed while it moved made room all the same.)
			if errors.Is(err, ErrNoRoom) {
				return fmt.Errorf("%w; %s on device %d needs %s more under its budget of %s",
					err, what, d, fmtBytes(used-budget), fmtBytes(budget))
			}
			return err
		}
	}
}

func (r *Registry) noRoomLocked(d int, what string, used, budget int64) error {
	var fixed int64
	for _, s := range r.byID {
		if s.device == d && s.tier == OnDevice {
			fixed += memSize(s.mem)
		}
	}
	return fmt.Errorf("%w: %s on device %d: %s of its budget of %s would be in use, and the %s on it now are all open, pinned or otherwise unable to move",
		ErrNoRoom, what, d, fmtBytes(used), fmtBytes(budget), fmtBytes(fixed))
}

// allocate is Allocate, evicting a segment and trying again while the
// device runs out of memory that its budget did not foresee (other
// processes' allocations). mu is not held.
func (r *Registry) allocate(d int, size int64) (Memory, error) {
	for {
		mem, err := r.alloc.Allocate(d, size)
		if err == nil || !errors.Is(err, syscall.ENOMEM) {
			return mem, err
		}
		r.mu.Lock()
		v := r.victimLocked(d)
		if v == nil || r.tiers.cfg.HostBudget <= 0 {
			r.mu.Unlock()
			return nil, err
		}
		e := r.evictLocked(v)
		r.mu.Unlock()
		if e != nil && !errors.Is(e, ErrNotFound) {
			return nil, errors.Join(err, e)
		}
	}
}

// evictLocked moves s to host memory. mu is held, and dropped while the
// bytes move.
func (r *Registry) evictLocked(s *Segment) error {
	if why := r.unmovableLocked(s); why != "" {
		return fmt.Errorf("%w: %q: %s", ErrPinned, s.name, why)
	}
	if s.tier != OnDevice {
		return nil
	}
	cfg := r.tiers.cfg
	size := memSize(s.mem)
	if cfg.HostBudget <= 0 && cfg.Disk != nil || s.persist && s.onDisk && s.diskClean && s.clean == nil {
		// No host tier, or its durable copy is current: straight to disk.
		return r.toDiskLocked(s)
	}
	if cfg.HostBudget <= 0 || cfg.Spill == nil || cfg.Mover == nil {
		return fmt.Errorf("%w: eviction to host memory is off (no host budget)", ErrNoRoom)
	}
	if s.clean != nil {
		// Its bytes are in host memory already, counted there.
		size = 0
	} else if !r.diskRoomLocked(size) {
		used := r.hostUseLocked()
		return fmt.Errorf("%w: evicting %q (%s) to host memory: %s of the host budget of %s in use",
			ErrNoRoom, s.name, fmtBytes(memSize(s.mem)), fmtBytes(used), fmtBytes(cfg.HostBudget))
	}
	r.tiers.spilling += size
	done := make(chan struct{})
	s.moving, s.copying = done, true
	n := memSize(s.mem)
	r.mu.Unlock()
	err := r.move(s, OnHost, n)
	r.mu.Lock()
	r.tiers.spilling -= size
	s.moving, s.copying = nil, false
	close(done)
	return err
}

// reserveLocked lets in capacity bytes more of s's device, for new memory
// of s (a file that grows in the FUSE view), evicting to make room as a
// create does. The old memory and the new are both on the device while
// the bytes are copied over, so both count until unreserve. mu is held,
// and dropped while segments move.
func (r *Registry) reserveLocked(s *Segment, capacity int64) error {
	n := r.roundSize(s.device, capacity)
	r.tiers.reserved[s.device] += n
	if err := r.roomLocked(s.device, s, n, fmt.Sprintf("growing %q to %s", s.name, fmtBytes(capacity))); err != nil {
		r.tiers.reserved[s.device] -= n
		return err
	}
	return nil
}

func (r *Registry) unreserve(d int, n int64) {
	r.mu.Lock()
	r.tiers.reserved[d] -= n
	r.mu.Unlock()
}

// restoreLocked moves s, on host, back to its device, making room first.
// mu is held, and dropped while segments move.
func (r *Registry) restoreLocked(s *Segment) error {
	size := memSize(s.mem)
	done := make(chan struct{})
	s.moving = done
	r.tiers.reserved[s.device] += size
	err := r.roomLocked(s.device, s, size, fmt.Sprintf("restoring %q (%s)", s.name, fmtBytes(size)))
	if err == nil {
		s.copying = true
		r.mu.Unlock()
		err = r.move(s, OnDevice, size)
		r.mu.Lock()
	}
	r.tiers.reserved[s.device] -= size
	s.moving, s.copying = nil, false
	close(done)
	return err
}

// onDeviceLocked waits out a move of s and restores s if it is on host,
// for an open: the descriptor handed out must be the device's. mu is held,
// and dropped while waiting.
func (r *Registry) onDeviceLocked(s *Segment) error {
	for {
		if s.gone {
			return fmt.Errorf("%w: %q was removed", ErrNotFound, s.name)
		}
		if s.moving != nil {
			r.waitLocked(s.moving)
			continue
		}
		if s.tier == OnDevice {
			return nil
		}
		if err := r.restoreLocked(s); err != nil {
			return fmt.Errorf("restore %q to device %d: %w", s.name, s.device, err)
		}
	}
}

// move copies s's bytes to the other tier and swaps its memory there, in
// one journaled change. s.moving is set, so nobody opens, evicts or
// restores s meanwhile; s.io, held exclusively, keeps the daemon's own
// copies (the FUSE view) out.
func (r *Registry) move(s *Segment, to Tier, size int64) error {
	start := time.Now()
	s.io.Lock()
	defer s.io.Unlock()
	r.mu.Lock()
	if s.gone || s.mem == nil {
		// Removed (or emptied) while this move waited for the daemon's
		// own copies to end: nothing is left to move, and an eviction
		// made its room all the same.
		name := s.name
		r.mu.Unlock()
		return fmt.Errorf("%w: %q was removed before it could move", ErrNotFound, name)
	}
	// The clean copy is this move's from here on: nothing else frees it.
	old, clean, name := s.mem, s.clean, s.name
	s.clean = nil
	parts := 1
	if to == OnHost {
		parts = r.spillPartsLocked()
		r.tiers.extraParts += parts - 1
		defer func() {
			r.mu.Lock()
			r.tiers.extraParts -= parts - 1
			r.mu.Unlock()
		}()
	}
	r.mu.Unlock()
	nm, clean, err := r.moveTarget(s, to, size, clean, parts)
	if err != nil {
		return fmt.Errorf("allocate %s on %s: %w", fmtBytes(size), tierPlace(to, s.device), err)
	}
	fromDisk := onDisk(old)
	switch {
	case fromDisk && r.tiers.cfg.Disk == nil:
		err = ErrNoDisk
	case fromDisk:
		err = r.tiers.cfg.Disk.Read(DiskKey(s.id), nm, min(size, memSize(nm), memSize(old)))
	case nm != clean:
		err = r.tiers.cfg.Mover.Move(nm, old, min(size, memSize(nm), memSize(old)))
	}
	fd := -1
	if err == nil {
		fd, err = r.durableFD(nm)
	}
	if err != nil {
		free(nm)
		return fmt.Errorf("copy %s of %q to %s: %w", fmtBytes(size), name, tierPlace(to, s.device), err)
	}
	r.mu.Lock()
	if s.gone || s.mem != old {
		r.mu.Unlock()
		free(nm)
		return fmt.Errorf("%w: %q was removed while it moved", ErrNotFound, name)
	}
	s.mem, s.tier = nm, to
	if fromDisk {
		old = nil
		if !s.persist {
			s.onDisk, s.diskClean = false, false
			r.removeDiskLater(s, DiskKey(s.id))
		}
	}
	if to == OnDevice && old != nil && r.hostUseLocked()+memSize(old) <= r.tiers.cfg.HostBudget &&
		(partsOf(old) == 1 || r.descRoomLocked(partsOf(old))) {
		// Kept while nobody writes, and while the host budget (and, for
		// memory in parts, the limit of descriptors) has room for it: the
		// next eviction is a swap.
		s.clean, old = old, nil
	}
	r.noteLocked(s, fd)
	kind := "evict"
	switch {
	case to == OnHost:
		r.tiers.stats.Evictions++
		r.tiers.stats.EvictedBytes += size
	case fromDisk:
		kind = "restore-disk"
		r.tiers.stats.DiskReads++
		r.tiers.stats.DiskReadBytes += size
	default:
		kind = "restore"
		r.tiers.stats.Restores++
		r.tiers.stats.RestoredBytes += size
	}
	observe := r.tiers.cfg.Observe
	syncer, _ := r.journal.(Syncer)
	r.mu.Unlock()
	if to == OnHost {
		// Device memory goes at once: a restore may be waiting for it.
		// The journal's keeper holds a descriptor of it too, which it
		// closes when it applies the record above: wait for that, so that
		// what the device holds never exceeds its budget, even for a
		// moment.
		err = free(old)
		if syncer != nil {
			syncer.Sync(time.Second)
		}
	} else if old != nil {
		// Host memory off the open's path (half a second at 4 GiB).
		r.freeLater(old)
	}
	if observe != nil {
		observe(kind, name, size, time.Since(start))
	}
	return err
}

// moveTarget is the memory a move of s to tier to copies into: s's clean
// copy (returned, or nil where it was let go of), which an eviction swaps
// back; new spill memory of at most parts descriptors; or memory on s's
// device. mu is not held.
func (r *Registry) moveTarget(s *Segment, to Tier, size int64, clean Memory, parts int) (Memory, Memory, error) {
	if clean != nil && partsOf(clean) > parts {
		// More descriptors than the limit leaves room for now.
		r.freeLater(clean)
		clean = nil
	}
	switch {
	case to == OnHost && clean != nil:
		// Nobody wrote it since it came back: its copy is current.
		return clean, clean, nil
	case to == OnHost:
		if sa, ok := r.tiers.cfg.Spill.(ScratchAllocator); ok {
			// Every byte is copied over.
			m, err := sa.AllocateScratch(0, size, parts)
			return m, clean, err
		}
		m, err := r.tiers.cfg.Spill.Allocate(0, size)
		return m, clean, err
	}
	m, err := r.allocate(s.device, size)
	return m, clean, err
}

func tierPlace(t Tier, d int) string {
	switch t {
	case OnHost:
		return "host memory"
	case OnDisk:
		return "disk"
	}
	return fmt.Sprintf("device %d", d)
}

func fmtBytes(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	v, i := float64(n), -1
	for v >= unit && i < 5 {
		v /= unit
		i++
	}
	return fmt.Sprintf("%.1f %ciB", v, "KMGTPE"[i])
}
