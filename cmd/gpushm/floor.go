package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/cuda"
	"github.com/gpushm/gpushm/internal/wire"
)

// floorSamples allocates and exports memory the way the daemon does, but in
// this process and without the daemon, and has a second process time
// importing and mapping it: the cost no daemon can avoid.
func floorSamples(ctx context.Context, backend string, dev gpushm.Device, size int64, iters int) ([]int64, error) {
	alloc := (size + dev.Granularity - 1) / dev.Granularity * dev.Granularity
	var fd int
	handle := wire.HandleMemfd
	if backend == "cuda" {
		handle = wire.HandleCUDA
		d, err := cuda.GetDevice(dev.Index)
		if err != nil {
			return nil, err
		}
		h, err := d.Create(alloc)
		if err != nil {
			return nil, err
		}
		defer d.Release(h)
		if fd, err = d.ExportFD(h); err != nil {
			return nil, err
		}
	} else {
		var err error
		if fd, err = unix.MemfdCreate("gpushm-floor", unix.MFD_CLOEXEC); err != nil {
			return nil, err
		}
		if err := unix.Ftruncate(fd, alloc); err != nil {
			unix.Close(fd)
			return nil, err
		}
	}
	f := os.NewFile(uintptr(fd), "floor")
	defer f.Close()
	s, err := runChild(ctx, []*os.File{f}, "floor", "--handle", handle,
		"--device", fmt.Sprint(dev.Index), "--size", fmt.Sprint(alloc), "--iters", fmt.Sprint(iters))
	return s.NS, err
}

func floorChildCmd() *cobra.Command {
	var (
		handle string
		device int
		size   int64
		iters  int
	)
	cmd := &cobra.Command{
		Use: "floor",
		RunE: func(cmd *cobra.Command, args []string) error {
			const fd = 3 // the first of ExtraFiles
			var s samples
			var d *cuda.Device
			if handle == wire.HandleCUDA {
				var err error
				if d, err = cuda.GetDevice(device); err != nil {
					return err
				}
			}
			for i := -1; i < iters; i++ {
				t := time.Now()
				undo, err := mapFloor(d, fd, size)
				el := time.Since(t)
				if err != nil {
					return err
				}
				if err := undo(); err != nil {
					return err
				}
				if i >= 0 {
					s.NS = append(s.NS, el.Nanoseconds())
				}
			}
			return emit(s)
		},
	}
	f := cmd.Flags()
	f.StringVar(&handle, "handle", wire.HandleMemfd, "handle type of fd 3")
	f.IntVar(&device, "device", 0, "GPU ordinal")
	f.Int64Var(&size, "size", 0, "bytes to map")
	f.IntVar(&iters, "iters", 100, "iterations")
	return cmd
}

// mapFloor maps fd as a client would, with nothing else around it.
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
