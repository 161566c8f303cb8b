package main

import (
	"fmt"
	"io"
	"os/user"
	"strconv"
	"text/tabwriter"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/bytesize"
)

// printGPUs writes the GPU part of 'gpushm info': where the figures come
// from, each GPU's memory and load, and the processes using it.
func printGPUs(out io.Writer, r *gpushm.GPUReport) error {
	if r == nil {
		return nil // a daemon from before GPU reports
	}
	switch r.Source {
	case "nvml":
		fmt.Fprintf(out, "\nGPUs from NVML, driver %s\n", orDash(r.Driver))
	case "cuda":
		fmt.Fprintf(out, "\nGPUs from the CUDA driver (cuMemGetInfo): memory only\n")
	case "none":
		fmt.Fprintf(out, "\nGPUs: none reported\n")
	default:
		fmt.Fprintf(out, "\nGPUs from %s\n", r.Source)
	}
	if r.Note != "" {
		fmt.Fprintf(out, "note: %s\n", r.Note)
	}
	if len(r.GPUs) == 0 {
		return nil
	}
	w := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "GPU\tDEVICE\tNAME\tUUID\tUSED\tTOTAL\tUTIL")
	procs := 0
	for _, g := range r.GPUs {
		dev, util := "-", "-"
		if g.Device != nil {
			dev = strconv.Itoa(*g.Device)
		}
		if g.Utilization != nil {
			util = strconv.Itoa(*g.Utilization) + "%"
		}
		fmt.Fprintf(w, "%d\t%s\t%s\t%s\t%s\t%s\t%s\n", g.Index, dev, g.Name, orDash(g.UUID),
			bytesize.Format(int64(g.UsedBytes)), bytesize.Format(int64(g.TotalBytes)), util)
		procs += len(g.Processes)
	}
	if err := w.Flush(); err != nil {
		return err
	}
	if procs == 0 {
		return nil
	}
	fmt.Fprintln(out)
	w = tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "GPU\tPID\tUSER\tCOMMAND\tGPU MEMORY")
	for _, g := range r.GPUs {
		for _, p := range g.Processes {
			who := "-"
			if p.UID != nil {
				who = userName(*p.UID)
			}
			fmt.Fprintf(w, "%d\t%d\t%s\t%s\t%s\n", g.Index, p.PID, who, orDash(p.Command), bytesize.Format(int64(p.UsedBytes)))
		}
		if g.MoreProcesses > 0 {
			fmt.Fprintf(w, "%d\t...\t\t%d more\t\n", g.Index, g.MoreProcesses)
		}
	}
	return w.Flush()
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// userName is uid's name on this machine, or the number.
func userName(uid uint32) string {
	id := strconv.FormatUint(uint64(uid), 10)
	if u, err := user.LookupId(id); err == nil {
		return u.Username
	}
	return id
}
