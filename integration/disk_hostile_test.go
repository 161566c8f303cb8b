package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/testutil"
)

// The disk tier against a hostile neighbour (docs/security.md, "The threat
// model, operation by operation": evict to disk, sync, persist; durable
// segments read back at a start).

// asNobodyCLI runs the gpushm binary (a copy others may run) as nobody,
// with stdin on its standard input.
func asNobodyCLI(t *testing.T, bin string, stdin []byte, args ...string) result {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	if stdin != nil {
		cmd.Stdin = bytes.NewReader(stdin)
	}
	return runCmd(t, cmd)
}

// diskUse is the bytes the files in dirs take (the copies' data files,
// their padding and manifests).
func diskUse(t *testing.T, dirs []string) int64 {
	t.Helper()
	var n int64
	for _, f := range filesIn(t, dirs) {
		if st, err := os.Stat(f); err == nil {
			n += st.Size()
		}
	}
	return n
}

// TestHostileDiskQuota: an unprivileged user with a quota makes durable
// segments, next versions of them, syncs them and evicts them to disk in a
// loop: what the disk holds of its segments stays within twice its quota
// (a copy and the one it replaces, and a little for the manifests) at
// every step, and within its quota once the writes are done. It can
// neither make a next version of root's durable segment nor write it to
// disk, and root's segment comes back after a reboot as root's.
func TestHostileDiskQuota(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("running clients as other users needs root")
	}
	const quota = 4 << 20
	dirs := diskDirs(t)
	args := []string{"--disk", strings.Join(dirs, ","), "--user-quota", strconv.Itoa(quota), "--grace", "1s", "--socket-group", "nogroup"}
	sock := filepath.Join(testutil.SocketDir(t), "gpushm.sock")
	os.Chmod(filepath.Dir(sock), 0o755)
	d := Start(t, Options{Socket: sock, Args: args})
	bin := binaryForOthers(t)
	root := tierPattern(77, 1<<20)
	putFile(t, sock, "roots", root, "--persist", "--mode", "0666")
	waitSynced(t, sock, "roots", 1)

	nobody := func(stdin []byte, args ...string) result {
		return asNobodyCLI(t, bin, stdin, append([]string{"--socket", sock}, args...)...)
	}
	for _, try := range [][]string{
		{"put", "-q", "--force", "roots", "-"}, // a next version takes root's name: removing it is root's
		{"sync", "roots"},
		{"evict", "--to", "disk", "roots"},
		{"rm", "roots"},
	} {
		if r := nobody(tierPattern(1, 4096), try...); r.code == 0 || !strings.Contains(r.stderr, "EPERM") && !strings.Contains(r.stderr, "not permitted") {
			t.Fatalf("nobody: gpushm %v on root's 0666 durable segment: exit %d, %q; want EPERM", try, r.code, r.stderr)
		}
	}
	checkBytes(t, sock, "roots", root)

	limit := int64(2*quota + 1<<20) // manifests and the copies' padding
	seen := int64(0)
	check := func(what string) {
		t.Helper()
		n := diskUse(t, dirs) - int64(len(root)) - 64<<10 // root's copy and its manifests
		seen = max(seen, n)
		if n > limit {
			t.Fatalf("%s: nobody's copies take %d bytes on disk, quota %d", what, n, quota)
		}
	}
	for i := range 4 {
		a := tierPattern(uint64(i), 1<<20)
		if r := nobody(a, "put", "-q", "--persist", "--force", "a", "-"); r.code != 0 {
			t.Fatalf("round %d: put a: %s", i, r.stderr)
		}
		check("after put a")
		nobody(nil, "sync", "a")
		check("after sync a")
		if r := nobody(tierPattern(uint64(100+i), 1<<20), "put", "-q", "--persist", "--force", "b", "-"); r.code != 0 {
			t.Fatalf("round %d: put b: %s", i, r.stderr)
		}
		nobody(nil, "evict", "--to", "disk", "b")
		check("after evict b")
		// Past the quota: refused, on disk as in memory.
		if r := nobody(tierPattern(9, 3<<20), "put", "-q", "--persist", "c", "-"); r.code == 0 {
			t.Fatalf("round %d: a third durable segment past the quota was taken", i)
		}
		check("after a put past the quota")
	}
	for deadline := time.Now().Add(20 * time.Second); diskUse(t, dirs)-int64(len(root)) > quota+1<<20; {
		if time.Now().After(deadline) {
			t.Fatalf("nobody's copies take %d bytes on disk once written, quota %d", diskUse(t, dirs)-int64(len(root)), quota)
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("the most nobody's copies took: %d bytes (quota %d)", seen, quota)

	d.Kill()
	Start(t, Options{Socket: sock, Args: args})
	var st struct{ UID uint32 }
	if err := json.Unmarshal([]byte(mustRun(t, nil, "--socket", sock, "stat", "--json", "roots")), &st); err != nil {
		t.Fatal(err)
	}
	if st.UID != 0 {
		t.Fatalf("root's durable segment came back as uid %d's", st.UID)
	}
	checkBytes(t, sock, "roots", root)
}

// TestHostileDiskProtocol: the disk tier's requests with what a client
// need not send: evict to a tier that is not host or disk, sync of a
// channel and of a segment that is not durable, persist with a temporary
// segment, a channel, and on a daemon without --disk.
func TestHostileDiskProtocol(t *testing.T) {
	ctx := context.Background()
	dirs := diskDirs(t)
	d := Start(t, Options{Args: []string{"--disk", strings.Join(dirs, ",")}})
	c, err := gpushm.Dial(ctx, d.Socket())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, _, err := c.CreateOnly(ctx, "plain", 4096, nil); err != nil {
		t.Fatal(err)
	}
	for _, to := range []string{"DISK", "gpu", "disk ", "../disk", "disk\x00"} {
		if _, err := c.EvictTo(ctx, "plain", to); !errors.Is(err, syscall.EINVAL) {
			t.Errorf("evict to %q: %v, want EINVAL", to, err)
		}
	}
	if _, err := c.Sync(ctx, "plain"); err == nil {
		t.Error("sync of a segment that is not durable succeeded")
	}
	if _, err := c.Create(ctx, "tmp", 4096, &gpushm.CreateOptions{Persist: true, Temporary: true}); err == nil {
		t.Error("a temporary durable segment was made")
	}
	ch, err := c.Channel(ctx, "ch", gpushm.Producer, &gpushm.ChannelOptions{Slots: 2, SlotBytes: 4096})
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	if _, err := c.Sync(ctx, "ch"); err == nil {
		t.Error("sync of a channel succeeded")
	}
	if _, err := c.EvictTo(ctx, "ch", "disk"); err == nil {
		t.Error("a channel was evicted to disk")
	}
	if n := len(copiesIn(t, dirs)); n != 0 {
		t.Fatalf("%d copies on disk after refused requests: %v", n, filesIn(t, dirs))
	}

	plain := Start(t, Options{})
	pc, err := gpushm.Dial(ctx, plain.Socket())
	if err != nil {
		t.Fatal(err)
	}
	defer pc.Close()
	if _, _, err := pc.CreateOnly(ctx, "p", 4096, &gpushm.CreateOptions{Persist: true}); !errors.Is(err, syscall.EOPNOTSUPP) {
		t.Errorf("persist without --disk: %v, want EOPNOTSUPP", err)
	}
	if _, _, err := pc.CreateOnly(ctx, "q", 4096, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := pc.EvictTo(ctx, "q", "disk"); !errors.Is(err, syscall.EOPNOTSUPP) {
		t.Errorf("evict to disk without --disk: %v, want EOPNOTSUPP", err)
	}
}
