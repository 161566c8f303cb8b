package cli

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"

	"github.com/gpushm/gpushm/internal/exitcode"
	"github.com/gpushm/gpushm/internal/testutil"
)

// TestDF: df says, per device and tier and per user, what is used of
// what bounds it, in text, wide, JSON and YAML; it has no names to print.
func TestDF(t *testing.T) {
	dir := testutil.SocketDir(t)
	os.Chmod(dir, 0o755) // for nobody, below
	sock := filepath.Join(dir, "gpushm.sock")
	startDaemonProc(t, sock, "--gpu-budget", "4M", "--user-quota", "50%", "--create-pool", "0")
	t.Setenv("GPUSHM_SOCKET", sock)
	mustRun(t, nil, "create", "a", "1M")
	mustRun(t, nil, "create", "b", "1M")

	var r struct {
		Tiers []struct {
			Tier     string `json:"tier"`
			Device   *int   `json:"device"`
			Size     int64  `json:"size_bytes"`
			Limit    string `json:"limit"`
			Used     int64  `json:"used_bytes"`
			Avail    int64  `json:"avail_bytes"`
			Peak     int64  `json:"peak_bytes"`
			Segments int    `json:"segments"`
		} `json:"tiers"`
		Users []struct {
			UID          uint32 `json:"uid"`
			User         string `json:"user"`
			Used         int64  `json:"used_bytes"`
			Quota        int64  `json:"quota_bytes"`
			Segments     int    `json:"segments"`
			SegmentQuota int64  `json:"segment_quota"`
			Devices      []struct {
				Device int   `json:"device"`
				Used   int64 `json:"used_bytes"`
				Quota  int64 `json:"quota_bytes"`
			} `json:"devices"`
		} `json:"users"`
	}
	decode(t, mustRun(t, nil, "df", "-o", "json"), &r)
	if len(r.Tiers) != 2 {
		t.Fatalf("df -o json: tiers %+v, want the device's and host memory's", r.Tiers)
	}
	dev, host := r.Tiers[0], r.Tiers[1]
	if dev.Tier != "gpu" || dev.Device == nil || *dev.Device != 0 || dev.Limit != "budget" || dev.Size != 4<<20 ||
		dev.Used != 2<<20 || dev.Avail != 2<<20 || dev.Peak != 2<<20 || dev.Segments != 2 {
		t.Errorf("df -o json: device 0 is %+v; want 2 MiB used of a budget of 4 MiB, peak 2 MiB, 2 segments", dev)
	}
	if host.Tier != "host" || host.Device != nil || host.Limit != "host_budget" || host.Size <= 0 || host.Used != 0 {
		t.Errorf("df -o json: host memory is %+v; want the host budget, nothing evicted", host)
	}
	if len(r.Users) != 1 || r.Users[0].User != "root" || r.Users[0].Used != 2<<20 || r.Users[0].Segments != 2 ||
		r.Users[0].Quota != 0 || len(r.Users[0].Devices) != 1 || r.Users[0].Devices[0].Quota != 0 {
		t.Errorf("df -o json: users %+v; want root's 2 MiB in 2 segments, under no quota", r.Users)
	}

	// Text: the device's memory by its name on the host backend; host
	// memory for evicted segments, since there is a budget; root's line.
	out := mustRun(t, nil, "df")
	for _, want := range []string{
		`(?m)^DEVICE +TIER +SIZE +USED +AVAIL +USE% +PEAK +LIMIT$`,
		`(?m)^0 +host memory +4 MiB +2 MiB +2 MiB +50% +2 MiB +budget$`,
		`(?m)^- +evicted +\S+ GiB +0 B +\S+ GiB +0% +- +host budget$`,
		`(?m)^USER +DEVICE +USED +QUOTA +AVAIL +USE% +SEGMENTS$`,
		`(?m)^root +0 +2 MiB +- +- +- +2$`,
	} {
		if !regexp.MustCompile(want).MatchString(out) {
			t.Errorf("df: no line matching %q in:\n%s", want, out)
		}
	}
	if out := mustRun(t, nil, "df", "-o", "wide"); !strings.Contains(out, "SEGMENTS  FREE") || !strings.Contains(out, "host memory  -") {
		t.Errorf("df -o wide: no device name, free memory and segments:\n%s", out)
	}
	if out := mustRun(t, nil, "df", "-o", "yaml"); !strings.Contains(out, "limit: budget") {
		t.Errorf("df -o yaml:\n%s", out)
	}
	if r := cli(t, nil, "df", "-o", "name"); r.code != exitcode.Usage {
		t.Errorf("df -o name: exit %d, want %d (df has no names)", r.code, exitcode.Usage)
	}

	// Another user sees its own quota, holding nothing yet, and then what
	// it holds against it.
	if syscall.Geteuid() == 0 {
		bin := testutil.BinaryForOthers(t)
		nobody := &syscall.Credential{Uid: 65534, Gid: 65534}
		as := func(args ...string) result {
			cmd := exec.Command(bin, append([]string{"--socket", sock}, args...)...)
			cmd.SysProcAttr = &syscall.SysProcAttr{Credential: nobody}
			return runCmd(t, cmd)
		}
		line := regexp.MustCompile(`(?m)^nobody +0 +0 B +\S+ GiB +\S+ GiB +0% +0 of \d+$`)
		if r := as("df"); r.code != 0 || !line.MatchString(r.stdout) {
			t.Errorf("df as nobody, holding nothing: exit %d, %s%s; want a line matching %q", r.code, r.stdout, r.stderr, line)
		}
		if r := as("create", "n", "1M"); r.code != 0 {
			t.Fatalf("create as nobody: %s", r.stderr)
		}
		line = regexp.MustCompile(`(?m)^nobody +0 +1 MiB +\S+ GiB +\S+ GiB +1% +1 of \d+$`)
		if out := mustRun(t, nil, "df"); !line.MatchString(out) {
			t.Errorf("df after nobody's create: no line matching %q in:\n%s", line, out)
		}
	}
}

