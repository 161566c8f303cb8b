package integration

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// The disk tier (docs/disk.md): segments move GPU → host → disk under the
// budgets, an open brings them back, durable segments come back after a
// reboot, and nothing torn or stale is served.

// diskDirs are two directories for a disk tier: one under /var/tmp (a disk
// file system, ext4 on the CI machine, which takes O_DIRECT) and one in
// /dev/shm (tmpfs, which refuses it), so that both paths run.
func diskDirs(t *testing.T) []string {
	t.Helper()
	root := "/var/tmp"
	if st, err := os.Stat(root); err != nil || !st.IsDir() {
		root = t.TempDir()
	}
	base, err := os.MkdirTemp(root, "gpushm-disk-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(base) })
	dirs := []string{filepath.Join(base, "disk0")}
	if st, err := os.Stat("/dev/shm"); err == nil && st.IsDir() {
		shm, err := os.MkdirTemp("/dev/shm", "gpushm-disk-test-")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.RemoveAll(shm) })
		dirs = append(dirs, filepath.Join(shm, "disk1"))
	}
	return dirs
}

// putFile writes b to a file and puts it as name, with args.
func putFile(t *testing.T, sock, name string, b []byte, args ...string) {
	t.Helper()
	f := filepath.Join(t.TempDir(), name+".bin")
	if err := os.WriteFile(f, b, 0o600); err != nil {
		t.Fatal(err)
	}
	mustRun(t, nil, append(append([]string{"--socket", sock, "put", "-q"}, args...), name, f)...)
}

