package main

import (
	"errors"
	"os"

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
