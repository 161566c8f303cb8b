package deploy_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// podman runs podman with storage and configuration of the test's own, so
// that it leaves nothing in the machine's image store.
type podman struct {
	t   *testing.T
	env []string
}

func newPodman(t *testing.T) *podman {
	t.Helper()
	if _, err := exec.LookPath("podman"); err != nil {
		t.Skipf("the image test needs podman (scripts/test installs it): %v", err)
	}
	if os.Geteuid() != 0 {
		t.Skip("the image test runs podman as root")
	}
	dir, err := os.MkdirTemp("", "gpushm-podman-")
	if err != nil {
		t.Fatal(err)
	}
	storage := fmt.Sprintf("[storage]\ndriver = \"vfs\"\ngraphroot = %q\nrunroot = %q\n",
		filepath.Join(dir, "graph"), filepath.Join(dir, "run"))
	// runc with cgroupfs works on hosts with hybrid cgroups (as CI's),
	// where crun refuses; the limits stay within what root may set there.
	engine := "[containers]\ndefault_ulimits = [\"nofile=4096:4096\", \"nproc=4096:4096\"]\n" +
		"[engine]\ncgroup_manager = \"cgroupfs\"\nevents_logger = \"file\"\n"
	if _, err := exec.LookPath("runc"); err == nil {
		engine += "runtime = \"runc\"\n"
	}
	write := func(name, data string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	p := &podman{t: t, env: append(os.Environ(),
		"CONTAINERS_STORAGE_CONF="+write("storage.conf", storage),
		"CONTAINERS_CONF="+write("containers.conf", engine))}
	t.Cleanup(func() {
		p.try("rm", "--all", "--force", "--time", "0")
		p.try("rmi", "--all", "--force")
		os.RemoveAll(dir)
	})
	return p
}

// try runs podman and returns its output and error.
func (p *podman) try(args ...string) (string, error) {
	cmd := exec.Command("podman", args...)
	cmd.Env = p.env
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return string(out) + stderr.String(), fmt.Errorf("podman %s: %v: %s", strings.Join(args, " "), err, stderr.String())
	}
	return string(out), nil
}

func (p *podman) run(args ...string) string {
	p.t.Helper()
	out, err := p.try(args...)
	if err != nil {
		p.t.Fatal(err)
	}
	return out
}

// gpushmBinary is $GPUSHM_BIN, or a gpushm built for the test.
func gpushmBinary(t *testing.T) string {
	t.Helper()
	if b := os.Getenv("GPUSHM_BIN"); b != "" {
		return b
	}
	b := filepath.Join(t.TempDir(), "gpushm")
	cmd := exec.Command("go", "build", "-o", b, "./cmd/gpushm")
	cmd.Dir = ".."
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	return b
}

// socketDir makes a directory for a container's /run/gpushm, as a node's
// hostPath, owned by uid.
func socketDir(t *testing.T, uid int) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "gpushm-hostpath-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(dir, uid, uid); err != nil {
		t.Fatal(err)
	}
	return dir
}

