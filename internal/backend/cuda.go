package backend

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"

	"github.com/gpushm/gpushm/internal/cuda"
	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/wire"
)

// CUDA allocates VMM memory (cuMemCreate) on the GPUs it serves and exports
// each allocation once as a POSIX file descriptor.
type CUDA struct {
	devs  map[int]*cudaDevice
	order []int
}

type cudaDevice struct {
	d     *cuda.Device
	gran  int64
	total int64
	pool  *pool
}

// NewCUDA opens the GPUs that devices names: "" or "all" for every GPU, or
// a comma-separated list of ordinals and UUIDs ("0,2" or "GPU-5e6f...").
// It fails with ErrNoGPU when the driver is missing or no device supports
// VMM with POSIX fd handles.
func NewCUDA(devices string) (*CUDA, error) {
	if err := cuda.Init(); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrNoGPU, err)
	}
	n, err := cuda.DeviceCount()
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrNoGPU, err)
	}
	if n == 0 {
		return nil, fmt.Errorf("%w: the driver sees no device", ErrNoGPU)
	}
	ordinals, err := resolveDevices(devices, n)
	if err != nil {
		return nil, err
	}
	explicit := devices != "" && devices != "all"
	c := &CUDA{devs: make(map[int]*cudaDevice)}
	for _, i := range ordinals {
		d, err := cuda.GetDevice(i)
		if err != nil {
			return nil, fmt.Errorf("GPU %d: %w", i, err)
		}
		ok, err := d.VMMSupported()
		if err != nil {
			return nil, fmt.Errorf("GPU %d: %w", i, err)
		}
		if !ok {
			if explicit {
				return nil, fmt.Errorf("%w: GPU %d lacks VMM with POSIX fd handles", ErrNoGPU, i)
			}
			continue
		}
		g, err := d.Granularity()
		if err != nil {
			return nil, fmt.Errorf("GPU %d: %w", i, err)
		}
		total, err := d.TotalMem()
		if err != nil {
			return nil, fmt.Errorf("GPU %d: %w", i, err)
		}
		c.devs[i] = &cudaDevice{d: d, gran: g, total: int64(total)}
		c.order = append(c.order, i)
	}
	if len(c.order) == 0 {
		return nil, fmt.Errorf("%w: no GPU supports VMM with POSIX fd handles", ErrNoGPU)
	}
	return c, nil
}

// Name implements Backend.
func (c *CUDA) Name() string { return "cuda" }

// resolveDevices reads a --devices list against the n GPUs the driver sees.
func resolveDevices(spec string, n int) ([]int, error) {
	if spec == "" || spec == "all" {
		all := make([]int, n)
		for i := range all {
			all[i] = i
		}
		return all, nil
	}
	var out []int
	for _, item := range strings.Split(spec, ",") {
		item = strings.TrimSpace(item)
		i, err := strconv.Atoi(item)
		if err != nil {
			if i, err = deviceByUUID(item, n); err != nil {
				return nil, err
			}
		}
		if i < 0 || i >= n {
			return nil, fmt.Errorf("no GPU %d (this machine has %d)", i, n)
		}
		if slices.Contains(out, i) {
			return nil, fmt.Errorf("GPU %d named twice in %q", i, spec)
		}
		out = append(out, i)
	}
	return out, nil
}

// deviceByUUID finds the GPU with that UUID, with or without "GPU-".
func deviceByUUID(uuid string, n int) (int, error) {
	want := strings.TrimPrefix(strings.ToLower(uuid), "gpu-")
	for i := range n {
		d, err := cuda.GetDevice(i)
		if err != nil {
			return 0, err
		}
		u, err := d.UUID()
		if err != nil {
			return 0, err
		}
		if strings.TrimPrefix(strings.ToLower(u), "gpu-") == want {
			return i, nil
		}
	}
	return 0, fmt.Errorf("no GPU with UUID %q (gpushm info lists them)", uuid)
}

// HandleType implements segment.Allocator.
func (c *CUDA) HandleType() string { return wire.HandleCUDA }

// DefaultDevice implements Backend: the lowest ordinal served.
func (c *CUDA) DefaultDevice() int { return c.order[0] }

// Close implements Backend. Primary contexts stay retained for the life of
// the process; nothing else is held here.
func (c *CUDA) Close() error {
	for _, d := range c.devs {
		d.pool.close()
	}
	return nil
}

func (c *CUDA) device(i int) (*cudaDevice, error) {
	d := c.devs[i]
	if d == nil {
		return nil, fmt.Errorf("%w: GPU %d (served: %v)", segment.ErrNoDevice, i, c.order)
	}
	return d, nil
}

// Capacity implements segment.Allocator.
func (c *CUDA) Capacity(device int) (int64, error) {
	d, err := c.device(device)
	if err != nil {
		return 0, err
	}
	return d.total, nil
}

