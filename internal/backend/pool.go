package backend

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/wire"
)

// A pool keeps allocations made ahead of need, so that a create of a size
// seen before takes one that is ready instead of waiting for the work a
// fresh allocation costs: on cuda, cuMemCreate and the export to a file
// descriptor (about 0.6 ms for 2 MiB, milliseconds for a GiB, on an H200),
// which the supervisor must hold before a create is acknowledged; on host
// memory, the kernel zeroing the pages fallocate commits (about 0.25 ms a
// MiB on a small VM). A size is made ahead once it is asked for a second
// time (a single create, a file put once, leaves nothing made ahead
// behind it); a create that takes one has its replacement made, so a
// service that creates segments of a few sizes, one request at a time,
// pays for none of them. The making starts once the create that asked has
// been answered (refill), not while it is: starting a goroutine wakes a
// thread, a few microseconds on the create's path, and on a machine of
// few cores the allocation would compete with the reply for a processor.
//
// What is pooled was never handed to anyone: fresh memory, made for the
// pool, given out once. Nothing that held a client's data comes back to it
// (another process may still have that mapped). Pooled memory is not
// journaled: if the serving process dies, it dies with it. It is bounded
// by limit, and a size not asked for again within idle is given back.
type pool struct {
	alloc func(size int64) (segment.Memory, error)
	limit int64         // bytes ready or being made, at most
	depth int           // allocations ready per size, at most
	idle  time.Duration // a size not taken for this long is freed

	mu     sync.Mutex
	sizes  map[int64]*poolSize
	bytes  int64
	closed bool
	// pending are allocations counted as being made (making, bytes) whose
	// making refill has yet to start; queued tells without the lock, and
	// kick starts them if nobody calls refill (an allocation outside the
	// server: the FUSE view's).
	pending []pendingMake
	queued  atomic.Bool
	kick    *time.Timer
}

type pendingMake struct {
	size int64
	ps   *poolSize
}

// kickAfter is how long pending allocations wait for a refill before the
// pool starts them itself.
const kickAfter = time.Millisecond

// maxPoolSizes bounds the sizes a pool keeps allocations of at once.
const maxPoolSizes = 16

type poolSize struct {
	ready  []segment.Memory
	making int
	taken  time.Time // last take, or last miss
	trim   *time.Timer
}

func newPool(limit int64, alloc func(size int64) (segment.Memory, error)) *pool {
	return &pool{alloc: alloc, limit: limit, depth: 2, idle: 30 * time.Second, sizes: make(map[int64]*poolSize)}
}

// take returns a ready allocation of exactly size bytes, or nil, and sees
// that the pool makes more of that size.
func (p *pool) take(size int64) segment.Memory {
	if p == nil || p.limit <= 0 {
		return nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil
	}
	ps := p.sizes[size]
	seen := ps != nil
	if !seen {
		if len(p.sizes) >= maxPoolSizes {
			// Each allocation ready holds a descriptor: a client that
			// creates segments of many sizes must not make it hold many.
			return nil
		}
		ps = &poolSize{}
		p.sizes[size] = ps
	}
	ps.taken = time.Now()
	var m segment.Memory
	if n := len(ps.ready); n > 0 {
		m, ps.ready = ps.ready[n-1], ps.ready[:n-1]
		p.bytes -= size
		if pm, ok := m.(interface{ setPooled() }); ok {
			pm.setPooled()
		}
	}
	if seen {
		p.fillLocked(size, ps)
	} else {
		p.armTrimLocked(size, ps)
	}
	return m
}

// fillLocked starts making allocations of size until depth are ready or
// being made, within the limit.
func (p *pool) fillLocked(size int64, ps *poolSize) {
	for len(ps.ready)+ps.making < p.depth && p.bytes+size <= p.limit {
		ps.making++
		p.bytes += size
		p.pending = append(p.pending, pendingMake{size, ps})
		p.queued.Store(true)
		if p.kick == nil {
			p.kick = time.AfterFunc(kickAfter, p.refill)
		} else {
			p.kick.Reset(kickAfter)
		}
	}
	p.armTrimLocked(size, ps)
}

// armTrimLocked has size given back if nobody asks for it within idle.
func (p *pool) armTrimLocked(size int64, ps *poolSize) {
	if ps.trim == nil {
		ps.trim = time.AfterFunc(p.idle, func() { p.trimSize(size) })
	} else {
		ps.trim.Reset(p.idle)
	}
}

// refill starts making what creates took or asked for. The server calls
// it once a reply is sent; kick, a moment after a take, if nobody did.
func (p *pool) refill() {
	if p == nil || !p.queued.Load() {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, pm := range p.pending {
		if p.closed || p.sizes[pm.size] != pm.ps {
			pm.ps.making--
			p.bytes -= pm.size
			continue
		}
		go p.makeOne(pm.size, pm.ps)
	}
	p.pending = nil
	p.queued.Store(false)
}

func (p *pool) makeOne(size int64, ps *poolSize) {
	m, err := p.alloc(size)
	p.mu.Lock()
	defer p.mu.Unlock()
	ps.making--
	if err != nil || p.closed || p.sizes[size] != ps {
		p.bytes -= size
		if m != nil {
			m.Free()
		}
		return
	}
	ps.ready = append(ps.ready, m)
}

// trimSize gives back what was made for a size nobody has asked for lately.
func (p *pool) trimSize(size int64) {
	p.mu.Lock()
	ps := p.sizes[size]
	if ps == nil || time.Since(ps.taken) < p.idle {
		p.mu.Unlock()
		return
	}
	delete(p.sizes, size)
	free := ps.ready
	p.bytes -= int64(len(free)) * size
	p.mu.Unlock()
	for _, m := range free {
		m.Free()
	}
}

// drain frees everything ready, for an allocation that ran out of memory:
// memory made ahead must never be why a create fails. It reports whether
// it freed anything.
func (p *pool) drain() bool {
	if p == nil {
		return false
	}
	p.mu.Lock()
	var free []segment.Memory
	for size, ps := range p.sizes {
		free = append(free, ps.ready...)
		p.bytes -= int64(len(ps.ready)) * size
		ps.ready = nil
	}
	p.mu.Unlock()
	for _, m := range free {
		m.Free()
	}
	return len(free) > 0
}

// stats reports what the pool holds, for info.
func (p *pool) stats() wire.Pool {
	var s wire.Pool
	if p == nil {
		return s
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for size, ps := range p.sizes {
		s.Ready += len(ps.ready)
		s.Bytes += int64(len(ps.ready)) * size
		if ps.making > 0 {
			s.Filling++
		}
	}
	return s
}

// ready reports the bytes the pool holds ready.
func (p *pool) ready() int64 { return p.stats().Bytes }

// close frees what is ready; allocations still being made are freed as
// they finish.
func (p *pool) close() {
	if p == nil {
		return
	}
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	p.drain()
}
