package main

import (
	"context"
	"os"
	"time"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/crc32c"
)

// daemonStep is the most one fill or dump request copies when the daemon
// copies for put and get. A request is answered only when its copy is
// done, so a copy made in steps is one that a bar can follow and an
// interrupt can stop (the daemon finishes the step under way, and no
// more): 256 MiB is a tenth of a second at PCIe speed, under a second from
// a cold disk, and enough chunks (32 of the engine's 8 MiB) to keep every
// copier busy. Each step costs a round trip and the engine's start:
// nothing next to the copy (docs/cli.md, "Progress and interrupts").
const daemonStep = 256 << 20

// fillSteps has the daemon copy n bytes of f, from its start, into seg,
// in steps of daemonStep, telling bar of each. The stats add up the
// steps'; their CRC-32Cs make the file's (crc32c.Combine), or none if the
// daemon sent none.
func fillSteps(ctx context.Context, seg *gpushm.Segment, f *os.File, n int64, bar *progress) (gpushm.CopyStats, error) {
	return steps(n, bar, func(off, k int64) (gpushm.CopyStats, error) {
		return seg.Fill(ctx, f, off, off, k)
	})
}

// dumpSteps has the daemon copy seg's n bytes into f, in steps, as
// fillSteps does.
func dumpSteps(ctx context.Context, seg *gpushm.Segment, f *os.File, n int64, bar *progress) (gpushm.CopyStats, error) {
	return steps(n, bar, func(off, k int64) (gpushm.CopyStats, error) {
		return seg.Dump(ctx, f, off, off, k)
	})
}

func steps(n int64, bar *progress, step func(off, n int64) (gpushm.CopyStats, error)) (gpushm.CopyStats, error) {
	var st gpushm.CopyStats
	start := time.Now()
	hashed := true
	var crc uint32
	for off := int64(0); off < n; {
		k := min(n-off, daemonStep)
		s, err := step(off, k)
		if err != nil {
			return st, err
		}
		st.Bytes += s.Bytes
		st.Direct += s.Direct
		st.Elapsed += s.Elapsed
		st.Workers = max(st.Workers, s.Workers)
		if len(s.CRC32C) == 1 && hashed {
			crc = crc32c.Combine(crc, s.CRC32C[0], k)
		} else {
			hashed = false
		}
		bar.add(k)
		off += k
	}
	if hashed && n > 0 {
		st.CRC32C = []uint32{crc}
	}
	st.Wall = time.Since(start)
	return st, nil
}
