package cli

import (
	"bufio"
	"bytes"
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"

	"github.com/gpushm/gpushm/internal/exitcode"
)

// TestLsWatch: ls --watch lists again every interval until Ctrl-C, which
// ends it with status 0, as watch(1) does; SIGTERM with 143. Nothing here
// waits for a time: each step waits for the listings it needs.
func TestLsWatch(t *testing.T) {
	cliDaemon(t)
	mustRun(t, nil, "create", "a", "4096")

	for _, tc := range []struct {
		sig  syscall.Signal
		code int
	}{{syscall.SIGINT, 0}, {syscall.SIGTERM, 128 + int(syscall.SIGTERM)}} {
		cmd := exec.Command(os.Args[0], "ls", "--watch", "--interval", "20ms")
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		sc := bufio.NewScanner(out)
		frames := 0
		for frames < 3 && sc.Scan() {
			if strings.HasPrefix(sc.Text(), "Every 20ms: gpushm ls ") {
				frames++
			}
			if strings.HasPrefix(sc.Text(), "a ") && !strings.Contains(sc.Text(), " host memory ") {
				t.Errorf("ls --watch listed %q", sc.Text())
			}
		}
		if frames < 3 {
			t.Fatalf("ls --watch ended after %d listings: %s", frames, stderr.String())
		}
		cmd.Process.Signal(tc.sig)
		go io.Copy(io.Discard, out)
		cmd.Wait()
		if code := cmd.ProcessState.ExitCode(); code != tc.code {
			t.Errorf("ls --watch ended by %v: exit %d, want %d; stderr %q", tc.sig, code, tc.code, stderr.String())
		}
	}

	// -o json: a stream of listings, one JSON array each.
	cmd := exec.Command(os.Args[0], "ls", "--watch", "--interval", "20ms", "-o", "json")
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	dec := json.NewDecoder(out)
	for range 2 {
		var segs []map[string]any
		if err := dec.Decode(&segs); err != nil || len(segs) != 1 || segs[0]["name"] != "a" {
			t.Fatalf("ls --watch -o json: %v, %v", segs, err)
		}
	}
	cmd.Process.Signal(syscall.SIGINT)
	go io.Copy(io.Discard, out)
	if err := cmd.Wait(); err != nil {
		t.Errorf("ls --watch -o json, Ctrl-C: %v", err)
	}

	if r := cli(t, nil, "ls", "--interval", "1s"); r.code != exitcode.Usage || !strings.Contains(r.stderr, "--interval is for --watch") {
		t.Errorf("ls --interval without --watch: exit %d, %q", r.code, r.stderr)
	}
	if r := cli(t, nil, "ls", "--watch", "--interval", "0s"); r.code != exitcode.Usage {
		t.Errorf("ls --watch --interval 0s: exit %d, %q", r.code, r.stderr)
	}
}

// The escape sequences a listing is drawn with (ECMA-48): the cursor to
// the top left, erase to the end of the line, erase the screen.
const (
	cursorHome  = "\x1b[H"
	eraseLine   = "\x1b[K"
	eraseScreen = "\x1b[2J"
)

// TestLsWatchOnTerminal: on a terminal each listing is drawn over the
// last, and Ctrl-C typed there ends it with status 0.
func TestLsWatchOnTerminal(t *testing.T) {
	script, err := exec.LookPath("script")
	if err != nil {
		t.Skip("no script(1) to run the command in a terminal: install util-linux (Debian: bsdutils); ./scripts/test does")
	}
	cliDaemon(t)
	mustRun(t, nil, "create", "a", "4096")

	cmd := exec.Command(script, "--quiet", "--return", "--command",
		"stty cols 100 rows 30 && exec "+shellQuote(os.Args[0])+" ls --watch --interval 20ms", "/dev/null")
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var screen bytes.Buffer
	buf := make([]byte, 4096)
	for strings.Count(screen.String(), "Every 20ms") < 3 {
		n, err := out.Read(buf)
		screen.Write(buf[:n])
		if err != nil {
			t.Fatalf("ls --watch on a terminal ended: %v; it showed %q", err, screen.String())
		}
	}
	in.Write([]byte{3}) // Ctrl-C, as typed: the terminal sends SIGINT
	rest, _ := io.ReadAll(out)
	screen.Write(rest)
	if err := cmd.Wait(); err != nil {
		t.Errorf("ls --watch on a terminal, Ctrl-C: %v; it showed %q", err, screen.String())
	}
	s := screen.String()
	if !strings.HasPrefix(s, cursorHome+eraseScreen) || strings.Count(s, cursorHome) < 3 || !strings.Contains(s, eraseLine+"\r\n") {
		t.Errorf("ls --watch on a terminal did not draw each listing over the last: %q", s)
	}
}
