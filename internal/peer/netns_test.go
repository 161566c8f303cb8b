package peer

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gpushm/gpushm/internal/testutil"
)

// childEnv, when set, makes the test binary a node (runChild) instead of
// running the tests: TestNamespaces starts it inside network namespaces.
const childEnv = "GPUSHM_PEER_CHILD"

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		os.Exit(runChild())
	}
	os.Exit(m.Run())
}

// runChild runs a node configured by its environment (node name, listen
// address, peers, secret file) that serves echo, logs to stderr, and
// answers commands from stdin, a line each: "call PEER OP MS" prints "ok
// JSON" or "err MESSAGE"; "peers" prints Peers as JSON.
func runChild() int {
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	secret, err := LoadSecret(os.Getenv("PEER_SECRET"))
	if err != nil {
		log.Error("child", "err", err)
		return 1
	}
	var peers []string
	if p := os.Getenv("PEER_PEERS"); p != "" {
		peers = strings.Split(p, ",")
	}
	node := os.Getenv("PEER_NODE")
	n, err := Start(context.Background(), Config{Node: node, Secret: secret, Listen: os.Getenv("PEER_LISTEN"),
		Peers: peers, Handler: echo(node), Log: log, KeepAlive: time.Second})
	if err != nil {
		log.Error("child", "err", err)
		return 1
	}
	defer n.Close()
	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		switch {
		case len(f) == 1 && f[0] == "peers":
			b, _ := json.Marshal(n.Peers())
			fmt.Printf("%s\n", b)
		case len(f) == 4 && f[0] == "call":
			ms, _ := strconv.Atoi(f[3])
			ctx, cancel := context.WithTimeout(context.Background(), time.Duration(ms)*time.Millisecond)
			var r json.RawMessage
			if err := n.Call(ctx, f[1], f[2], nil, &r); err != nil {
				fmt.Printf("err %s\n", strings.ReplaceAll(err.Error(), "\n", " "))
			} else {
				fmt.Printf("ok %s\n", r)
			}
			cancel()
		default:
			fmt.Printf("err bad command %q\n", sc.Text())
		}
	}
	return 0
}

// child is a node in a namespace, driven through its stdin and stdout.
type child struct {
	name string
	in   io.WriteCloser
	out  *bufio.Scanner
	log  *logBuf
}

// startChild runs the test binary as node name in namespace i of w.
func startChild(t *testing.T, w *testutil.Net, i int, name, secret, listen string, peers ...string) *child {
	t.Helper()
	cmd := w.Command(i, os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"=1", "PEER_NODE="+name, "PEER_SECRET="+secret,
		"PEER_LISTEN="+listen, "PEER_PEERS="+strings.Join(peers, ","))
	c := &child{name: name, log: &logBuf{}}
	cmd.Stderr = c.log
	var err error
	if c.in, err = cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	c.out = bufio.NewScanner(out)
	if err := cmd.Start(); err != nil {
		t.Fatalf("start %s in %s: %v", name, w.Name(i), err)
	}
	t.Cleanup(func() {
		c.in.Close()
		done := make(chan struct{})
		go func() {
			cmd.Wait()
			close(done)
		}()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			cmd.Process.Kill()
			<-done
		}
		if t.Failed() {
			t.Logf("log of %s:\n%s", name, c.log)
		}
	})
	return c
}

// do sends a command and returns its answer.
func (c *child) do(t *testing.T, cmd string) string {
	t.Helper()
	if _, err := fmt.Fprintln(c.in, cmd); err != nil {
		t.Fatalf("%s: %s: %v", c.name, cmd, err)
	}
	if !c.out.Scan() {
		t.Fatalf("%s: %s: no answer (%v); its log:\n%s", c.name, cmd, c.out.Err(), c.log)
	}
	return c.out.Text()
}

// TestNamespaces runs nodes as processes in network namespaces of their
// own: two with the secret connect and call each other, a third with
// another secret is refused by both, and a cut link makes a call time out
// naming the peer.
func TestNamespaces(t *testing.T) {
	w := testutil.NetNamespaces(t, 3)
	dir := t.TempDir()
	good, bad := filepath.Join(dir, "secret"), filepath.Join(dir, "other")
	os.WriteFile(good, secretA, 0o600)
	os.WriteFile(bad, secretB, 0o600)
	addr := func(i int) string { return w.IP(i) + ":7946" }

	a := startChild(t, w, 0, "a", good, addr(0))
	b := startChild(t, w, 1, "b", good, addr(1), addr(0))
	m := startChild(t, w, 2, "mallory", bad, "", addr(0), addr(1))
	testutil.WaitFor(t, "b connected to a", func() bool {
		return strings.Contains(b.do(t, "peers"), `"connected":true`)
	})
	if got := b.do(t, "call a echo 10000"); !strings.HasPrefix(got, "ok ") || !strings.Contains(got, `"node":"a"`) {
		t.Fatalf("b: call a echo = %s", got)
	}
	if got := a.do(t, "call b echo 10000"); !strings.HasPrefix(got, "ok ") || !strings.Contains(got, `"node":"b"`) {
		t.Fatalf("a: call b echo = %s", got)
	}

	waitLog(t, a.log, "peer refused", "mallory", "proof does not match", "addr="+w.IP(2))
	waitLog(t, b.log, "peer refused", "mallory", "proof does not match", "addr="+w.IP(2))
	waitLog(t, m.log, "peer refused", "refused by the peer", "addr="+addr(0))
	if got := m.do(t, "call a echo 1000"); !strings.Contains(got, "not connected") {
		t.Errorf("mallory: call a echo = %s, want not connected", got)
	}
	if got := a.do(t, "call mallory echo 1000"); !strings.Contains(got, "not connected") {
		t.Errorf("a: call mallory echo = %s, want not connected", got)
	}

	w.Cut(0)
	t0 := time.Now()
	got := b.do(t, "call a echo 2000")
	if !strings.HasPrefix(got, "err peer a ("+addr(0)+"): echo: no answer") {
		t.Errorf("b: call a echo across a cut link = %s, want no answer naming a", got)
	}
	if d := time.Since(t0); d > 15*time.Second {
		t.Errorf("call across a cut link took %v, its deadline was 2s", d)
	}
	w.Mend(0)
}