// TestImage builds the image with scripts/build-image and runs it as a
// node would: the daemon in one container, non-root, serving a socket on a
// host directory; its health check; clients on the host and in other
// containers, with the rights of their uids; a clean stop.
func TestImage(t *testing.T) {
	p := newPodman(t)
	bin := gpushmBinary(t)
	const image = "localhost/gpushm:test"
	build := exec.Command("../scripts/build-image", "--engine", "podman", "--binary", bin, "--tag", image)
	build.Env = p.env
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("scripts/build-image: %v\n%s", err, out)
	}

	var inspect []struct {
		Config struct {
			User       string
			Entrypoint []string
			Env        []string
		}
		Healthcheck struct{ Test []string }
	}
	if err := json.Unmarshal([]byte(p.run("image", "inspect", image)), &inspect); err != nil || len(inspect) != 1 {
		t.Fatalf("image inspect: %v", err)
	}
	cfg, health := inspect[0].Config, inspect[0].Healthcheck.Test
	if cfg.User != "65532:65532" || !slices.Equal(cfg.Entrypoint, []string{"/usr/bin/gpushm"}) ||
		!slices.Equal(health, []string{"CMD", "/usr/bin/gpushm", "info"}) ||
		!slices.Contains(cfg.Env, "GPUSHM_SOCKET=/run/gpushm/gpushm.sock") {
		t.Fatalf("image config: %+v, health check %q", cfg, health)
	}

	// The daemon, as the image runs it by default, on a hostPath it owns.
	dir := socketDir(t, 65532)
	sock := filepath.Join(dir, "gpushm.sock")
	p.run("run", "--detach", "--name", "gpushm-daemon", "--network", "none", "--health-interval", "disable",
		"--volume", dir+":/run/gpushm", image)
	deadline := time.Now().Add(30 * time.Second)
	for {
		_, err := p.try("healthcheck", "run", "gpushm-daemon")
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			logs, _ := p.try("logs", "gpushm-daemon")
			t.Fatalf("the health check never passed: %v\n%s", err, logs)
		}
		time.Sleep(100 * time.Millisecond)
	}

	// A client on the host (root) creates a segment through the hostPath.
	// The daemon runs as uid 65532, neither the client's nor root: clients
	// trust it when GPUSHM_DAEMON_UID names it, and only then.
	hostCmd := func(args ...string) *exec.Cmd {
		return exec.Command(bin, append([]string{"--socket", sock}, args...)...)
	}
	if out, err := hostCmd("info").CombinedOutput(); err == nil || !strings.Contains(string(out), "the daemon answering runs as uid 65532, neither you (uid 0) nor root: refused") {
		t.Errorf("info on the host, with no GPUSHM_DAEMON_UID: %v\n%s", err, out)
	}
	host := func(args ...string) string {
		t.Helper()
		cmd := hostCmd(args...)
		cmd.Env = append(os.Environ(), "GPUSHM_DAEMON_UID=65532")
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("gpushm %v on the host: %v\n%s", args, err, out)
		}
		return string(out)
	}
	host("create", "from-the-host", "1M")
	if out := host("info"); !strings.Contains(out, "backend:  host") {
		t.Errorf("info through the hostPath:\n%s", out)
	}

	// A client in another container, as uid 4242: it sees the segment and
	// may not read root's 0600 memory.
	client := func(args ...string) (string, error) {
		return p.try(append([]string{"run", "--rm", "--network", "none", "--no-healthcheck", "--user", "4242:4242",
			"--env", "GPUSHM_DAEMON_UID=65532", "--volume", dir + ":/run/gpushm", image}, args...)...)
	}
	if out, err := client("ls"); err != nil || !strings.Contains(out, "from-the-host") {
		t.Errorf("ls from a client container: %v\n%s", err, out)
	}
	if out, err := client("get", "from-the-host", "/tmp/copy"); err == nil || !strings.Contains(out, "permission denied") {
		t.Errorf("uid 4242 read root's 0600 segment from a container: %v\n%s", err, out)
	}
	if out, err := client("create", "from-a-container", "4096"); err != nil {
		t.Errorf("create from a client container: %v\n%s", err, out)
	}
	if out := host("stat", "from-a-container"); !strings.Contains(out, "(4242:4242)") {
		t.Errorf("a segment created in a container as uid 4242 is not 4242's:\n%s", out)
	}

	// SIGTERM (podman stop): a clean exit that removes the socket.
	p.run("stop", "--time", "20", "gpushm-daemon")
	if code := strings.TrimSpace(p.run("inspect", "--format", "{{.State.ExitCode}}", "gpushm-daemon")); code != "0" {
		logs, _ := p.try("logs", "gpushm-daemon")
		t.Errorf("the daemon exited %s on SIGTERM:\n%s", code, logs)
	}
	if _, err := os.Stat(sock); !os.IsNotExist(err) {
		t.Errorf("the stopped daemon left its socket: %v", err)
	}

	// A hostPath the daemon's uid cannot write: it refuses to start, saying why.
	rootOwned := socketDir(t, 0)
	out, err := p.try("run", "--rm", "--network", "none", "--no-healthcheck", "--volume", rootOwned+":/run/gpushm", image)
	if err == nil || !strings.Contains(out, "socket directory /run/gpushm (owner uid 0, mode 0755) is not writable by the daemon's uid 65532") {
		t.Errorf("daemon on a root-owned hostPath: %v\n%s", err, out)
	}
}
