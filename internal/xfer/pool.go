package xfer

import (
	"errors"
	"fmt"
	"sync"

	"github.com/gpushm/gpushm/internal/cuda"
)

// A Pool lends copiers on one GPU what they would otherwise make for every
// copy: two pinned buffers of Chunk bytes, a stream and two events. Pinning
// costs milliseconds a buffer; a process that copies often (the daemon)
// pins once. At most max kits are kept, so that concurrent copies share a
// bounded amount of pinned memory.
//
// A copier holds its kit from its copy's start to its end, and a copy can
// last as long as its file's reads do: a read from a FUSE file whose
// server never answers does not return, and nothing the daemon can do
// interrupts it (docs/security.md, "Resources"). So no copy waits for a
// kit another holds: a copy's first copier takes a free kit, or makes one
// while fewer than max exist, or else pins one of its own for the copy's
// length, beyond the pool (its first chunk then pays the pinning); the
// copy's other copiers take free kits, up to the copy's share (half the
// pool), and otherwise wait for one to come back only while their copy
// has chunks left. A copy stuck in its reads holds at most half the pool,
// and the copies after it always run, with fewer copiers while the kits
// are taken.
type Pool struct {
	dev   *cuda.Device
	chunk int64
	max   int
	// make makes a kit: newKit on dev (a test's fake otherwise).
	make func() (*kit, error)

	mu    sync.Mutex
	free  []*kit
	count int // kits of the pool, free or lent
	// back is closed, and made anew, when a kit comes back (or one may be
	// made again): copiers waiting for one look again.
	back chan struct{}
}

type kit struct {
	pinned []byte
	stream *cuda.Stream
	ev     [2]*cuda.Event
	// own: made for one copy beyond the pool, and closed at its end.
	own bool
}

// A loan counts the kits one copy holds of the pool, under its mu.
type loan struct{ held int }

// NewPool returns a pool of at most max kits of the default chunk size on
// dev, made as copiers first ask.
func NewPool(dev *cuda.Device, max int) *Pool {
	return &Pool{dev: dev, chunk: defaultChunk, max: max, back: make(chan struct{}),
		make: func() (*kit, error) { return newKit(dev, defaultChunk) }}
}

// share is the most kits of the pool one copy holds.
func (p *Pool) share() int { return max(1, p.max/2) }

// get lends a kit to a copier of the copy l, as the Pool's comment says:
// the copy's first copier always gets one, at once; another gets one of
// the pool, or waits for one until over or stop is closed, and then gets
// nil (it does not copy).
func (p *Pool) get(l *loan, first bool, over, stop <-chan struct{}) (*kit, error) {
	p.mu.Lock()
	for {
		if l.held < p.share() {
			if n := len(p.free); n > 0 {
				k := p.free[n-1]
				p.free = p.free[:n-1]
				l.held++
				p.mu.Unlock()
				return k, nil
			}
			if p.count < p.max {
				p.count++
				l.held++
				p.mu.Unlock()
				k, err := p.make()
				if err == nil {
					return k, nil
				}
				p.mu.Lock()
				p.count--
				l.held--
				if first || p.count == 0 {
					p.mu.Unlock()
					return nil, err
				}
				// Out of pinned memory, say: wait for a kit in use.
			}
		}
		if first {
			p.mu.Unlock()
			k, err := p.make()
			if err != nil {
				return nil, err
			}
			k.own = true
			return k, nil
		}
		back := p.back
		p.mu.Unlock()
		select {
		case <-back:
		case <-over:
			return nil, nil
		case <-stop:
			return nil, nil
		}
		p.mu.Lock()
	}
}

// returned tells waiting copiers that a kit came back; mu is held.
func (p *Pool) returned() {
	close(p.back)
	p.back = make(chan struct{})
}

// discard forgets a kit of l's that is not lent again.
func (p *Pool) discard(l *loan, k *kit) {
	k.close(p.dev)
	if k.own {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.count--
	l.held--
	p.returned()
}

// put takes back a kit l borrowed; one made beyond the pool is closed.
func (p *Pool) put(l *loan, k *kit) {
	if k.own {
		k.close(p.dev)
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.free = append(p.free, k)
	l.held--
	p.returned()
}

func newKit(dev *cuda.Device, chunk int64) (*kit, error) {
	k := &kit{}
	var err error
	if k.pinned, err = dev.AllocHost(2 * chunk); err != nil {
		return nil, fmt.Errorf("xfer: staging buffers: %w", err)
	}
	if k.stream, err = dev.NewStream(); err != nil {
		k.close(dev)
		return nil, fmt.Errorf("xfer: stream: %w", err)
	}
	for i := range k.ev {
		if k.ev[i], err = dev.NewSyncEvent(); err != nil {
			k.close(dev)
			return nil, fmt.Errorf("xfer: event: %w", err)
		}
	}
	return k, nil
}

func (k *kit) close(dev *cuda.Device) error {
	var errs []error
	if k.stream != nil {
		errs = append(errs, k.stream.Close())
	}
	for _, e := range k.ev {
		if e != nil {
			errs = append(errs, e.Close())
		}
	}
	if k.pinned != nil {
		errs = append(errs, dev.FreeHost(k.pinned))
	}
	return errors.Join(errs...)
}
