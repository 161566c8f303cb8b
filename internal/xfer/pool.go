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
// pins once. At most max kits exist; a copier waits for one, so that
// concurrent copies share a bounded amount of pinned memory.
type Pool struct {
	dev   *cuda.Device
	chunk int64
	max   int

	mu    sync.Mutex
	cond  *sync.Cond
	free  []*kit
	count int
}

type kit struct {
	pinned []byte
	stream *cuda.Stream
	ev     [2]*cuda.Event
}

// NewPool returns a pool of at most max kits of the default chunk size on
// dev, made as copiers first ask.
func NewPool(dev *cuda.Device, max int) *Pool {
	p := &Pool{dev: dev, chunk: defaultChunk, max: max}
	p.cond = sync.NewCond(&p.mu)
	return p
}

func (p *Pool) get() (*kit, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for {
		if n := len(p.free); n > 0 {
			k := p.free[n-1]
			p.free = p.free[:n-1]
			return k, nil
		}
		if p.count < p.max {
			p.count++
			p.mu.Unlock()
			k, err := newKit(p.dev, p.chunk)
			p.mu.Lock()
			if err == nil {
				return k, nil
			}
			p.count--
			if p.count == 0 {
				return nil, err
			}
			// Out of pinned memory, say: wait for a kit in use.
		}
		p.cond.Wait()
	}
}

// discard forgets a kit that is not lent again.
func (p *Pool) discard(k *kit) {
	k.close(p.dev)
	p.mu.Lock()
	p.count--
	p.mu.Unlock()
	p.cond.Signal()
}

func (p *Pool) put(k *kit) {
	p.mu.Lock()
	p.free = append(p.free, k)
	p.mu.Unlock()
	p.cond.Signal()
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