// Allocate implements segment.Allocator: size rounds up to the device's
// granularity. It returns once cuMemCreate has succeeded, which is where
// running out of memory shows; the export to a file descriptor (about 0.6 ms
// on an H200, most of a create) runs in the background, and the first FD
// waits for it. The fd is kept until Free.
func (c *CUDA) Allocate(device int, size int64) (segment.Memory, error) {
	d, err := c.device(device)
	if err != nil {
		return nil, err
	}
	alloc := (size + d.gran - 1) / d.gran * d.gran
	if m := d.pool.take(alloc); m != nil {
		return m, nil
	}
	h, err := d.d.Create(alloc)
	if err != nil && errors.Is(err, cuda.ErrOutOfMemory) && d.pool.drain() {
		h, err = d.d.Create(alloc)
	}
	if err != nil {
		return nil, errnoFor(err)
	}
	m := &cudaMemory{d: d.d, h: h, size: alloc, fd: -1, done: make(chan struct{})}
	go func() {
		defer close(m.done)
		m.export()
	}()
	return m, nil
}

// Pool makes allocations ahead of creates on each GPU, up to limit bytes a
// GPU (0: none). A pooled allocation is exported before it is given out.
func (c *CUDA) Pool(limit int64) {
	for _, d := range c.devs {
		d.pool.close()
		d.pool = newPool(limit, func(size int64) (segment.Memory, error) {
			h, err := d.d.Create(size)
			if err != nil {
				return nil, errnoFor(err)
			}
			m := &cudaMemory{d: d.d, h: h, size: size, fd: -1, done: make(chan struct{})}
			m.export()
			close(m.done)
			if m.err != nil {
				m.Free()
				return nil, m.err
			}
			return m, nil
		})
	}
}

// PoolStats reports what the pools hold, on all GPUs, for info.
func (c *CUDA) PoolStats() wire.Pool {
	var s wire.Pool
	for _, d := range c.devs {
		ds := d.pool.stats()
		s.Ready, s.Bytes, s.Filling = s.Ready+ds.Ready, s.Bytes+ds.Bytes, s.Filling+ds.Filling
	}
	return s
}

// Refill makes what creates took from the pools; the server calls it once
// their replies are sent.
func (c *CUDA) Refill() {
	for _, d := range c.devs {
		d.pool.refill()
	}
}

// errnoFor attaches the errno the protocol reports to a driver error.
func errnoFor(err error) error {
	if errors.Is(err, cuda.ErrOutOfMemory) {
		return fmt.Errorf("%w (%w)", syscall.ENOMEM, err)
	}
	return err
}

// Devices implements Backend.
func (c *CUDA) Devices() ([]wire.Device, error) {
	out := make([]wire.Device, 0, len(c.order))
	for _, i := range slices.Sorted(slices.Values(c.order)) {
		d := c.devs[i]
		name, err := d.d.Name()
		if err != nil {
			return nil, err
		}
		uuid, err := d.d.UUID()
		if err != nil {
			return nil, err
		}
		free, total, err := d.d.MemInfo()
		if err != nil {
			return nil, err
		}
		// What the pool holds is free for segments: a create takes it
		// first, and an allocation short of memory frees it.
		free += uint64(d.pool.ready())
		out = append(out, wire.Device{Index: i, Name: name, UUID: uuid, TotalBytes: total, FreeBytes: free, Granularity: d.gran})
	}
	return out, nil
}

type cudaMemory struct {
	d    *cuda.Device
	h    cuda.Handle
	size int64
	done chan struct{} // closed when the first export attempt ended

	mu  sync.Mutex
	fd  int // -1 until exported
	err error

	view   cudaView // the daemon's own mapping, for the FUSE view
	pooled bool     // made ahead of the create that took it
}

// FromPool implements segment.Pooled, for a create's trace.
func (m *cudaMemory) FromPool() bool { return m.pooled }

// RDMA reports whether an RDMA engine can register the memory, as the
// driver recorded it when the memory was made (cuda.Device.RDMACapable).
func (m *cudaMemory) RDMA() bool {
	ok, err := m.d.HandleRDMA(m.h)
	return err == nil && ok
}
func (m *cudaMemory) setPooled() { m.pooled = true }

// export makes the descriptor; a failure (out of descriptors, say) is kept
// and the next FD tries again.
func (m *cudaMemory) export() {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.fd >= 0 {
		return
	}
	fd, err := m.d.ExportFD(m.h)
	if err != nil {
		m.err = fmt.Errorf("export: %w", errnoFor(err))
		return
	}
	m.fd, m.err = fd, nil
}

func (m *cudaMemory) FD() (int, error) {
	<-m.done
	m.mu.Lock()
	failed := m.fd < 0
	m.mu.Unlock()
	if failed {
		m.export()
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.fd, m.err
}

func (m *cudaMemory) Size() int64 { return m.size }

func (m *cudaMemory) Free() error {
	<-m.done
	m.mu.Lock()
	defer m.mu.Unlock()
	var err error
	if m.fd >= 0 {
		err = syscall.Close(m.fd)
		m.fd = -1
	}
	return errors.Join(err, m.view.unmap(m.d, m.size), m.d.Release(m.h))
}
