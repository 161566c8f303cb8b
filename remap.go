package gpushm

import (
	"context"
	"errors"
	"fmt"
	"syscall"
	"time"

	"github.com/gpushm/gpushm/internal/wire"
)

// Release, Reacquire and Refresh act on the lease and mapping that every
// Segment of this client sharing them uses (Open shares them between opens
// of the same name). The lifecycle is in docs/protocol.md, "Release and
// reacquire" and "Versions".

// ErrStale is returned by Reacquire when the segment's name names a newer
// version than the one released: Refresh maps that one at the same
// addresses.
var ErrStale = errors.New("gpushm: the name names a newer version now")

// Release gives the segment's memory back and keeps its addresses: the
// lease ends (the daemon counts the segment as not held, so its budget may
// evict it to host memory and others may use the room), the mapping's
// address range stays reserved, and nothing else is mapped there.
// Pointers into it fault until Reacquire or Refresh maps the memory again
// at the same addresses. GPU work queued on the range is waited for first.
// The segment must be mapped (Map). Releasing twice is a no-op.
func (s *Segment) Release(ctx context.Context) error {
	if s.closed {
		return errors.New("gpushm: release of a closed segment")
	}
	return s.sh.release(ctx)
}

// Release is Segment.Release, for the segment this mapping maps.
func (m *Mapping) Release(ctx context.Context) error { return m.owner.release(ctx) }

// Reacquire is Segment.Reacquire, for the segment this mapping maps.
func (m *Mapping) Reacquire(ctx context.Context) error {
	_, err := m.owner.remapTo(ctx, false)
	return err
}

// Refresh is Segment.Refresh, for the segment this mapping maps.
func (m *Mapping) Refresh(ctx context.Context) (bool, error) { return m.owner.remapTo(ctx, true) }

func (sh *shared) release(ctx context.Context) error {
	c := sh.c
	sh.remap.Lock()
	defer sh.remap.Unlock()
	sh.mu.Lock()
	if sh.mapping == nil {
		sh.mu.Unlock()
		return fmt.Errorf("gpushm: release %q: not mapped (Map it first; a segment never mapped holds no addresses to keep)", sh.info.Name)
	}
	if sh.released {
		sh.mu.Unlock()
		return nil
	}
	if err := sh.mapping.releaseMemory(); err != nil {
		sh.mu.Unlock()
		return fmt.Errorf("gpushm: release %q: %w", sh.info.Name, err)
	}
	sh.released = true
	noLease := sh.noLease
	sh.mu.Unlock()
	c.forget(sh)
	if noLease {
		return nil
	}
	if _, _, err := c.roundTrip(ctx, &wire.Request{Op: wire.OpClose, Segment: sh.info.ID}); err != nil {
		return fmt.Errorf("gpushm: release %q: %w", sh.info.Name, err)
	}
	return nil
}

// Released reports whether the segment's memory is released.
func (s *Segment) Released() bool { return s.sh.Released() }

// Reacquire maps the released segment again at the same addresses, with a
// new lease; the daemon brings it back from host memory first if it was
// evicted. Tensors, device pointers and CUDA graphs made before keep
// working. When the name now names a newer version, it fails with
// ErrStale and leaves the segment released: Refresh maps the new one.
// Reacquiring a segment that is not released is a no-op.
func (s *Segment) Reacquire(ctx context.Context) error {
	if s.closed {
		return errors.New("gpushm: reacquire of a closed segment")
	}
	_, err := s.sh.remapTo(ctx, false)
	return err
}

// Refresh maps the version the segment's name names now at the segment's
// addresses, in place of the one mapped (or released), and ends the lease
// on the old one, which the daemon frees once its last reader moved on.
// It reports whether the version changed; with the same version it leaves
// a mapped segment as it is and reacquires a released one. The new version
// must fit the address range (its allocated size at most the first
// version's; EFBIG otherwise). Nothing may use the old version's memory
// meanwhile: finish the GPU work that reads it first (Refresh waits for
// the device, but not for other processes or work queued later). A
// version smaller than the one mapped is refused too (EINVAL): what was
// taken of the old one would reach past its end.
func (s *Segment) Refresh(ctx context.Context) (bool, error) {
	if s.closed {
		return false, errors.New("gpushm: refresh of a closed segment")
	}
	return s.sh.remapTo(ctx, true)
}

