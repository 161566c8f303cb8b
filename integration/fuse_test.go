package integration

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/testutil"
)

// These tests drive the FUSE view of a real 'gpushm daemon --mount' process
// with coreutils, as users do. They mount without fusermount, so they need
// root and /dev/fuse; scripts/test installs attr (getfattr) and fuse3.

// sh runs a command and returns its standard output; a failure is fatal.
func sh(t *testing.T, name string, args ...string) string {
	t.Helper()
	cmd := exec.Command(name, args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s%s", name, strings.Join(args, " "), err, out, stderr.Bytes())
	}
	return string(out)
}

// shFails runs a command that must fail, mentioning want.
func shFails(t *testing.T, cmd *exec.Cmd, want string) {
	t.Helper()
	out, err := cmd.CombinedOutput()
	if err == nil || !strings.Contains(string(out), want) {
		t.Fatalf("%v: err %v, output %q; want a failure mentioning %q", cmd.Args, err, out, want)
	}
}

func fileSum(t *testing.T, path string) [32]byte {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		t.Fatalf("read %s: %v", path, err)
	}
	return [32]byte(h.Sum(nil))
}

func randomFile(t *testing.T, path string, size int64) {
	t.Helper()
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	r := rand.NewChaCha8([32]byte{byte(size), byte(size >> 8), byte(size >> 16)})
	if _, err := io.CopyN(f, r, size); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
}

// isMounted reports whether dir is a mount point of the gpushm view.
func isMounted(t *testing.T, dir string) bool {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.Lines(string(b)) {
		f := strings.Fields(line)
		if len(f) > 4 && f[4] == dir && strings.Contains(line, " - fuse.gpushm ") {
			return true
		}
	}
	return false
}

type fuseDaemon struct {
	dir, sock, mnt string
	daemon         *Daemon
}

// startFUSEDaemon runs 'gpushm daemon --mount' on the host backend; the
// mount is ready once the socket answers.
func startFUSEDaemon(t *testing.T) *fuseDaemon {
	t.Helper()
	testutil.RequireFUSE(t)
	dir := testutil.SocketDir(t)
	// Another user must reach the socket and the mount below.
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	d := &fuseDaemon{dir: dir, sock: filepath.Join(dir, "gpushm.sock"), mnt: filepath.Join(dir, "mnt")}
	d.daemon = Start(t, Options{Socket: d.sock, Args: []string{"--mount", d.mnt}})
	t.Cleanup(func() {
		// A test that failed half-way may leave the view mounted.
		if isMounted(t, d.mnt) {
			syscall.Unmount(d.mnt, syscall.MNT_DETACH)
		}
	})
	if !isMounted(t, d.mnt) {
		t.Fatalf("daemon serves but %s is not mounted", d.mnt)
	}
	return d
}

func (d *fuseDaemon) path(name string) string { return filepath.Join(d.mnt, name) }

func TestFUSECopyInOut(t *testing.T) {
	d := startFUSEDaemon(t)
	src := t.TempDir()
	for _, size := range []int64{0, 1, 4095, 4096, 1<<20 + 1, 256 << 20} {
		t.Run(fmt.Sprint(size), func(t *testing.T) {
			in := filepath.Join(src, fmt.Sprint("in", size))
			randomFile(t, in, size)
			name := fmt.Sprint("f", size)
			sh(t, "cp", in, d.path(name))
			out := filepath.Join(src, fmt.Sprint("out", size))
			sh(t, "cp", d.path(name), out)
			want := fileSum(t, in)
			if got := fileSum(t, out); got != want {
				t.Fatalf("cp in and out of %d bytes changed the data", size)
			}
			st, err := os.Stat(d.path(name))
			if err != nil || st.Size() != size {
				t.Fatalf("stat in the mount = %v, %v", st, err)
			}
			if size == 0 {
				// An empty file is a segment with no memory: listed, not
				// openable, and got back as nothing.
				if got := mustRun(t, nil, "--socket", d.sock, "get", name, "-"); got != "" {
					t.Fatalf("get of an empty file cp made said %q", got)
				}
				return
			}
			// The file is a segment: the socket client gets the same bytes.
			viaSocket := filepath.Join(src, fmt.Sprint("get", size))
			mustRun(t, nil, "--socket", d.sock, "get", name, viaSocket)
			if got := fileSum(t, viaSocket); got != want {
				t.Fatalf("gpushm get of a file cp made: checksum differs (%d bytes)", size)
			}
			if size >= 1<<20 {
				// Keep CI's disk and the daemon's memory small.
				sh(t, "rm", d.path(name), in, out, viaSocket)
			}
		})
	}
}

