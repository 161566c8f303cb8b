package daemon

import (
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"syscall"

	"github.com/gpushm/gpushm/internal/backend"
	"github.com/gpushm/gpushm/internal/bytesize"
	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/server"
)

// Default limits (docs/security.md, "Limits"): what one user other than
// root may hold, sized for a node shared by several teams, and what the
// daemon as a whole may hold, sized from its descriptor limit.
const (
	defaultUserSegments    = 4096
	defaultUserConnections = 1024
	// defaultUserShareGPU and defaultUserShareHost are the share of each
	// GPU's memory, and of the host's memory, one user may hold: a GPU
	// node is for GPU work, and one user may well load a model into half
	// a GPU; host memory is everyone's, the kernel's and the daemon's.
	defaultUserShareGPU  = 50
	defaultUserShareHost = 25
)

// raiseNOFILE raises this process's soft descriptor limit to its hard
// limit, and returns the limit in force. Both daemon processes call it:
// every segment costs the serving process and the supervisor a descriptor
// each, and every connection costs the serving process one.
func raiseNOFILE() int {
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		return 1024
	}
	if lim.Cur < lim.Max {
		up := lim
		up.Cur = up.Max
		if syscall.Setrlimit(syscall.RLIMIT_NOFILE, &up) == nil {
			lim = up
		}
	}
	return int(min(lim.Cur, 1<<31-1))
}

// envStoreMax passes the size of systemd's file descriptor store
// ($FDSTORE, the unit's FileDescriptorStoreMax=) from the supervisor, which
// alone talks to systemd, to the serving process, whose segment limit it
// bounds.
const envStoreMax = "GPUSHM_FD_STORE_MAX"

// storeOwn is what the supervisor keeps in systemd's store besides
// segments: the listening socket, the epoch page, and the journal, two of
// them while it is rewritten.
const storeOwn = 4

// passStoreMax tells the serving process the size of systemd's store, when
// the supervisor keeps everything there.
func passStoreMax() {
	if n, _ := strconv.Atoi(os.Getenv("FDSTORE")); n > 0 {
		os.Setenv(envStoreMax, strconv.Itoa(n))
	}
}

// storeMax is the size of systemd's store that the supervisor passed, or 0.
func storeMax() int {
	n, _ := strconv.Atoi(os.Getenv(envStoreMax))
	return max(n, 0)
}

// descriptorReserve is how many of nofile descriptors the limits leave to
// the daemon itself: listening and control sockets, the epoch page, the
// GPU driver's device files, the FUSE device, metrics connections,
// descriptors made for one reply, and the processes of channel ends that
// it watches.
func descriptorReserve(nofile int) int { return max(128, nofile/16) }

// daemonLimits are the limits a serving process enforces, resolved from
// the flags for this node.
type daemonLimits struct {
	seg  segment.Limits
	conn server.ConnLimits
	// shareNote says how the user byte quota was chosen, for the log.
	shareNote string
	// storeNote warns that segments past systemd's store do not survive
	// a restart of the whole service.
	storeNote string
}

