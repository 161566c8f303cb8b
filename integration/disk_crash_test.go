package integration

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpushm/gpushm/internal/testutil"
)

// TestDurableKills: a durable name's next version is written to disk in
// the background after its commit, and the serving process, the
// supervisor or both (a reboot) are SIGKILLed while it is: 20 rounds. After
// each, the name serves one whole version, the one its meta names, every
// byte checked; after a reboot, the new version or the one before.
func TestDurableKills(t *testing.T) {
	const seg = 8<<20 + 4096
	dirs := diskDirs(t)
	args := []string{"--disk", strings.Join(dirs, ","), "--grace", "1s"}
	d := Start(t, Options{Args: args})
	sock := d.Socket()
	putFile(t, sock, "m", tierPattern(1000, seg), "--persist", "--meta", `{"seed":1000}`)
	waitSynced(t, sock, "m", 1)
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 43))
	rounds := map[string]int{}
	for k := 1; k <= 20; k++ {
		seed := uint64(1000 + k)
		before := statOf(t, sock, "m")
		putFile(t, sock, "m", tierPattern(seed, seg), "--force", "--meta", fmt.Sprintf(`{"seed":%d}`, seed))
		time.Sleep(time.Duration(rng.IntN(30_000)) * time.Microsecond)
		var how string
		switch k % 3 {
		case 0:
			how = "serving process"
			d.Crash(t)
		case 1:
			how = "supervisor"
			d.KillSupervisor(t)
		default:
			how = "both (a reboot)"
			d.Kill()
			d = Start(t, Options{Socket: sock, Args: args})
		}
		s := statOf(t, sock, "m")
		var meta struct{ Seed uint64 }
		json.Unmarshal(s.Meta, &meta)
		switch {
		case meta.Seed == seed && s.Version == before.Version+1:
			rounds["new"]++
		case meta.Seed == seed-1 && s.Version == before.Version && how == "both (a reboot)":
			rounds["old"]++
		default:
			t.Fatalf("round %d, %s killed: m is version %d of seed %d; before it was version %d of seed %d, and seed %d was put",
				k, how, s.Version, meta.Seed, before.Version, seed-1, seed)
		}
		checkBytes(t, sock, "m", tierPattern(meta.Seed, seg))
		waitSynced(t, sock, "m", s.Version)
	}
	t.Logf("after 20 kills: %v", rounds)
	if n := len(copiesIn(t, dirs)); n != 1 {
		t.Fatalf("%d copies on disk after the rounds, want 1: %v", n, filesIn(t, dirs))
	}
}

// TestDiskCorruption: a byte flipped in a durable copy's data file while
// no daemon runs is found at the first open, whose error names the
// segment and the file; nothing is served, and the segment can be removed.
func TestDiskCorruption(t *testing.T) {
	dirs := diskDirs(t)[:1]
	args := []string{"--disk", dirs[0]}
	d := Start(t, Options{Args: args})
	sock := d.Socket()
	putFile(t, sock, "c", tierPattern(5, 3<<20), "--persist")
	waitSynced(t, sock, "c", 1)
	d.Kill()
	var data string
	for _, f := range filesIn(t, dirs) {
		if strings.HasSuffix(f, ".data") {
			data = f
		}
	}
	if data == "" {
		t.Fatalf("no data file in %v", filesIn(t, dirs))
	}
	f, err := os.OpenFile(data, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 1)
	f.ReadAt(b, 1<<20)
	b[0] ^= 0x40
	f.WriteAt(b, 1<<20)
	f.Close()
	Start(t, Options{Socket: sock, Args: args})
	r := cli(t, nil, "--socket", sock, "get", "-q", "c", filepath.Join(t.TempDir(), "c.out"))
	if r.code == 0 || !strings.Contains(r.stderr, `"c"`) || !strings.Contains(r.stderr, filepath.Base(data)) {
		t.Fatalf("get of a corrupted copy: exit %d, %q; want an error naming c and %s", r.code, r.stderr, data)
	}
	mustRun(t, nil, "--socket", sock, "rm", "c")
}

// TestDiskFull: a durable segment larger than the disk's room: its write
// after the commit fails and is logged, sync fails with ENOSPC, the segment
// stays in memory and whole, and no file is left on the full disk.
func TestDiskFull(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mounting a small tmpfs needs root")
	}
	dir := t.TempDir()
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", dir).CombinedOutput(); err != nil {
		t.Skipf("mount a 4 MiB tmpfs: %v: %s", err, out)
	}
	t.Cleanup(func() { syscall.Unmount(dir, syscall.MNT_DETACH) })
	d := Start(t, Options{Args: []string{"--disk", filepath.Join(dir, "tier")}})
	sock := d.Socket()
	big := tierPattern(9, 6<<20)
	putFile(t, sock, "big", big, "--persist")
	mustFail(t, "no space", "--socket", sock, "sync", "big")
	mustFail(t, "no space", "--socket", sock, "evict", "--to", "disk", "big")
	if s := statOf(t, sock, "big"); s.Synced != nil || s.Tier != "gpu" {
		t.Fatalf("big after a full disk: %+v", s)
	}
	checkBytes(t, sock, "big", big)
	if fs := filesIn(t, []string{filepath.Join(dir, "tier")}); len(fs) != 0 {
		t.Fatalf("files left on the full disk: %v", fs)
	}
	for deadline := time.Now().Add(10 * time.Second); !strings.Contains(d.log.String(), "write to disk failed"); {
		if time.Now().After(deadline) {
			t.Fatal("the daemon's log does not say the write after the commit failed")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestDiskSystemdStore: under systemd with its file descriptor store, a
// segment on disk and a durable one come back whole after the whole
// service dies (the store holds descriptors, the disk the rest): the one
// on disk has no descriptor in the store, and needs none.
func TestDiskSystemdStore(t *testing.T) {
	dir := testutil.SocketDir(t)
	sock := filepath.Join(dir, "gpushm.sock")
	disk := diskDirs(t)[0]
	m := newFakeManager(t, dir)
	svc := m.start(sock, "--grace", "1s", "--disk", disk)
	a, p := tierPattern(31, 3<<20), tierPattern(32, 2<<20)
	putFile(t, sock, "a", a)
	putFile(t, sock, "p", p, "--persist")
	waitSynced(t, sock, "p", 1)
	mustRun(t, nil, "--socket", sock, "evict", "--to", "disk", "a")
	crash(t, svc, sock)
	m.start(sock, "--grace", "1s", "--disk", disk)
	if got := tiersOf(t, sock); got["a"] != "disk" || got["p"] == "" {
		t.Fatalf("after the service died: %v; want a on disk and p", got)
	}
	checkBytes(t, sock, "a", a)
	checkBytes(t, sock, "p", p)
}
