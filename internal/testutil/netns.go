package testutil

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
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
