package integration

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gpushm/gpushm"
)

// Clients that are processes of their own: this test binary again, in a
// role of main_test.go's table, asked over its standard input and
// answering on its standard output; and one-off connections.

// chaosClient is a client process driven over its stdin and stdout.
type chaosClient struct {
	cmd  *exec.Cmd
	in   io.WriteCloser
	out  *bufio.Reader
	errs *syncBuffer
}

func startChaosClient(t *testing.T, socket string, k int, extra ...string) *chaosClient {
	t.Helper()
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), "GPUSHM_TEST_CHAOS="+strconv.Itoa(k), "GPUSHM_SOCKET="+socket)
	cmd.Env = append(cmd.Env, extra...)
	in, _ := cmd.StdinPipe()
	out, _ := cmd.StdoutPipe()
	cc := &chaosClient{cmd: cmd, in: in, out: bufio.NewReader(out), errs: &syncBuffer{}}
	cmd.Stderr = cc.errs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	return cc
}

// ask sends a command and returns the client's one-line answer.
func (cc *chaosClient) ask(t *testing.T, k int, cmd string) string {
	t.Helper()
	fmt.Fprintln(cc.in, cmd)
	line, err := cc.out.ReadString('\n')
	if err != nil {
		t.Fatalf("client %d: %s: %v\nstderr:\n%s", k, cmd, err, cc.errs.String())
	}
	line = strings.TrimSpace(line)
	if !strings.HasPrefix(line, "ok") {
		t.Fatalf("client %d: %s: %s\nstderr:\n%s", k, cmd, line, cc.errs.String())
	}
	return line
}

func askAll(t *testing.T, clients []*chaosClient, cmd string) []string {
	t.Helper()
	out := make([]string, len(clients))
	var wg sync.WaitGroup
	var mu sync.Mutex
	var failure string
	for k, cc := range clients {
		wg.Go(func() {
			fmt.Fprintln(cc.in, cmd)
			line, err := cc.out.ReadString('\n')
			line = strings.TrimSpace(line)
			mu.Lock()
			defer mu.Unlock()
			if err != nil || !strings.HasPrefix(line, "ok") {
				failure += fmt.Sprintf("client %d: %s: %q %v\nstderr:\n%s\n", k, cmd, line, err, cc.errs.String())
			}
			out[k] = line
		})
	}
	wg.Wait()
	if failure != "" {
		t.Fatal(failure)
	}
	return out
}

// waitNamesAt waits until the daemon at sock names exactly want.
func waitNamesAt(t *testing.T, sock string, want []string, why string) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); ; {
		got := listAtQuiet(sock)
		if slices.Equal(got, want) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: the daemon names %v, want %v", why, got, want)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func listAtQuiet(sock string) []string {
	c, err := gpushm.Dial(context.Background(), sock)
	if err != nil {
		return nil
	}
	defer c.Close()
	segs, _ := c.List(context.Background())
	var out []string
	for _, s := range segs {
		out = append(out, s.Name)
	}
	return out
}

// dialOnce connects to sock with a client that does not reconnect: one
// that checks what survived a restart must not ride a restart itself.
func dialOnce(t *testing.T, sock string) *gpushm.Client {
	t.Helper()
	c, err := gpushm.Dial(context.Background(), sock)
	if err != nil {
		t.Fatal(err)
	}
	c.SetReconnect(0)
	return c
}
