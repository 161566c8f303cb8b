package testutil

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

// Net is a small network of its own for a test: n network namespaces,
// each with one interface (eth0) on a bridge that lives in a further
// namespace (the hub), addressed from the benchmarking range
// 198.18.0.0/15 (RFC 2544). Nothing of it is in the host's namespace:
// its addresses are reachable only from its namespaces, and nothing
// outside them is a target. Made by NetNamespaces; removed at the test's
// end.
type Net struct {
	t      testing.TB
	prefix string
	n      int
}

// NetNamespaces makes a Net of n namespaces (at most 250), and removes it
// in t.Cleanup. It skips the test, saying why, when not root, when ip(8)
// (iproute2) is missing, or when the kernel will not make namespaces or
// bridges here (an unprivileged container).
func NetNamespaces(t testing.TB, n int) *Net {
	t.Helper()
	switch {
	case runtime.GOOS != "linux":
		t.Skip("network namespaces: Linux only")
	case os.Geteuid() != 0:
		t.Skip("network namespaces: needs root")
	case n < 1 || n > 250:
		t.Fatalf("NetNamespaces(%d): between 1 and 250", n)
	}
	if _, err := exec.LookPath("ip"); err != nil {
		t.Skip("network namespaces: no ip command (apt-get install iproute2)")
	}
	var b [3]byte
	rand.Read(b[:])
	w := &Net{t: t, prefix: "gpushm-" + hex.EncodeToString(b[:]) + "-", n: n}
	t.Cleanup(w.remove)
	hub := w.prefix + "hub"
	if out, err := exec.Command("ip", "netns", "add", hub).CombinedOutput(); err != nil {
		t.Skipf("network namespaces: ip netns add: %v: %s", err, out)
	}
	if out, err := exec.Command("ip", "-n", hub, "link", "add", "br0", "type", "bridge").CombinedOutput(); err != nil {
		t.Skipf("network namespaces: a bridge: %v: %s", err, out)
	}
	w.ip("-n", hub, "link", "set", "br0", "up")
	for i := range n {
		ns := w.Name(i)
		w.ip("netns", "add", ns)
		w.ip("-n", ns, "link", "set", "lo", "up")
		w.ip("-n", hub, "link", "add", w.port(i), "type", "veth", "peer", "name", "eth0", "netns", ns)
		w.ip("-n", hub, "link", "set", w.port(i), "master", "br0", "up")
		w.ip("-n", ns, "addr", "add", w.IP(i)+"/24", "dev", "eth0")
		w.ip("-n", ns, "link", "set", "eth0", "up")
	}
	return w
}

// Name is the i-th namespace's name, as ip netns knows it.
func (w *Net) Name(i int) string { return fmt.Sprintf("%s%d", w.prefix, i) }

// IP is the i-th namespace's address: 198.18.0.(i+1).
func (w *Net) IP(i int) string { return fmt.Sprintf("198.18.0.%d", i+1) }

// port is the hub's end of the i-th namespace's link.
func (w *Net) port(i int) string { return fmt.Sprintf("p%d", i) }

// Command runs name with args in the i-th namespace (ip netns exec), as a
// child process: the test binary re-executed (os.Args[0]), or a gpushm
// binary. The caller starts it and waits for it, before the test's end.
func (w *Net) Command(i int, name string, args ...string) *exec.Cmd {
	return exec.Command("ip", append([]string{"netns", "exec", w.Name(i), name}, args...)...)
}

// Cut takes the i-th namespace's link down at the bridge: its packets go
// nowhere and no connection is told, as in a partition.
func (w *Net) Cut(i int) { w.ip("-n", w.prefix+"hub", "link", "set", w.port(i), "down") }

// Mend brings the i-th namespace's link back up.
func (w *Net) Mend(i int) { w.ip("-n", w.prefix+"hub", "link", "set", w.port(i), "up") }

// Hosts makes lines the i-th namespace's /etc/hosts, as its Commands see
// it: ip netns exec mounts each file of /etc/netns/NAME/ over /etc's, so
// that one name may resolve to several addresses there, as a Kubernetes
// headless Service's does. The file is written in place, so a Command
// already running reads the new lines (Go's resolver within 5 s). Its
// nsswitch.conf is the host's with host names from the file alone: no DNS
// server is asked, and Go resolves by itself rather than through the C
// library (whose answer from /etc/hosts is one address unless host.conf
// says "multi on"). Removed at the test's end.
func (w *Net) Hosts(i int, lines ...string) {
	w.t.Helper()
	for _, f := range []string{"/etc/hosts", "/etc/nsswitch.conf"} {
		if _, err := os.Stat(f); err != nil {
			w.t.Skipf("a namespace's %s: ip netns exec mounts one only over the host's: %v", f, err)
		}
	}
	dir := filepath.Join("/etc/netns", w.Name(i))
	if _, err := os.Stat(dir); err != nil {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			w.t.Fatal(err)
		}
		w.t.Cleanup(func() {
			os.RemoveAll(dir)
			os.Remove("/etc/netns") // unless another's are there
		})
		ns, err := os.ReadFile("/etc/nsswitch.conf")
		if err != nil {
			w.t.Fatal(err)
		}
		var b strings.Builder
		for line := range strings.Lines(string(ns)) {
			if !strings.HasPrefix(strings.TrimSpace(line), "hosts:") {
				b.WriteString(line)
			}
		}
		b.WriteString("hosts: files\n")
		if err := os.WriteFile(filepath.Join(dir, "nsswitch.conf"), []byte(b.String()), 0o644); err != nil {
			w.t.Fatal(err)
		}
	}
	// Not renamed into place: a running Command's mount holds the inode.
	hosts := "127.0.0.1 localhost\n" + strings.Join(lines, "\n") + "\n"
	if err := os.WriteFile(filepath.Join(dir, "hosts"), []byte(hosts), 0o644); err != nil {
		w.t.Fatal(err)
	}
}

func (w *Net) ip(args ...string) {
	w.t.Helper()
	if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
		w.t.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out)
	}
}

// remove deletes the namespaces, and with them their links and the
// bridge. A process still inside one keeps it alive, nameless, until it
// exits: stop the Commands first (their t.Cleanup runs before this one).
func (w *Net) remove() {
	for i := range w.n {
		exec.Command("ip", "netns", "del", w.Name(i)).Run()
	}
	exec.Command("ip", "netns", "del", w.prefix+"hub").Run()
}
