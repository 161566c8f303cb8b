package xfer

import (
	"time"

	"github.com/gpushm/gpushm/internal/crc32c"
)

// A request that has the daemon copy (fill, dump) is answered only when
// its copy is done, so a client that shows progress, or must stop at an
// interrupt, asks in steps: the bar moves at each answer, and an interrupt
// stops the copy at the end of the step under way. A step costs a round
// trip and the engine's start and end, where not all of its copiers are
// busy: 2 to 3 ms on an H200, a quarter of a 256 MiB step's time from the
// page cache at 40 GB/s, nothing next to the same step from a cold disk.
// So the first step is small, to show progress within a second whatever
// the source, and later ones are sized from the rate seen to take
// StepTime each, up to MaxStep: a few steps a second, each costing about
// 1% of its time.
const (
	MinStep  = 256 << 20
	MaxStep  = 4 << 30
	StepTime = 250 * time.Millisecond
)

// NextStep is the size of the step after one of k bytes that took d: one
// that takes StepTime at that rate, at most 4 times larger, in whole MiB,
// between MinStep and MaxStep.
func NextStep(k int64, d time.Duration) int64 {
	next := int64(MaxStep)
	if d > 0 {
		next = int64(float64(k) * StepTime.Seconds() / d.Seconds())
	}
	next = min(next, 4*k, MaxStep)
	return max(next&^(1<<20-1), MinStep)
}

// Steps copies n bytes with step, called for each step's offset (from 0)
// and length in turn, and tells progress (if set) of each step done. The
// stats add up the steps'; their CRC-32Cs, when every step has one, make
// the whole range's (crc32c.Combine).
func Steps(n int64, progress func(int64), step func(off, n int64) (Stats, error)) (Stats, error) {
	var st Stats
	start := time.Now()
	hashed := true
	var crc uint32
	for off, size := int64(0), int64(MinStep); off < n; {
		k := min(n-off, size)
		t := time.Now()
		s, err := step(off, k)
		if err != nil {
			return st, err
		}
		size = NextStep(k, time.Since(t))
		st.Bytes += s.Bytes
		st.Direct += s.Direct
		st.Elapsed += s.Elapsed
		st.Workers = max(st.Workers, s.Workers)
		if hashed = hashed && len(s.CRC32C) == 1; hashed {
			crc = crc32c.Combine(crc, s.CRC32C[0], k)
		}
		if progress != nil {
			progress(k)
		}
		off += k
	}
	if hashed && n > 0 {
		st.CRC32C = []uint32{crc}
	}
	st.Wall = time.Since(start)
	return st, nil
}