// limits resolves the limit flags for b's devices, a descriptor limit of
// nofile and, under systemd, a file descriptor store of store descriptors
// (0: none).
func (o Options) limits(b backend.Backend, nofile, store int) (daemonLimits, error) {
	var l daemonLimits
	l.conn.Descriptors = nofile
	reserve := descriptorReserve(nofile)
	autoSegs := nofile / 2
	if store > 0 {
		autoSegs = min(autoSegs, max(1, store-storeOwn))
	}
	maxSegs, err := countFlag("--max-segments", o.MaxSegments, autoSegs)
	if err != nil {
		return l, err
	}
	if store > 0 && (maxSegs == 0 || maxSegs > store-storeOwn) {
		l.storeNote = fmt.Sprintf("systemd's file descriptor store keeps %d segments (FileDescriptorStoreMax=%d, less %d of the daemon's own), fewer than --max-segments allows: those past it do not survive a restart of the whole service", max(0, store-storeOwn), store, storeOwn)
	}
	maxConns, err := countFlag("--max-connections", o.MaxConnections, max(0, nofile-maxSegs-reserve))
	if err != nil {
		return l, err
	}
	if maxSegs > 0 && maxConns > 0 && maxSegs+maxConns+reserve > nofile {
		return l, fmt.Errorf("--max-segments %d and --max-connections %d leave fewer than %d of the %d descriptors this process may open to the daemon itself: lower them, or raise the limit (ulimit -n, systemd's LimitNOFILE=)",
			maxSegs, maxConns, reserve, nofile)
	}
	l.seg.Segments, l.conn.Total = maxSegs, maxConns
	autoUserSegs := defaultUserSegments
	if maxSegs > 0 {
		autoUserSegs = min(autoUserSegs, max(1, maxSegs/4))
	}
	if l.seg.UserSegments, err = countFlag("--user-segments", o.UserSegments, autoUserSegs); err != nil {
		return l, err
	}
	autoUserConns := defaultUserConnections
	if maxConns > 0 {
		autoUserConns = min(autoUserConns, max(1, maxConns/4))
	}
	if l.conn.PerUser, err = countFlag("--user-connections", o.UserConnections, autoUserConns); err != nil {
		return l, err
	}

	devs, err := b.Devices()
	if err != nil {
		return l, err
	}
	quota := strings.TrimSpace(o.UserQuota)
	switch quota {
	case "", "auto":
		share := defaultUserShareGPU
		if b.Name() == "host" {
			share = defaultUserShareHost
		}
		quota = strconv.Itoa(share) + "%"
		l.shareNote = "auto: " + quota + " of each device"
	}
	if strings.HasSuffix(quota, "%") {
		l.seg.UserDeviceBytes = map[int]int64{}
		for _, d := range devs {
			n, err := sizeOrShare(quota, int64(d.TotalBytes))
			if err != nil {
				return l, fmt.Errorf("--user-quota: %w", err)
			}
			l.seg.UserDeviceBytes[d.Index] = n
		}
	} else if quota != "0" {
		n, err := bytesize.Parse(quota)
		if err != nil {
			return l, fmt.Errorf("--user-quota: %w", err)
		}
		l.seg.UserBytes = n
	}
	if o.MaxMemory != "" {
		l.seg.DeviceBytes = map[int]int64{}
		for _, d := range devs {
			n, err := sizeOrShare(o.MaxMemory, int64(d.TotalBytes))
			if err != nil {
				return l, fmt.Errorf("--max-memory: %w", err)
			}
			l.seg.DeviceBytes[d.Index] = n
		}
	}
	return l, nil
}

// countFlag reads a count limit: a number, "auto" for auto, or 0 for none.
func countFlag(name, s string, auto int) (int, error) {
	s = strings.TrimSpace(s)
	if s == "" || s == "auto" {
		return auto, nil
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("%s %q: want a number, 0 (no limit) or auto", name, s)
	}
	return n, nil
}

// sizeOrShare reads "64G" as bytes and "90%" as that share of total.
func sizeOrShare(s string, total int64) (int64, error) {
	if p, ok := strings.CutSuffix(strings.TrimSpace(s), "%"); ok {
		f, err := strconv.ParseFloat(p, 64)
		if err != nil || f <= 0 || f > 100 {
			return 0, fmt.Errorf("%q: want a share between 0%% and 100%%", s)
		}
		return int64(f / 100 * float64(total)), nil
	}
	return bytesize.Parse(s)
}

// gpuReserve is what --gpu-budget auto leaves outside each GPU's budget:
// the CUDA contexts (about half a GiB each on an H200) and the own
// allocations of the processes that use the segments, and the create pool.
func gpuReserve(total int64) int64 { return max(total/16, 2<<30) }

// newSpill is the spill allocator over host: spill memory let go of is
// kept up to 30 s for the next eviction of its size, up to a quarter of
// host memory (backend.Spill), a 16 GiB segment's on a machine of 128 GiB.
func newSpill(host *backend.Host) (*backend.Spill, error) {
	hostTotal, err := host.Capacity(0)
	if err != nil {
		return nil, err
	}
	return backend.NewSpill(host, hostTotal/4), nil
}

