package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gpushm/gpushm/internal/crc32c"
	"github.com/gpushm/gpushm/internal/progress"
	"github.com/gpushm/gpushm/internal/testutil"
	"github.com/gpushm/gpushm/internal/xfer"
)

// onTerminal runs the CLI with args in a terminal of 100 columns, through
// util-linux's script(1), and returns what the command wrote to it, escape
// sequences and all, as a person's screen gets it, and its exit status.
func onTerminal(t *testing.T, args ...string) (string, int) {
	t.Helper()
	return onTerminalOf(t, 100, args...)
}

// onTerminalOf is onTerminal on a terminal of cols columns (0: one that
// says it has none, as script(1) and some CI runners give).
func onTerminalOf(t *testing.T, cols int, args ...string) (string, int) {
	t.Helper()
	script, err := exec.LookPath("script")
	if err != nil {
		t.Skip("no script(1) to run the command in a terminal: install util-linux (Debian: bsdutils); ./scripts/test does")
	}
	line := "stty cols " + strconv.Itoa(cols) + " rows 30 && exec " + shellQuote(os.Args[0])
	for _, a := range args {
		line += " " + shellQuote(a)
	}
	// Not a timing assertion: a command that never ends is killed, with
	// its terminal, rather than left behind by the test binary's timeout.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, script, "--quiet", "--return", "--command", line, "/dev/null")
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err = cmd.Run()
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	if ctx.Err() != nil {
		t.Fatalf("gpushm %s on a terminal did not end; the terminal showed:\n%s", strings.Join(args, " "), out.String())
	}
	if errb.Len() > 0 {
		t.Fatalf("script: %s", errb.String())
	}
	return out.String(), code
}

func shellQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }

// bar is a progress bar as mpb draws it: the command and the name, bytes
// done of the total, the bar, and the rate.
func bar(verb, name, total string) *regexp.Regexp {
	return regexp.MustCompile(regexp.QuoteMeta(verb+" "+name) + ` +\d+\.\d (b|KiB|MiB|GiB) / ` + regexp.QuoteMeta(total) + ` \[[=>-]+\] +\d+\.\d\d [kMG]?B/s`)
}

// TestProgressOnTerminal: a long put or get draws a bar on a terminal
// (bytes, rate, then "done"), whichever side copies; on a pipe it prints
// nothing, or with -v its summary lines alone.
func TestProgressOnTerminal(t *testing.T) {
	dir, _ := cliDaemon(t)
	size := int64(progress.Min + 44<<20) // two of the daemon's steps
	src := filepath.Join(dir, "big.bin")
	testutil.SparseFile(t, src, nil, size)
	ckpt := filepath.Join(dir, "ckpt")
	os.Mkdir(ckpt, 0o755)
	n := size / 4
	hdr := `{"w":{"dtype":"F32","shape":[` + strconv.FormatInt(n, 10) + `],"data_offsets":[0,` + strconv.FormatInt(4*n, 10) + `]}}`
	hdr += strings.Repeat(" ", (8-len(hdr)%8)%8)
	testutil.SparseFile(t, filepath.Join(ckpt, "model.safetensors"), testutil.SafetensorsFile(hdr, nil), int64(8+len(hdr))+4*n)
	os.WriteFile(filepath.Join(ckpt, "config.json"), []byte(`{"model_type":"llama"}`), 0o644)

	for _, tc := range []struct {
		name  string
		args  []string
		bar   *regexp.Regexp
		final string
	}{
		{"put, the daemon copies", []string{"put", "d", src}, bar("put", "d", "300.0 MiB"), "put d: 300 MiB in "},
		{"put, this process copies", []string{"put", "--copier", "client", "c", src}, bar("put", "c", "300.0 MiB"), "put c: 300 MiB in "},
		{"put of a directory, the daemon copies", []string{"put", "k", ckpt}, bar("put", "k", "300.0 MiB"), "put k: 300"},
		{"get, the daemon copies", []string{"get", "d", filepath.Join(dir, "out-d")}, bar("get", "d", "300.0 MiB"), "get d: 300 MiB in "},
		{"get, this process copies", []string{"get", "--copier", "client", "c", filepath.Join(dir, "out-c")}, bar("get", "c", "300.0 MiB"), "get c: 300 MiB in "},
		{"get of a directory", []string{"get", "k", filepath.Join(dir, "out-k")}, bar("get", "k", "300.0 MiB"), "get k: 300"},
	} {
		screen, code := onTerminal(t, tc.args...)
		if code != 0 || !tc.bar.MatchString(screen) || !strings.Contains(screen, " done") || !strings.Contains(screen, tc.final) {
			t.Errorf("%s: gpushm %s: exit %d; the terminal showed:\n%s\nwant a bar matching %s ending in done, then %q",
				tc.name, strings.Join(tc.args, " "), code, screen, tc.bar, tc.final)
		}
	}
	// A terminal of no columns: the bar all the same, at a width of its own.
	for _, args := range [][]string{{"put", "z", src}, {"get", "z", filepath.Join(dir, "out-z")}} {
		screen, code := onTerminalOf(t, 0, args...)
		if code != 0 || !bar(args[0], "z", "300.0 MiB").MatchString(screen) || !strings.Contains(screen, " done") {
			t.Errorf("gpushm %s on a terminal of 0 columns: exit %d; the terminal showed:\n%q", strings.Join(args, " "), code, screen)
		}
	}
	if out, _ := os.ReadFile(filepath.Join(dir, "out-d")); int64(len(out)) != size || !bytes.Equal(out[size/3:size/3+8], []byte("gpushm!!")) {
		t.Errorf("get wrote %d bytes, want %d with the marks", len(out), size)
	}

	// On a pipe: no bar, and nothing at all unless asked.
	r := cli(t, nil, "put", "p", src)
	if r.code != 0 || r.stderr != "" || r.stdout != "" {
		t.Errorf("put on a pipe: exit %d, stdout %q, stderr %q; want nothing", r.code, r.stdout, r.stderr)
	}
	for _, args := range [][]string{{"put", "-v", "q", src}, {"get", "-v", "p", filepath.Join(dir, "out-p")}} {
		r := cli(t, nil, args...)
		lines := strings.Split(strings.TrimSuffix(r.stderr, "\n"), "\n")
		prefix := args[0] + " " + args[2] + ": "
		for _, l := range lines {
			if !strings.HasPrefix(l, prefix) || strings.ContainsAny(l, "\r\x1b[") {
				t.Errorf("gpushm %s on a pipe wrote %q; want its summary lines alone", strings.Join(args, " "), r.stderr)
				break
			}
		}
	}
}