func (sh *shared) remapTo(ctx context.Context, anyVersion bool) (bool, error) {
	c := sh.c
	// One remap at a time; sh.mu is not held across round trips, which
	// may reconnect, and reclaiming leases takes it.
	sh.remap.Lock()
	defer sh.remap.Unlock()
	sh.mu.Lock()
	mapped, released, noLease := sh.mapping != nil, sh.released, sh.noLease
	name, old := sh.info.Name, sh.info.ID
	sh.mu.Unlock()
	if !mapped {
		return false, fmt.Errorf("gpushm: %q is not mapped (Map it first)", name)
	}
	if !released && !anyVersion {
		return false, nil
	}
	ep := c.epoch.Load().Load()
	rep, fd, err := c.roundTrip(ctx, &wire.Request{Op: wire.OpOpen, Name: name, ReadOnly: sh.readOnly})
	if err != nil {
		return false, fmt.Errorf("gpushm: open %q again: %w", name, err)
	}
	defer closeFD(fd)
	closeFD(rep.CtlFD)
	info := rep.Segment
	endLease := func(id uint64) {
		c.roundTrip(context.Background(), &wire.Request{Op: wire.OpClose, Segment: id})
	}
	sh.mu.Lock()
	reserved, size := sh.mapping.reserved, sh.mapping.size
	sh.mu.Unlock()
	switch {
	case info.ID == old && !released:
		endLease(info.ID) // the same version, still mapped: nothing to do
		return false, nil
	case info.ID != old && !anyVersion:
		endLease(info.ID)
		return false, fmt.Errorf("gpushm: reacquire %q: segment %d was released, and the name names segment %d (version %d) now: %w",
			name, old, info.ID, info.Version, ErrStale)
	case info.AllocSize > reserved:
		endLease(info.ID)
		return false, fmt.Errorf("gpushm: refresh %q: version %d needs %d bytes of addresses, and the mapping keeps %d (open it anew): %w",
			name, info.Version, info.AllocSize, reserved, syscall.EFBIG)
	case info.Size < size:
		// Slices and pointers taken before would reach past its end, into
		// addresses that fault.
		endLease(info.ID)
		return false, fmt.Errorf("gpushm: refresh %q: version %d has %d bytes, fewer than the %d mapped (open it anew): %w",
			name, info.Version, info.Size, size, syscall.EINVAL)
	}
	held := !released && !noLease
	sh.mu.Lock()
	err = sh.mapping.releaseMemory()
	if err == nil {
		sh.released = true
		err = sh.mapping.remap(fd, info, sh.devices)
		if err == nil {
			sh.released, sh.noLease = false, false
			sh.info, sh.epoch = *info, ep
		}
	}
	sh.mu.Unlock()
	c.forget(sh)
	if err != nil {
		// Released now, if the old memory could be unmapped: its lease
		// ends too, and a later Refresh may try again.
		endLease(info.ID)
		if held && sh.Released() {
			endLease(old)
		}
		return false, fmt.Errorf("gpushm: map %q at its addresses: %w", name, err)
	}
	if held {
		if _, _, err := c.roundTrip(ctx, &wire.Request{Op: wire.OpClose, Segment: old}); err != nil {
			return true, fmt.Errorf("gpushm: refresh %q: end the lease on segment %d: %w", name, old, err)
		}
	}
	return info.ID != old, nil
}

// Released reports whether sh's memory is released.
func (sh *shared) Released() bool {
	sh.mu.Lock()
	defer sh.mu.Unlock()
	return sh.released
}

// forget takes sh out of the cache of opens by name: it no longer maps the
// version a new Open of the name would get.
func (c *Client) forget(sh *shared) {
	c.cmu.Lock()
	if c.cache[sh.key] == sh {
		delete(c.cache, sh.key)
	}
	c.cmu.Unlock()
}

// Version is the version of its name the segment is (1 for the first;
// each commit of a next version adds one).
func (s *Segment) Version() uint64 {
	s.sh.mu.Lock()
	defer s.sh.mu.Unlock()
	return max(s.sh.info.Version, 1)
}

// Stale reports whether the segment's name names another segment now (a
// newer version, most often). It sends nothing while the daemon's epoch
// page has not moved since the segment was opened or refreshed, so
// polling it costs an atomic load.
func (s *Segment) Stale(ctx context.Context) (bool, error) {
	sh, c := s.sh, s.sh.c
	sh.mu.Lock()
	name, id, ep := sh.info.Name, sh.info.ID, sh.epoch
	sh.mu.Unlock()
	now := c.epoch.Load().Load()
	if now == ep {
		return false, nil
	}
	inf, err := c.Stat(ctx, name)
	if errors.Is(err, syscall.ENOENT) {
		return true, nil
	}
	if err != nil {
		return false, err
	}
	if inf.ID == id {
		// Something else moved the epoch: remember it, so that the next
		// poll is free again.
		sh.mu.Lock()
		if sh.info.ID == id {
			sh.epoch = now
		}
		sh.mu.Unlock()
	}
	return inf.ID != id, nil
}

// WaitVersion waits, at most timeout (and at most an hour), until the
// segment's name names another segment than this one, and returns that
// one's state: a writer made a new version current. It fails with
// ETIMEDOUT when the time is up, and ENOENT when the name was removed.
// Refresh then maps the new version.
func (s *Segment) WaitVersion(ctx context.Context, timeout time.Duration) (*SegmentInfo, error) {
	sh, c := s.sh, s.sh.c
	sh.mu.Lock()
	name, id := sh.info.Name, sh.info.ID
	sh.mu.Unlock()
	if dl, ok := ctx.Deadline(); ok {
		timeout = min(timeout, time.Until(dl)-time.Until(dl)/10)
	}
	if timeout <= 0 {
		return nil, fmt.Errorf("gpushm: wait for a version of %q: timeout %s: %w", name, timeout, syscall.EINVAL)
	}
	rep, _, err := c.roundTrip(ctx, &wire.Request{Op: wire.OpWaitVersion, Name: name, Segment: id, Wait: timeout.Seconds()})
	if err != nil {
		return nil, fmt.Errorf("gpushm: wait for a version of %q: %w", name, err)
	}
	return rep.Segment, nil
}
