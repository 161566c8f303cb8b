package bench

import (
	"errors"
	"os"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/cuda"
	"github.com/gpushm/gpushm/internal/wire"
)

// floorFD is where the second process finds the floor's descriptor: the
// first of exec.Cmd.ExtraFiles.
const floorFD = 3

type floorSpec struct {
	handle string
	device int
	size   int64
}

// exportFloor allocates and exports memory the way the daemon does, but in
// this process and without the daemon, for a second process to map: the
// cost no daemon can avoid. The caller closes the file and calls release.
func exportFloor(backend string, dev gpushm.Device, size int64) (f *os.File, spec floorSpec, release func(), err error) {
	alloc := (size + dev.Granularity - 1) / dev.Granularity * dev.Granularity
	spec = floorSpec{handle: wire.HandleMemfd, device: dev.Index, size: alloc}
	release = func() {}
	var fd int
	if backend == "cuda" {
		spec.handle = wire.HandleCUDA
		d, err := cuda.GetDevice(dev.Index)
		if err != nil {
			return nil, spec, nil, err
		}
		h, err := d.Create(alloc)
		if err != nil {
			return nil, spec, nil, err
		}
		if fd, err = d.ExportFD(h); err != nil {
			d.Release(h)
			return nil, spec, nil, err
		}
		release = func() { d.Release(h) }
	} else {
		if fd, err = unix.MemfdCreate("gpushm-floor", unix.MFD_CLOEXEC); err != nil {
			return nil, spec, nil, err
		}
		if err := unix.Ftruncate(fd, alloc); err != nil {
			unix.Close(fd)
			return nil, spec, nil, err
		}
	}
	return os.NewFile(uintptr(fd), "floor"), spec, release, nil
}

// mapFloor maps fd as a client would, with nothing else around it:
// import + reserve + map + set access on cuda, mmap on host.
func mapFloor(d *cuda.Device, fd int, size int64) (undo func() error, err error) {
	if d == nil {
		b, err := unix.Mmap(fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
		if err != nil {
			return nil, err
		}
		return func() error { return unix.Munmap(b) }, nil
	}
	h, err := d.ImportFD(fd)
	if err != nil {
		return nil, err
	}
	ptr, err := d.Map(h, size, false, d)
	if err != nil {
		d.Release(h)
		return nil, err
	}
	return func() error {
		return errors.Join(d.Unmap(ptr, size), d.Release(h))
	}, nil
}

// createSteps times, in this process and without the daemon, the steps
// a create of size costs a backend: making the allocation (cuMemCreate, or
// memfd_create + ftruncate + seal) and making it durable (the export to a
// descriptor the supervisor can hold, or fallocate committing the pages),
// then freeing it. They are what a create pays when its size is not made
// ahead (--create-pool).
func createSteps(backend string, dev gpushm.Device, size int64, iters int) (alloc, commit, free Dist, err error) {
	size = (size + dev.Granularity - 1) / dev.Granularity * dev.Granularity
	var a, c, f []int64
	for range iters {
		t0 := time.Now()
		var t1, t2 time.Time
		if backend == "cuda" {
			d, err := cuda.GetDevice(dev.Index)
			if err != nil {
				return alloc, commit, free, err
			}
			h, err := d.Create(size)
			if err != nil {
				return alloc, commit, free, err
			}
			t1 = time.Now()
			fd, err := d.ExportFD(h)
			t2 = time.Now()
			if err == nil {
				unix.Close(fd)
			}
			if rerr := d.Release(h); err == nil {
				err = rerr
			}
			if err != nil {
				return alloc, commit, free, err
			}
		} else {
			fd, err := unix.MemfdCreate("gpushm-steps", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
			if err != nil {
				return alloc, commit, free, err
			}
			err = unix.Ftruncate(fd, size)
			if err == nil {
				_, err = unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_SEAL)
			}
			t1 = time.Now()
			if err == nil {
				err = unix.Fallocate(fd, 0, 0, size)
			}
			t2 = time.Now()
			unix.Close(fd)
			if err != nil {
				return alloc, commit, free, err
			}
		}
		t3 := time.Now()
		a = append(a, t1.Sub(t0).Nanoseconds())
		c = append(c, t2.Sub(t1).Nanoseconds())
		f = append(f, t3.Sub(t2).Nanoseconds())
	}
	return Summarize(a), Summarize(c), Summarize(f), nil
}