// getBytes gets name into a file, in a process of its own, and returns
// its bytes.
func getBytes(t *testing.T, sock, name string) []byte {
	t.Helper()
	f := filepath.Join(t.TempDir(), name+".out")
	mustRun(t, nil, "--socket", sock, "get", "-q", name, f)
	b, err := os.ReadFile(f)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func checkBytes(t *testing.T, sock, name string, want []byte) {
	t.Helper()
	if got := getBytes(t, sock, name); !bytes.Equal(got, want) {
		t.Fatalf("%s: %d bytes back, want %d, equal %v", name, len(got), len(want), bytes.Equal(got, want))
	}
}

// copiesIn are the copies in dirs, by their manifests' names.
func copiesIn(t *testing.T, dirs []string) map[string]bool {
	t.Helper()
	out := map[string]bool{}
	for _, f := range filesIn(t, dirs) {
		if strings.HasSuffix(f, ".manifest") {
			out[filepath.Base(f)] = true
		}
	}
	return out
}

type segStat struct {
	Name    string
	Tier    string
	Mode    string
	Version uint64
	Persist bool
	Synced  *time.Time
	Stale   bool
	Meta    json.RawMessage
}

func statOf(t *testing.T, sock, name string) segStat {
	t.Helper()
	var s segStat
	if err := json.Unmarshal([]byte(mustRun(t, nil, "--socket", sock, "stat", "--json", name)), &s); err != nil {
		t.Fatal(err)
	}
	return s
}

// waitSynced waits until name's durable copy is on disk, as of version.
func waitSynced(t *testing.T, sock, name string, version uint64) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); ; {
		s := statOf(t, sock, name)
		if s.Synced != nil && s.Version == version {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not on disk after 30s: %+v", name, s)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// filesIn lists the copies' files in dirs (not the directories' ids).
func filesIn(t *testing.T, dirs []string) []string {
	t.Helper()
	var out []string
	for _, d := range dirs {
		es, err := os.ReadDir(d)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range es {
			if !strings.HasPrefix(e.Name(), "gpushm-disk") {
				out = append(out, filepath.Join(d, e.Name()))
			}
		}
	}
	return out
}

// TestDiskTier: segments move GPU → host → disk under the budgets, by
// themselves and by evict --to disk, and come back whole through a crash
// of the serving process; a disk budget refuses what does not fit and
// keeps the segment in memory.
func TestDiskTier(t *testing.T) {
	const seg = 3 << 20
	dirs := diskDirs(t)
	d := Start(t, Options{Args: []string{"--gpu-budget", strconv.Itoa(2 * seg), "--host-budget", strconv.Itoa(seg),
		"--disk", strings.Join(dirs, ","), "--disk-budget", strconv.Itoa(5 * seg), "--grace", "1s"}})
	sock := d.Socket()
	pats := map[string][]byte{}
	for i, name := range []string{"a", "b", "c", "e"} {
		pats[name] = tierPattern(uint64(100+i), seg)
		putFile(t, sock, name, pats[name])
	}
	// e went to the GPU, c stayed, b went to host memory, and a, the
	// least recently used, on to disk when b needed the host budget.
	if got := tiersOf(t, sock); got["a"] != "disk" || got["b"] != "host" || got["c"] != "gpu" || got["e"] != "gpu" {
		t.Fatalf("tiers after four puts of %d bytes under a budget of 2 and a host budget of 1: %v", seg, got)
	}
	out := mustRun(t, nil, "--socket", sock, "evict", "--to", "disk", "c")
	if !strings.Contains(out, "disk") {
		t.Fatalf("evict --to disk c: %q", out)
	}
	if n := len(filesIn(t, dirs)); n == 0 {
		t.Fatal("nothing in the disk directories with two segments on disk")
	}
	df := mustRun(t, nil, "--socket", sock, "df")
	if !strings.Contains(df, "disk") {
		t.Fatalf("df shows no disk tier:\n%s", df)
	}
	// Through a crash of the serving process, the journal keeps them.
	d.Crash(t)
	if got := tiersOf(t, sock); got["a"] != "disk" || got["c"] != "disk" {
		t.Fatalf("tiers after a crash: %v", got)
	}
	for _, name := range []string{"a", "b", "c", "e"} {
		checkBytes(t, sock, name, pats[name])
	}
	// A segment back in memory that is not durable leaves no copy: the
	// disk holds one for each segment on disk now, no more.
	for deadline := time.Now().Add(10 * time.Second); ; {
		onDisk := 0
		for _, tier := range tiersOf(t, sock) {
			if tier == "disk" {
				onDisk++
			}
		}
		if n := len(copiesIn(t, dirs)); n == onDisk {
			break
		} else if time.Now().After(deadline) {
			t.Fatalf("%d copies on disk for %d segments there: %v", n, onDisk, filesIn(t, dirs))
		}
		time.Sleep(20 * time.Millisecond)
	}

}

// TestDiskBudget: what does not fit the disk budget stays in memory, with
// an error that says so.
func TestDiskBudget(t *testing.T) {
	dirs := diskDirs(t)
	d := Start(t, Options{Args: []string{"--disk", strings.Join(dirs, ","), "--disk-budget", "1MiB"}})
	sock := d.Socket()
	big := tierPattern(200, 2<<20)
	putFile(t, sock, "big", big, "--persist")
	mustFail(t, "budget", "--socket", sock, "evict", "--to", "disk", "big")
	mustFail(t, "budget", "--socket", sock, "sync", "big")
	if got := tiersOf(t, sock); got["big"] != "gpu" {
		t.Fatalf("big after evictions past the disk budget: %v", got)
	}
	if s := statOf(t, sock, "big"); s.Synced != nil {
		t.Fatalf("big on disk past the budget: %+v", s)
	}
	checkBytes(t, sock, "big", big)
	if n := len(copiesIn(t, dirs)); n != 0 {
		t.Fatalf("copies past the budget: %v", filesIn(t, dirs))
	}
}

// TestDurableReboot: durable segments (put --persist, create --persist
// with sync) are listed again after every process of the daemon is killed
// and a new daemon starts on the same directories, with owner, mode, meta
// and version, and their first open reads their bytes back; segments that
// were not durable are gone, their copies removed.
func TestDurableReboot(t *testing.T) {
	const seg = 1<<20 + 4096 + 7
	dirs := diskDirs(t)
	args := []string{"--disk", strings.Join(dirs, ","), "--grace", "1s"}
	d := Start(t, Options{Args: args})
	sock := d.Socket()
	v1, v2 := tierPattern(1, seg), tierPattern(2, seg)
	putFile(t, sock, "model", v1, "--persist", "--meta", `{"round":1}`)
	putFile(t, sock, "model", v2, "--force", "--meta", `{"round":2}`)
	mustRun(t, nil, "--socket", sock, "chmod", "0640", "model")
	waitSynced(t, sock, "model", 2)
	putFile(t, sock, "scratch", v1)
	mustRun(t, nil, "--socket", sock, "evict", "--to", "disk", "scratch")
	// A durable segment written through a mapping: on disk at sync.
	mustRun(t, nil, "--socket", sock, "create", "--persist", "state", "8192")
	mustFail(t, "not durable", "--socket", sock, "sync", "scratch")
	mustRun(t, nil, "--socket", sock, "sync", "state")
	if s := statOf(t, sock, "state"); s.Synced == nil || !s.Persist {
		t.Fatalf("state after sync: %+v", s)
	}

	// The reboot: every process killed, all memory gone with them.
	d.Kill()
	d = Start(t, Options{Socket: sock, Args: args})
	got := tiersOf(t, sock)
	if got["model"] != "disk" || got["state"] != "disk" || got["scratch"] != "" || len(got) != 2 {
		t.Fatalf("after a reboot: %v; want model and state on disk, nothing else", got)
	}
	s := statOf(t, sock, "model")
	var meta struct{ Round int }
	json.Unmarshal(s.Meta, &meta)
	if s.Version != 2 || s.Mode != "0640" || !s.Persist || s.Stale || meta.Round != 2 {
		t.Fatalf("model after a reboot: %+v", s)
	}
	checkBytes(t, sock, "model", v2)
	checkBytes(t, sock, "state", make([]byte, 8192))
	// The copy of version 1 and the scratch segment's are gone: one copy
	// of each durable segment is left.
	if n := len(copiesIn(t, dirs)); n != 2 {
		t.Fatalf("%d copies on disk after the reboot, want 2: %v", n, filesIn(t, dirs))
	}
	// Still durable: a second reboot finds them again.
	d.Kill()
	d = Start(t, Options{Socket: sock, Args: args})
	checkBytes(t, sock, "model", v2)
	mustRun(t, nil, "--socket", sock, "rm", "model")
	d.Kill()
	Start(t, Options{Socket: sock, Args: args})
	if got := tiersOf(t, sock); got["model"] != "" {
		t.Fatalf("model came back after rm and a reboot: %v", got)
	}
}

// TestDurableStale: a durable segment opened to be written since its last
// sync comes back after a reboot with its synced bytes, and says so.
func TestDurableStale(t *testing.T) {
	dirs := diskDirs(t)
	args := []string{"--disk", strings.Join(dirs, ","), "--grace", "1s"}
	d := Start(t, Options{Args: args})
	sock := d.Socket()
	v1 := tierPattern(7, 1<<20)
	putFile(t, sock, "w", v1, "--persist")
	waitSynced(t, sock, "w", 1)
	// A read-write open (a write through the FUSE view would do too).
	w := startChaosClientEnv(t, sock, "GPUSHM_TEST_TIERS=1")
	w.ask(t, 0, "hold w")
	w.ask(t, 0, "write w 8")
	w.ask(t, 0, "close w")
	if s := statOf(t, sock, "w"); !s.Stale {
		t.Fatalf("w after a write through a mapping: %+v, want stale", s)
	}
	d.Kill()
	Start(t, Options{Socket: sock, Args: args})
	s := statOf(t, sock, "w")
	if !s.Stale || s.Version != 1 {
		t.Fatalf("w after a reboot: %+v, want stale, version 1", s)
	}
	out := mustRun(t, nil, "--socket", sock, "stat", "w")
	if !strings.Contains(out, "opened to be written since") {
		t.Fatalf("stat w does not say it is stale:\n%s", out)
	}
	checkBytes(t, sock, "w", v1)
}
