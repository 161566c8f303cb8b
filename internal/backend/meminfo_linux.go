package backend

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
)

// meminfo is what the reserve reads of the kernel's memory figures, in
// bytes.
type meminfo struct {
	// available is MemAvailable, or the room left under the memory
	// cgroup's limit where that is less; limit is that limit (0: none).
	available, limit int64
	hugeTotal        int64 // HugePages_Total, pages
	hugeAvail        int64 // hugetlb pages free and not reserved, bytes
	hugePage         int64 // Hugepagesize
}

// readMeminfo reads /proc/meminfo and this process's memory cgroup: a
// daemon in a container (the Kubernetes DaemonSet's limit is 512 MiB) must
// not make a reserve its cgroup's limit has no room for, which would have
// the kernel kill it.
func readMeminfo() (meminfo, error) {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return meminfo{}, err
	}
	mi, err := parseMeminfo(b)
	if err != nil {
		return mi, err
	}
	if self, err := os.ReadFile("/proc/self/cgroup"); err == nil {
		if limit, room := cgroupRoom("/sys/fs/cgroup", self); limit > 0 {
			mi.limit, mi.available = limit, min(mi.available, room)
		}
	}
	return mi, nil
}

// cgroupRoom reads the memory cgroup that self (/proc/self/cgroup) names,
// and its ancestors, under root: the tightest limit (cgroup v2:
// memory.max and memory.high; v1: memory.limit_in_bytes) and the room
// left under it, or 0, 0 where none is set.
func cgroupRoom(root string, self []byte) (limit, room int64) {
	var dir string
	v2 := false
	for l := range strings.Lines(string(self)) {
		f := strings.SplitN(strings.TrimSpace(l), ":", 3)
		if len(f) != 3 {
			continue
		}
		if slices.Contains(strings.Split(f[1], ","), "memory") {
			dir, v2 = filepath.Join(root, "memory", f[2]), false
			break
		}
		if f[0] == "0" && f[1] == "" {
			dir, v2 = filepath.Join(root, f[2]), true
		}
	}
	if dir == "" {
		return 0, 0
	}
	read := func(dir, name string) int64 {
		b, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			return -1
		}
		n, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
		if err != nil || n >= 1<<60 { // "max", or v1's none
			return -1
		}
		return n
	}
	top := filepath.Join(root, "memory")
	limits, usage := []string{"memory.limit_in_bytes"}, "memory.usage_in_bytes"
	if v2 {
		top, limits, usage = root, []string{"memory.max", "memory.high"}, "memory.current"
	}
	for {
		for _, name := range limits {
			if l := read(dir, name); l >= 0 {
				r := max(l-max(read(dir, usage), 0), 0)
				if limit == 0 || r < room {
					limit, room = l, r
				}
			}
		}
		if dir == top || !strings.HasPrefix(dir, top) {
			return limit, room
		}
		dir = filepath.Dir(dir)
	}
}

func parseMeminfo(b []byte) (meminfo, error) {
	var (
		mi         meminfo
		free, rsvd int64
		sawAvail   bool
	)
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		key, rest, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		f := strings.Fields(rest)
		if len(f) == 0 {
			continue
		}
		n, err := strconv.ParseInt(f[0], 10, 64)
		if err != nil {
			continue
		}
		if len(f) > 1 && f[1] == "kB" {
			n <<= 10
		}
		switch key {
		case "MemAvailable":
			mi.available, sawAvail = n, true
		case "HugePages_Total":
			mi.hugeTotal = n
		case "HugePages_Free":
			free = n
		case "HugePages_Rsvd":
			rsvd = n
		case "Hugepagesize":
			mi.hugePage = n
		}
	}
	if !sawAvail {
		return meminfo{}, fmt.Errorf("/proc/meminfo has no MemAvailable")
	}
	mi.hugeAvail = max(free-rsvd, 0) * mi.hugePage
	return mi, nil
}

// shmemTHP reports whether shmem mappings that ask (MADV_HUGEPAGE) may get
// transparent huge pages.
var shmemTHP = sync.OnceValue(func() bool {
	b, err := os.ReadFile("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
	if err != nil {
		return false
	}
	return thpAllows(string(b))
})

// thpAllows reads shmem_enabled: the setting in brackets.
func thpAllows(s string) bool {
	for _, f := range strings.Fields(s) {
		if v, ok := strings.CutPrefix(f, "["); ok {
			v = strings.TrimSuffix(v, "]")
			return v != "never" && v != "deny"
		}
	}
	return false
}
