package daemon

import (
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/gpushm/gpushm/internal/backend"
	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/wire"
)

// The unit's numbers agree with the limits: the store keeps every segment
// the daemon may hold, its names fit in LISTEN_FDNAMES (one environment
// string, which execve bounds to 32 pages) whatever the segment ids, and
// the descriptor limit leaves the daemon its reserve.
func TestSystemdUnitLimits(t *testing.T) {
	unit := SystemdUnit("/usr/local/bin/gpushm", nil)
	setting := func(key string) int {
		m := regexp.MustCompile(`(?m)^` + key + `=(\d+)$`).FindStringSubmatch(unit)
		if m == nil {
			t.Fatalf("the unit sets no %s", key)
		}
		n, _ := strconv.Atoi(m[1])
		return n
	}
	store, nofile := setting("FileDescriptorStoreMax"), setting("LimitNOFILE")
	b, err := backend.Open("host", "all", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	l, err := Options{}.limits(b, nofile, store)
	if err != nil {
		t.Fatal(err)
	}
	if l.storeNote != "" || l.seg.Segments+storeOwn > store {
		t.Errorf("--max-segments auto = %d with FileDescriptorStoreMax=%d: %s", l.seg.Segments, store, l.storeNote)
	}
	if got := l.seg.Segments + l.conn.Total + descriptorReserve(nofile); got > nofile {
		t.Errorf("segments %d + connections %d + the daemon's %d = %d, above LimitNOFILE=%d",
			l.seg.Segments, l.conn.Total, descriptorReserve(nofile), got, nofile)
	}
	// The longest names: 16-digit ids, more segments than any node makes.
	names := []string{"listener", "epoch", "journal-9999999999"}
	for len(names) < store {
		names = append(names, "seg-9999999999999999")
	}
	const maxArgStrlen = 32 * 4096
	if n := len("LISTEN_FDNAMES=" + strings.Join(names, ":") + "\x00"); n > maxArgStrlen {
		t.Errorf("LISTEN_FDNAMES of a full store: %d bytes, above the kernel's %d", n, maxArgStrlen)
	}
	for _, want := range []string{fmt.Sprintf("(%d)", l.seg.Segments), fmt.Sprintf("%d connections", l.conn.Total),
		fmt.Sprintf("%d\n# descriptors for itself", descriptorReserve(nofile))} {
		if !strings.Contains(unit, want) {
			t.Errorf("the unit's comment does not say %q:\n%s", want, unit)
		}
	}
}

// Under systemd's store, --max-segments auto is what the store keeps; a
// larger one is allowed, with a warning.
func TestLimitsFromStore(t *testing.T) {
	b, err := backend.Open("host", "all", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	for _, tc := range []struct {
		name        string
		flag        string
		nofile      int
		store, segs int
		warn        bool
	}{
		{"no store", "auto", 65536, 0, 32768, false},
		{"store", "auto", 65536, 6144, 6140, false},
		{"store above half", "auto", 2048, 6144, 1024, false},
		{"flag above store", "10000", 65536, 6144, 10000, true},
		{"no cap", "0", 65536, 6144, 0, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l, err := Options{MaxSegments: tc.flag}.limits(b, tc.nofile, tc.store)
			if err != nil {
				t.Fatal(err)
			}
			if l.seg.Segments != tc.segs || (l.storeNote != "") != tc.warn {
				t.Errorf("limits(--max-segments %s, nofile %d, store %d): %d segments, warning %q; want %d, warning %v",
					tc.flag, tc.nofile, tc.store, l.seg.Segments, l.storeNote, tc.segs, tc.warn)
			}
		})
	}
}

// gpuBackend is a backend that says it is cuda with devs, for flags
// resolved from the devices.
type gpuBackend struct {
	*backend.Host
	devs []wire.Device
}

func (g gpuBackend) Name() string                    { return "cuda" }
func (g gpuBackend) Devices() ([]wire.Device, error) { return g.devs, nil }

// TestHostReserveFlag: --host-reserve auto is five fourths of the largest
// GPU budget, that at most a seventh of host memory and the host budget
// (its largest piece serves that budget), at most the host budget, and
// none on the host backend; a size, a share or 0 as given.
func TestHostReserveFlag(t *testing.T) {
	host, err := backend.NewHost()
	if err != nil {
		t.Fatal(err)
	}
	total, _ := host.Capacity(0)
	gpus := gpuBackend{host, []wire.Device{{Index: 0, TotalBytes: 80 << 30}, {Index: 1, TotalBytes: 141 << 30}}}
	budgets := map[int]int64{0: 75 << 30, 1: 1 << 40}
	for _, tc := range []struct {
		name    string
		flag    string
		b       backend.Backend
		budgets map[int]int64
		host    int64 // --host-budget
		want    int64
	}{
		{"host backend", "auto", host, nil, total / 2, 0},
		{"gpus", "auto", gpus, budgets, 1 << 50, min(1<<40, total/7) + min(1<<40, total/7)/4},
		{"gpus, small host budget", "", gpus, map[int]int64{0: 1 << 30, 1: 2 << 30}, 1 << 30, min(1<<30, total/7+total/7/4)},
		{"gpus without budgets", "auto", gpus, nil, 1 << 50, min(141<<30, total/7) + min(141<<30, total/7)/4},
		{"eviction off", "auto", gpus, budgets, 0, 0},
		{"size", "16GiB", host, nil, 1 << 30, 16 << 30},
		{"share", "10%", gpus, budgets, 1 << 30, int64(10.0 / 100 * float64(total))},
		{"none", "0", gpus, budgets, 1 << 50, 0},
		{"nonsense", "lots", gpus, budgets, 1 << 50, -1},
		{"too large a share", "120%", gpus, budgets, 1 << 50, -1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := Options{HostReserve: tc.flag}.reserveBytes(tc.b, host, segment.Tiers{Budgets: tc.budgets, HostBudget: tc.host})
			if tc.want < 0 {
				if err == nil || !strings.Contains(err.Error(), "--host-reserve") {
					t.Fatalf("--host-reserve %q: %d, %v; want an error that names the flag", tc.flag, got, err)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("--host-reserve %q = %d, %v; want %d", tc.flag, got, err, tc.want)
			}
		})
	}
}
