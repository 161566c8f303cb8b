package xfer

import (
	"context"
	"fmt"
)

// Move copies t.Size bytes between t and host memory: from host into t
// when in is true, from t into host otherwise. It is the copy engine's
// memory-to-memory form, for the daemon's moves of a segment between a
// GPU and host memory: several copiers each move their own chunks, on
// cuda through their two pinned buffers and stream, so that one copier's
// memcpy overlaps another's DMA, and the page faults of new host memory
// are taken on several cores at once. On host targets the copiers copy
// directly.
func Move(t Target, host []byte, in bool, o *Options) (st Stats, err error) {
	o, chunk, err := o.check()
	if err != nil {
		return st, err
	}
	if int64(len(host)) < t.Size {
		return st, fmt.Errorf("xfer: move of %d bytes with %d bytes of host memory", t.Size, len(host))
	}
	var steps []step
	for at := int64(0); at < t.Size; at += chunk {
		n := min(chunk, t.Size-at)
		steps = append(steps, step{mem: host[at : at+n], len: n, at: at})
	}
	st.Bytes, st.Chunk = t.Size, chunk
	return run(context.Background(), t, steps, st, o, in)
}
