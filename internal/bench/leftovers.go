package bench

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/gpushm/gpushm/internal/bytesize"
	"github.com/gpushm/gpushm/internal/cuda"
)

// memoryInUse is what a benchmark's segments would leave behind if they
// leaked: GPU memory in use on device 0 on cuda (the driver's figure,
// which counts every process), and the kernel's Shmem (memfds included)
// on host.
func memoryInUse(backend string) (int64, string) {
	if backend == "cuda" {
		d, err := cuda.GetDevice(0)
		if err == nil {
			free, total, err := d.MemInfo()
			if err == nil {
				return int64(total - free), "GPU 0 memory in use"
			}
		}
		return -1, "GPU 0 memory in use"
	}
	return meminfo("Shmem"), "host shared memory (Shmem)"
}

func meminfo(key string) int64 {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return -1
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		k, v, ok := strings.Cut(s.Text(), ":")
		if ok && k == key {
			n, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			if err == nil {
				return n << 10
			}
		}
	}
	return -1
}

// aliveNaming lists the processes whose command line names socket: a private
// daemon's supervisor and serving process, and any child given it.
func aliveNaming(socket string) []string {
	paths, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	var out []string
	for _, p := range paths {
		b, err := os.ReadFile(p)
		if err != nil || !bytes.Contains(b, []byte(socket)) {
			continue
		}
		pid := filepath.Base(filepath.Dir(p))
		if pid == strconv.Itoa(os.Getpid()) {
			continue
		}
		out = append(out, pid+" "+strings.TrimSpace(string(bytes.ReplaceAll(b, []byte{0}, []byte{' '}))))
	}
	return out
}

// reportLeftovers says what a run on a private daemon left behind, once
// the daemon was stopped: its processes still alive (there should be
// none) and the memory in use against the figure before it started.
func reportLeftovers(w io.Writer, backend, socket string, before int64) {
	var left []string
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if left = aliveNaming(socket); len(left) == 0 || time.Now().After(deadline) {
			break
		}
	}
	procs := "none"
	if len(left) > 0 {
		procs = strings.Join(left, "; ")
	}
	fmt.Fprintf(w, "\nleft behind: gpushm processes alive: %s\n", procs)
	after, what := memoryInUse(backend)
	if before < 0 || after < 0 {
		fmt.Fprintf(w, "left behind: %s: unknown\n", what)
		return
	}
	fmt.Fprintf(w, "left behind: %s %s at the start, %s at the end (%+.1f MiB)\n", what,
		bytesize.Format(before), bytesize.Format(after), float64(after-before)/(1<<20))
}

// resolvedBackend is what --backend auto will pick: cuda when the driver
// loads and sees a device.
func resolvedBackend(backend string) string {
	if backend != "auto" {
		return backend
	}
	if cuda.Init() == nil {
		if n, err := cuda.DeviceCount(); err == nil && n > 0 {
			return "cuda"
		}
	}
	return "host"
}
