package server

import (
	"fmt"
	"io"
	"syscall"
	"time"

	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/wire"
)

// waitVersion answers wait_version: the Info of the segment req.Name
// names once that is not req.Segment (a reader's version was replaced),
// within req.Wait seconds. Like an open's wait for a commit, it watches
// for the client hanging up, and an upgrade hands it to the successor
// with what is left of its time.
func (c *conn) waitVersion(req *wire.Request) (segment.Info, error) {
	if !(req.Wait > 0 && req.Wait <= maxWait.Seconds()) {
		return segment.Info{}, fmt.Errorf("wait of %g seconds (want more than 0, at most %g): %w", req.Wait, maxWait.Seconds(), syscall.EINVAL)
	}
	if req.Segment == 0 {
		return segment.Info{}, fmt.Errorf("no segment: name the version you hold: %w", syscall.EINVAL)
	}
	deadline := time.Now().Add(time.Duration(req.Wait * float64(time.Second)))
	timer := time.NewTimer(time.Until(deadline))
	defer timer.Stop()
	tick := time.NewTicker(hangupEvery)
	defer tick.Stop()
	for waiting := false; ; {
		inf, ready, changed, err := c.s.reg.WaitVersion(req.Name, req.Segment)
		if ready || err != nil {
			return inf, err
		}
		if !waiting {
			waiting = true
			c.s.waiting.Add(1)
			defer c.s.waiting.Add(-1)
		}
		select {
		case <-changed:
			continue
		case <-tick.C:
			if c.hungUp() {
				return segment.Info{}, fmt.Errorf("the client hung up while waiting for a new version of %q: %w", req.Name, io.EOF)
			}
			continue
		case <-c.s.waitStopped():
			if !c.s.isParking() {
				return segment.Info{}, fmt.Errorf("the daemon is stopping: %w", syscall.EIO)
			}
			if left := time.Until(deadline); left > 0 {
				again := *req
				again.Wait = left.Seconds()
				b, err := wire.Encode(&again)
				if err != nil {
					return segment.Info{}, err
				}
				c.pending = b
				return segment.Info{}, errParked
			}
		case <-timer.C:
		}
		inf, ready, _, err = c.s.reg.WaitVersion(req.Name, req.Segment)
		if ready || err != nil {
			return inf, err
		}
		return segment.Info{}, fmt.Errorf("%q named segment %d still after %gs: %w", req.Name, req.Segment, req.Wait, syscall.ETIMEDOUT)
	}
}