// TestDaemonCopyInSteps: a file the daemon copies in several steps keeps
// its bytes and its checksum: the CRC-32C put records is the whole file's,
// made from the steps', and the same whoever copies.
func TestDaemonCopyInSteps(t *testing.T) {
	dir, _ := cliDaemon(t)
	n := int64(2*xfer.MinStep/4 + 1000) // F32s: more than one step
	hdr := `{"w":{"dtype":"F32","shape":[` + strconv.FormatInt(n, 10) + `],"data_offsets":[0,` + strconv.FormatInt(4*n, 10) + `]}}`
	hdr += strings.Repeat(" ", (8-len(hdr)%8)%8)
	src := filepath.Join(dir, "model.safetensors")
	size := int64(8+len(hdr)) + 4*n
	testutil.SparseFile(t, src, testutil.SafetensorsFile(hdr, nil), size)
	data, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	want := crc32c.Format(crc32c.Checksum(data))

	for _, copier := range []string{"daemon", "client"} {
		var res struct {
			Copier, CRC32C string
			Segment        struct {
				Meta struct {
					Origin struct {
						Files []struct{ CRC32C string }
					}
				}
			}
		}
		decode(t, mustRun(t, nil, "put", "--copier", copier, "m-"+copier, src, "-o", "json"), &res)
		files := res.Segment.Meta.Origin.Files
		if res.Copier != copier || res.CRC32C != want || len(files) != 1 || files[0].CRC32C != want {
			b, _ := json.Marshal(res)
			t.Errorf("put --copier %s: %s; want the CRC-32C %s recorded", copier, b, want)
		}
		out := filepath.Join(dir, "out-"+copier)
		mustRun(t, nil, "get", "m-"+copier, out)
		if got, _ := os.ReadFile(out); !bytes.Equal(got, data) {
			t.Errorf("get of what put --copier %s copied differs from the file (%d bytes, want %d)", copier, len(got), len(data))
		}
	}
}

// TestGetToATerminal: get NAME - refuses a terminal, as cat refuses
// binary there, and says what to do instead; a pipe still gets the bytes.
func TestGetToATerminal(t *testing.T) {
	cliDaemon(t)
	mustRun(t, nil, "create", "tty-seg", "4K")
	out, code := onTerminal(t, "get", "tty-seg", "-")
	if code == 0 || !strings.Contains(out, "binary output can mess up your terminal") || !strings.Contains(out, "'gpushm get tty-seg FILE' writes a file") {
		t.Fatalf("get - on a terminal: exit %d, the terminal showed:\n%q", code, out)
	}
	if strings.Contains(out, "\x00\x00\x00\x00") {
		t.Fatalf("get - on a terminal wrote the segment's bytes: %q", out)
	}
	if got := mustRun(t, nil, "get", "tty-seg", "-"); len(got) != 4096 {
		t.Fatalf("get - into a pipe: %d bytes, want 4096", len(got))
	}
}

// TestQuiet: put and get -q draw no bar and print no summary on a
// terminal; errors still show; -q with -v is a usage error.
func TestQuiet(t *testing.T) {
	dir, _ := cliDaemon(t)
	src := filepath.Join(dir, "big.bin")
	testutil.SparseFile(t, src, nil, int64(progress.Min))
	for _, args := range [][]string{{"put", "-q", "q", src}, {"get", "-q", "q", filepath.Join(dir, "out")}} {
		if screen, code := onTerminal(t, args...); code != 0 || strings.TrimSpace(screen) != "" {
			t.Errorf("gpushm %s on a terminal: exit %d, the terminal showed %q; want nothing", strings.Join(args, " "), code, screen)
		}
	}
	if screen, code := onTerminal(t, "get", "-q", "nonesuch", filepath.Join(dir, "x")); code == 0 || !strings.Contains(screen, "no such segment") {
		t.Errorf("get -q of a missing segment: exit %d, %q; want the error", code, screen)
	}
	if r := cli(t, nil, "put", "-q", "-v", "q2", src); r.code != 2 {
		t.Errorf("put -q -v: exit %d, %q; want 2", r.code, r.stderr)
	}
}