func TestFUSECoreutils(t *testing.T) {
	d := startFUSEDaemon(t)
	ctx := context.Background()
	c, err := gpushm.Dial(ctx, d.sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()

	t.Run("truncate", func(t *testing.T) {
		p := d.path("t")
		os.WriteFile(p, []byte("0123456789"), 0o644)
		sh(t, "truncate", "-s", "10M", p)
		got, _ := os.ReadFile(p)
		if len(got) != 10<<20 || string(got[:10]) != "0123456789" || !bytes.Equal(got[10:], make([]byte, 10<<20-10)) {
			t.Fatalf("after truncate up: %d bytes, head %q", len(got), got[:min(len(got), 10)])
		}
		sh(t, "truncate", "-s", "4", p)
		if got, _ := os.ReadFile(p); string(got) != "0123" {
			t.Fatalf("after truncate down: %q", got)
		}
		if inf, err := c.Stat(ctx, "t"); err != nil || inf.Size != 4 || inf.AllocSize != 4096 {
			t.Fatalf("socket stat after truncate = %+v, %v", inf, err)
		}
	})

	t.Run("rm while open", func(t *testing.T) { fuseRmWhileOpen(t, d, c) })

	t.Run("mv", func(t *testing.T) {
		os.WriteFile(d.path("a"), []byte("moved"), 0o644)
		sh(t, "mv", d.path("a"), d.path("b"))
		mustFail(t, "no such segment", "--socket", d.sock, "stat", "a")
		if got := mustRun(t, nil, "--socket", d.sock, "get", "b", "-"); got != "moved" {
			t.Fatalf("get of the new name = %q", got)
		}
	})

	t.Run("chmod", func(t *testing.T) { fuseChmod(t, d, c) })

	t.Run("getfattr", func(t *testing.T) {
		if _, err := exec.LookPath("getfattr"); err != nil {
			t.Fatal("getfattr is missing: install the attr package (scripts/test does)")
		}
		p := d.path("x")
		os.WriteFile(p, []byte("attrs"), 0o644)
		inf, _ := c.Stat(ctx, "x")
		out := sh(t, "getfattr", "-d", "-m", "-", p)
		for _, want := range []string{
			fmt.Sprintf("user.gpushm.id=\"%d\"", inf.ID),
			`user.gpushm.device="0"`,
			`user.gpushm.alloc_size="4096"`,
			`user.gpushm.handle_type="memfd"`,
			`user.allocation_size="4096"`,
		} {
			if !strings.Contains(out, want) {
				t.Fatalf("getfattr lacks %s:\n%s", want, out)
			}
		}
		sh(t, "setfattr", "-n", "user.gpushm.meta", "-v", `{"dtype":"u8","shape":[5]}`, p)
		if out := sh(t, "getfattr", "-n", "user.gpushm.meta", "--only-values", p); out != `{"dtype":"u8","shape":[5]}` {
			t.Fatalf("meta = %q", out)
		}
	})

	t.Run("df", func(t *testing.T) {
		out := sh(t, "df", "-B1", d.mnt)
		if !strings.Contains(out, "gpushm") || !strings.Contains(out, d.mnt) {
			t.Fatalf("df:\n%s", out)
		}
		var total, used, avail int64
		line := strings.Split(strings.TrimSpace(out), "\n")[1]
		if _, err := fmt.Sscanf(line, "gpushm %d %d %d", &total, &used, &avail); err != nil || total <= 0 || avail <= 0 || avail > total {
			t.Fatalf("df line %q: %v", line, err)
		}
	})

	t.Run("ls", func(t *testing.T) {
		segs, err := c.List(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var want []string
		for _, s := range segs {
			want = append(want, s.Name)
		}
		if got := strings.Fields(sh(t, "ls", d.mnt)); strings.Join(got, " ") != strings.Join(want, " ") || len(got) < 4 {
			t.Fatalf("ls = %q, the daemon lists %q", got, want)
		}
	})

	// SIGTERM: the view is unmounted, and the directory is plain again.
	d.daemon.Stop(t)
	if isMounted(t, d.mnt) {
		t.Fatal("still mounted after SIGTERM")
	}
	if ents, err := os.ReadDir(d.mnt); err != nil || len(ents) != 0 {
		t.Fatalf("mount point after exit: %v, %v", ents, err)
	}
}

// fuseChmod: chmod, chown and the rules they set, for root and for user
// nobody, through coreutils.
func fuseChmod(t *testing.T, d *fuseDaemon, c *gpushm.Client) {
	ctx := context.Background()
	p := d.path("secret")
	os.WriteFile(p, []byte("for root"), 0o644)
	nobody := func(name string, args ...string) *exec.Cmd {
		cmd := exec.Command(name, args...)
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
		return cmd
	}
	if out, err := nobody("cat", p).CombinedOutput(); err != nil || string(out) != "for root" {
		t.Fatalf("nobody reads a 0644 file: %q, %v", out, err)
	}
	sh(t, "chmod", "600", p)
	if out := mustRun(t, nil, "--socket", d.sock, "stat", "secret"); !strings.Contains(out, "0600") {
		t.Fatalf("socket stat after chmod:\n%s", out)
	}
	shFails(t, nobody("cat", p), "Permission denied")
	shFails(t, nobody("sh", "-c", "echo x >> "+p), "Permission denied")
	shFails(t, nobody("rm", "-f", p), "Operation not permitted")
	shFails(t, nobody("chmod", "666", p), "Operation not permitted")
	shFails(t, nobody("truncate", "-s", "0", p), "Permission denied")
	// A file nobody creates is nobody's, and root's rules still hold.
	if out, err := nobody("sh", "-c", "echo mine > "+d.path("theirs")).CombinedOutput(); err != nil {
		t.Fatalf("nobody creates a file: %v %s", err, out)
	}
	if inf, _ := c.Stat(ctx, "theirs"); inf.UID != 65534 || inf.GID != 65534 {
		t.Fatalf("owner of nobody's file = %d:%d", inf.UID, inf.GID)
	}
	sh(t, "chown", "1000:1000", d.path("theirs"))
	if inf, _ := c.Stat(ctx, "theirs"); inf.UID != 1000 || inf.GID != 1000 {
		t.Fatalf("owner after chown = %d:%d", inf.UID, inf.GID)
	}
}

// fuseRmWhileOpen: a file removed while a client holds it keeps its bytes
// for the client, and its memory until the last close.
func fuseRmWhileOpen(t *testing.T, d *fuseDaemon, c *gpushm.Client) {
	ctx := context.Background()
	data := []byte(strings.Repeat("keep me ", 1<<17))
	before, _ := c.Info(ctx)
	os.WriteFile(d.path("r"), data, 0o644)
	seg, err := c.Open(ctx, "r", &gpushm.OpenOptions{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	m, err := seg.Map()
	if err != nil {
		t.Fatal(err)
	}
	sh(t, "rm", d.path("r"))
	if _, err := os.Stat(d.path("r")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("stat after rm = %v", err)
	}
	if !bytes.Equal(m.Bytes(), data) {
		t.Fatal("the client lost the bytes of the removed file")
	}
	if info, _ := c.Info(ctx); info.Usage.Segments != before.Usage.Segments+1 || info.Usage.Named != before.Usage.Named {
		t.Fatalf("usage while held = %+v, before = %+v", info.Usage, before.Usage)
	}
	seg.Close()
	// The kernel sends RELEASE after close(2) has returned.
	deadline := time.Now().Add(5 * time.Second)
	for info, _ := c.Info(ctx); info.Usage != before.Usage; info, _ = c.Info(ctx) {
		if time.Now().After(deadline) {
			t.Fatalf("memory not freed after the last close: %+v", info.Usage)
		}
		time.Sleep(time.Millisecond)
	}
}

// TestFUSEXattrsOfOthers: another user reads the extended attributes of
// a file of the view only where the file's mode lets it read the file, as
// for the user.* attributes of a file on disk; stat still shows it what
// ls -l shows (docs/security.md, "What others may see").
func TestFUSEXattrsOfOthers(t *testing.T) {
	d := startFUSEDaemon(t)
	if _, err := exec.LookPath("getfattr"); err != nil {
		t.Fatal("getfattr is missing: install the attr package (scripts/test does)")
	}
	ctx := context.Background()
	c, err := gpushm.Dial(ctx, d.sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	meta := `{"origin":{"dir":"/root/models/m"}}`
	for name, mode := range map[string]uint32{"secret": 0o600, "shared": 0o644} {
		if _, _, err := c.CreateOnly(ctx, name, 4096, &gpushm.CreateOptions{Mode: &mode, Meta: []byte(meta)}); err != nil {
			t.Fatal(err)
		}
	}
	nobody := func(name string, args ...string) *exec.Cmd {
		cmd := exec.Command(name, args...)
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
		return cmd
	}
	secret, shared := d.path("secret"), d.path("shared")
	if out, err := nobody("stat", "-c", "%s %a %u", secret).CombinedOutput(); err != nil || string(out) != "4096 600 0\n" {
		t.Fatalf("nobody's stat of a 0600 file: %q, %v", out, err)
	}
	shFails(t, nobody("getfattr", "-n", "user.gpushm.meta", "--only-values", secret), "Permission denied")
	shFails(t, nobody("getfattr", "-d", "-m", "-", secret), "Permission denied")
	if out, err := nobody("getfattr", "-n", "user.gpushm.meta", "--only-values", shared).Output(); err != nil || string(out) != meta {
		t.Fatalf("nobody's getfattr of a 0644 file's meta: %q, %v", out, err)
	}
	if out, err := nobody("getfattr", "-d", "-m", "-", shared).Output(); err != nil || !strings.Contains(string(out), "user.gpushm.meta=") {
		t.Fatalf("nobody's getfattr -d of a 0644 file:\n%s%v", out, err)
	}
	if out := sh(t, "getfattr", "-n", "user.gpushm.meta", "--only-values", secret); out != meta {
		t.Fatalf("root's getfattr of its 0600 file's meta = %q", out)
	}
}

// TestFUSEStaleMount kills a daemon (both processes) with SIGKILL, which
// leaves its mount dead (ENOTCONN); the next daemon cleans it and mounts
// again.
func TestFUSEStaleMount(t *testing.T) {
	d := startFUSEDaemon(t)
	d.daemon.Kill()
	if _, err := os.Stat(d.mnt); !errors.Is(err, syscall.ENOTCONN) {
		t.Fatalf("stat of the dead daemon's mount = %v, want ENOTCONN", err)
	}
	Start(t, Options{Socket: d.sock, Args: []string{"--mount", d.mnt}})
	if err := os.WriteFile(d.path("again"), []byte("ok"), 0o600); err != nil {
		t.Fatal(err)
	}
	if got := mustRun(t, nil, "--socket", d.sock, "get", "again", "-"); got != "ok" {
		t.Fatalf("get = %q", got)
	}
}