// tiers resolves --gpu-budget and --host-budget (segment/tier.go), evicting
// into spill.
func (o Options) tiers(b backend.Backend, host *backend.Host, spill *backend.Spill) (segment.Tiers, error) {
	hostTotal, err := host.Capacity(0)
	if err != nil {
		return segment.Tiers{}, err
	}
	t := segment.Tiers{Budgets: map[int]int64{}, Spill: spill}
	mover, ok := b.(segment.Mover)
	if !ok {
		return t, fmt.Errorf("the %s backend cannot move segments to host memory", b.Name())
	}
	t.Mover = mover
	devs, err := b.Devices()
	if err != nil {
		return t, err
	}
	budget := strings.TrimSpace(o.GPUBudget)
	for _, d := range devs {
		total := int64(d.TotalBytes)
		var n int64
		switch {
		case budget == "" || budget == "auto":
			if b.Name() != "host" {
				n = max(total-gpuReserve(total), 0)
			}
		default:
			if n, err = sizeOrShare(budget, total); err != nil || n < 0 {
				return t, fmt.Errorf("--gpu-budget %q: want a size (24GiB), a share (80%%), 0 or auto", o.GPUBudget)
			}
		}
		t.Budgets[d.Index] = n
	}
	switch hb := strings.TrimSpace(o.HostBudget); hb {
	case "", "auto":
		t.HostBudget = hostTotal / 2
	default:
		if t.HostBudget, err = sizeOrShare(hb, hostTotal); err != nil || t.HostBudget < 0 {
			return t, fmt.Errorf("--host-budget %q: want a size (64GiB), a share (50%%), 0 or auto", o.HostBudget)
		}
	}
	return t, nil
}

// reserveBytes resolves --host-reserve for the tiers t: the host memory
// to keep made ahead of evictions (backend.Spill.Reserve). Auto serves a
// first eviction of the largest GPU budget (its memory, where it has
// none), at most a seventh of host memory (a 16 GiB segment on a machine
// of 128 GiB, whose kernel counts 125) and the host budget, from its
// largest piece (four fifths of the reserve): five fourths of that, at
// most the host budget; none on the host backend, whose
// segments are evicted only when asked (gpushm evict) or under a budget
// set by hand, or with eviction off.
func (o Options) reserveBytes(b backend.Backend, host *backend.Host, t segment.Tiers) (int64, error) {
	hostTotal, err := host.Capacity(0)
	if err != nil {
		return 0, err
	}
	switch r := strings.TrimSpace(o.HostReserve); r {
	case "", "auto":
		if b.Name() == "host" || t.HostBudget <= 0 {
			return 0, nil
		}
		devs, err := b.Devices()
		if err != nil {
			return 0, err
		}
		var largest int64
		for _, d := range devs {
			n := t.Budgets[d.Index]
			if n <= 0 {
				n = int64(d.TotalBytes)
			}
			largest = max(largest, n)
		}
		served := min(largest, hostTotal/7, t.HostBudget)
		return min(served+served/4, t.HostBudget), nil
	default:
		n, err := sizeOrShare(r, hostTotal)
		if err != nil || n < 0 {
			return 0, fmt.Errorf("--host-reserve %q: want a size (16GiB), a share of host memory (10%%), 0 or auto", o.HostReserve)
		}
		return n, nil
	}
}

// poolBytes reads --create-pool: the bytes each device may hold made
// ahead of creates.
func (o Options) poolBytes(b backend.Backend) (int64, error) {
	if o.CreatePool != "auto" {
		n, err := bytesize.Parse(o.CreatePool)
		if err != nil || n < 0 {
			return 0, fmt.Errorf("--create-pool %q: want a size (256M), 0 or auto", o.CreatePool)
		}
		return n, nil
	}
	capacity, err := b.Capacity(b.DefaultDevice())
	if err != nil {
		return 0, fmt.Errorf("--create-pool auto: %w", err)
	}
	if b.Name() == "host" {
		return capacity / 100, nil
	}
	return capacity / 50, nil
}

// logLimits says which limits are in force.
func logLimits(log *slog.Logger, l daemonLimits) {
	args := []any{"max_segments", l.seg.Segments, "max_connections", l.conn.Total,
		"user_segments", l.seg.UserSegments, "user_connections", l.conn.PerUser}
	if l.seg.UserBytes > 0 {
		args = append(args, "user_bytes", l.seg.UserBytes)
	}
	for d, n := range l.seg.UserDeviceBytes {
		args = append(args, "user_bytes_device_"+strconv.Itoa(d), n)
	}
	if l.shareNote != "" {
		args = append(args, "user_quota", l.shareNote)
	}
	for d, n := range l.seg.DeviceBytes {
		args = append(args, "max_bytes_device_"+strconv.Itoa(d), n)
	}
	log.Info("limits", args...)
	if l.storeNote != "" {
		log.Warn(l.storeNote)
	}
	if l.seg.Segments == 0 {
		log.Warn("no --max-segments: the supervisor, which holds a descriptor of every segment, may run out of descriptors")
	}
}