// TestFiguresThatDoNotConfuse: on the host backend TIER names host
// memory, never "gpu"; info's peak is kept without a budget; a create
// larger than the whole budget says so.
func TestFiguresThatDoNotConfuse(t *testing.T) {
	dir := testutil.SocketDir(t)
	sock := filepath.Join(dir, "gpushm.sock")
	startDaemonProc(t, sock, "--create-pool", "0")
	t.Setenv("GPUSHM_SOCKET", sock)
	mustRun(t, nil, "create", "a", "1M")
	mustRun(t, nil, "create", "b", "1M")
	mustRun(t, nil, "rm", "a")
	out := mustRun(t, nil, "ls")
	if !regexp.MustCompile(`(?m)^b .* host memory `).MatchString(out) || strings.Contains(out, "gpu") {
		t.Errorf("ls on the host backend:\n%s\nwant TIER host memory, and no gpu", out)
	}
	if out := mustRun(t, nil, "stat", "b"); !strings.Contains(out, "tier:        host memory\n") {
		t.Errorf("stat on the host backend:\n%s", out)
	}
	mustRun(t, nil, "evict", "b")
	if out := mustRun(t, nil, "ls", "b"); !regexp.MustCompile(`(?m)^b .* evicted `).MatchString(out) {
		t.Errorf("ls of an evicted segment on the host backend:\n%s", out)
	}
	// JSON keeps the protocol's words, which scripts test.
	var segs []map[string]any
	decode(t, mustRun(t, nil, "ls", "-o", "json"), &segs)
	if len(segs) != 1 || segs[0]["tier"] != "host" {
		t.Errorf("ls -o json of an evicted segment: %v, want tier host", segs)
	}
	var inf struct {
		Tiers struct {
			Devices []struct {
				Budget int64 `json:"budget_bytes"`
				Bytes  int64 `json:"bytes"`
				Peak   int64 `json:"peak_bytes"`
			} `json:"devices"`
		} `json:"tiers"`
	}
	decode(t, mustRun(t, nil, "info", "-o", "json"), &inf)
	if d := inf.Tiers.Devices; len(d) != 1 || d[0].Budget != 0 || d[0].Bytes != 0 || d[0].Peak != 2<<20 {
		t.Errorf("info with no budget, after 2 MiB held and all let go: %+v; want a peak of 2 MiB", d)
	}
	if out := mustRun(t, nil, "info"); !strings.Contains(out, "tier host memory: device 0: 0 B on it, no budget (peak 2 MiB)") || strings.Contains(out, "tier gpu") {
		t.Errorf("info on the host backend:\n%s", out)
	}

	sock2 := filepath.Join(dir, "budget.sock")
	startDaemonProc(t, sock2, "--gpu-budget", "4M")
	r := cli(t, nil, "--socket", sock2, "create", "big", "5M")
	want := "gpushm: create big: no room under the budget: 5242880 bytes (5 MiB) exceeds device 0's budget of 4194304 bytes (4 MiB)\n"
	if r.code != exitcode.NoSpace || r.stderr != want {
		t.Errorf("create past the whole budget: exit %d, %q; want exit %d, %q", r.code, r.stderr, exitcode.NoSpace, want)
	}
}
