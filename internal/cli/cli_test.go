package cli

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/spf13/cobra"
	"sigs.k8s.io/yaml"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/exitcode"
	"github.com/gpushm/gpushm/internal/testutil"
)

// TestExitStatus: each class of failure a script tells apart has its own
// status (docs/cli.md, "Exit status"), and says what went wrong in the
// command's words.
func TestExitStatus(t *testing.T) {
	dir := testutil.SocketDir(t)
	os.Chmod(dir, 0o755) // for nobody, below
	sock := filepath.Join(dir, "gpushm.sock")
	startDaemonProc(t, sock, "--max-memory", "64M")
	t.Setenv("GPUSHM_SOCKET", sock)
	mustRun(t, nil, "create", "a", "1M")

	// Held open, and another held uncommitted, by this process.
	ctx := context.Background()
	c, err := gpushm.Dial(ctx, sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	held, err := c.Open(ctx, "a", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	half, err := c.Create(ctx, "half", 4096, &gpushm.CreateOptions{Uncommitted: true})
	if err != nil {
		t.Fatal(err)
	}
	defer half.Close()

	tests := []struct {
		args []string
		code int
		// stderr is a regular expression the whole of standard error
		// must match.
		stderr string
	}{
		{[]string{"mv", "a"}, exitcode.Usage, `^gpushm: mv: want OLD NEW, got 1 argument\nUsage: gpushm mv OLD NEW \[flags\]\n\(see 'gpushm mv --help'\)\n$`},
		{[]string{"create"}, exitcode.Usage, `^gpushm: create: want NAME SIZE\nUsage: gpushm create NAME SIZE \[flags\]\n`},
		{[]string{"info", "x"}, exitcode.Usage, `^gpushm: info takes no arguments, got "x"\nUsage: gpushm info \[flags\]\n`},
		{[]string{"ls", "--bogus"}, exitcode.Usage, `^gpushm: ls: unknown flag: --bogus\nUsage: gpushm ls `},
		{[]string{"bogus"}, exitcode.Usage, `^gpushm: unknown command "bogus" for "gpushm"\nUsage: gpushm COMMAND \[flags\]\n`},
		{[]string{"create", "x", "-5"}, exitcode.Usage, `^gpushm: create: -5 is not a flag, and a size is positive, such as 4096, 64MiB or 1G \(an argument that starts with '-' goes after '--'\)\nUsage: gpushm create NAME SIZE`},
		{[]string{"create", "x", "12XB"}, exitcode.Usage, `^gpushm: create x: invalid size "12XB": unknown unit "XB"`},
		{[]string{"put", "--copier", "bogus", "x", "f"}, exitcode.Usage, `^gpushm: --copier "bogus": want auto, daemon or client\nUsage: gpushm put`},
		{[]string{"ls", "-o", "bogus"}, exitcode.Usage, `^gpushm: ls: -o bogus: want json, yaml, wide, name\n`},
		{[]string{"rm", "nope"}, exitcode.NotFound, `^gpushm: rm nope: no such segment\n$`},
		{[]string{"stat", "nope"}, exitcode.NotFound, `^gpushm: stat nope: no such segment\n$`},
		{[]string{"evict", "nope"}, exitcode.NotFound, `^gpushm: evict nope: no such segment\n$`},
		{[]string{"mv", "nope", "b"}, exitcode.NotFound, `^gpushm: mv nope: no such segment\n$`},
		{[]string{"ls", "a", "nope"}, exitcode.NotFound, `^gpushm: ls nope: no such segment\n$`},
		{[]string{"put", "x", filepath.Join(dir, "missing")}, exitcode.NotFound, `^gpushm: put x: open .*/missing: no such file or directory\n$`},
		{[]string{"create", "a", "1M"}, exitcode.Exists, `^gpushm: create a: segment exists\n$`},
		{[]string{"put", "a", "/etc/hostname"}, exitcode.Exists, `^gpushm: put a: segment exists \('gpushm put --force a \.\.\.' replaces it\)\n$`},
		{[]string{"evict", "a"}, exitcode.Busy, `^gpushm: evict a: .*\n$`},
		{[]string{"get", "half", filepath.Join(dir, "out")}, exitcode.Busy, `^gpushm: get half: .*still being written.*'gpushm get --wait 1m half `},
		// Sizes in binary units beside bytes.
		{[]string{"create", "big", "100M"}, exitcode.NoSpace, `^gpushm: create big: .*104857600 bytes \(100 MiB\)`},
		{[]string{"--socket", filepath.Join(dir, "none.sock"), "ls"}, exitcode.Unreachable, `^gpushm: cannot reach daemon at .*none.sock`},
		// Several names: each failure on its line, the first one's status.
		{[]string{"rm", "nope1", "nope2"}, exitcode.NotFound, `^gpushm: rm nope1: no such segment\ngpushm: rm nope2: no such segment\n$`},
	}
	for _, tc := range tests {
		r := cli(t, nil, tc.args...)
		if r.code != tc.code || !regexp.MustCompile(tc.stderr).MatchString(r.stderr) {
			t.Errorf("gpushm %s: exit %d, stderr:\n%s\nwant exit %d, stderr matching %q", strings.Join(tc.args, " "), r.code, r.stderr, tc.code, tc.stderr)
		}
	}
	// No repeated words: a message says each verb once.
	for _, args := range [][]string{{"create", "a", "1M"}, {"rm", "nope"}, {"evict", "nope"}, {"load", "nope"}, {"pin", "nope"}} {
		r := cli(t, nil, args...)
		if strings.Count(r.stderr, args[0]) != 1 || strings.Contains(r.stderr, "(E") {
			t.Errorf("gpushm %s said %q: want %q once and no errno code", strings.Join(args, " "), r.stderr, args[0])
		}
	}

	// Permission: another user may not remove root's segment.
	rm := exec.Command(testutil.BinaryForOthers(t), "--socket", sock, "rm", "a")
	rm.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	if r := runCmd(t, rm); r.code != exitcode.Permission || !strings.HasPrefix(r.stderr, "gpushm: rm a: ") {
		t.Errorf("rm as nobody: exit %d, stderr %q; want %d", r.code, r.stderr, exitcode.Permission)
	}
}

// TestErrorObject: with -o json an error is one JSON object on standard
// error, with its errno name and exit status; with -o yaml, a YAML one.
func TestErrorObject(t *testing.T) {
	sock := filepath.Join(testutil.SocketDir(t), "gpushm.sock")
	startDaemonProc(t, sock)
	t.Setenv("GPUSHM_SOCKET", sock)

	r := cli(t, nil, "stat", "nope", "-o", "json")
	var o map[string]any
	if err := json.Unmarshal([]byte(r.stderr), &o); err != nil || strings.Count(r.stderr, "\n") != 1 {
		t.Fatalf("stat -o json of a missing segment: stderr %q is not one JSON object: %v", r.stderr, err)
	}
	if want := map[string]any{"error": "stat nope: no such segment", "code": "ENOENT", "exit": float64(exitcode.NotFound)}; !equalJSON(o, want) || r.code != exitcode.NotFound || r.stdout != "" {
		t.Errorf("stat -o json: exit %d, stdout %q, stderr %v; want exit %d and %v", r.code, r.stdout, o, exitcode.NotFound, want)
	}

	r = cli(t, nil, "rm", "x", "y", "-o", "json")
	o = nil
	if err := json.Unmarshal([]byte(r.stderr), &o); err != nil || o["code"] != "ENOENT" || len(o["errors"].([]any)) != 2 {
		t.Errorf("rm of two missing names -o json: stderr %q (%v)", r.stderr, err)
	}

	// A usage error carries the usage line; one found while parsing
	// flags is in the format asked for too.
	r = cli(t, nil, "ls", "-o", "json", "--bogus")
	o = nil
	if err := json.Unmarshal([]byte(r.stderr), &o); err != nil || o["code"] != "EINVAL" || o["exit"] != float64(exitcode.Usage) || !strings.HasPrefix(o["usage"].(string), "gpushm ls ") {
		t.Errorf("ls -o json --bogus: exit %d, stderr %q (%v)", r.code, r.stderr, err)
	}

	r = cli(t, nil, "--socket", sock+".none", "info", "-o", "yaml")
	o = nil
	if err := yaml.Unmarshal([]byte(r.stderr), &o); err != nil || o["code"] != "ECONNREFUSED" || r.code != exitcode.Unreachable {
		t.Errorf("info -o yaml, no daemon: exit %d, stderr %q (%v)", r.code, r.stderr, err)
	}
}

func equalJSON(a, b map[string]any) bool {
	x, _ := json.Marshal(a)
	y, _ := json.Marshal(b)
	return string(x) == string(y)
}

// TestOutputFormats: every command that prints takes -o json, yaml, wide
// and name, and --json where it had it; JSON says modes in octal, times in
// RFC 3339 and owners by name, and ls filters by name and pattern.
func TestOutputFormats(t *testing.T) {
	dir, _ := cliDaemon(t)

	var seg map[string]any
	decode(t, mustRun(t, nil, "create", "llama-1", "1M", "--meta", `{"dtype":"f16"}`, "--mode", "0640", "-o", "json"), &seg)
	for k, want := range map[string]any{"name": "llama-1", "size": float64(1 << 20), "mode": "0640", "owner": "root", "group": "root", "uid": float64(0), "meta": map[string]any{"dtype": "f16"}} {
		if !equalJSON(map[string]any{k: seg[k]}, map[string]any{k: want}) {
			t.Errorf("create -o json: %s is %v, want %v", k, seg[k], want)
		}
	}
	if _, err := timeRFC3339(seg["created"]); err != nil {
		t.Errorf("create -o json: created: %v", err)
	}
	if out := mustRun(t, nil, "create", "llama-2", "2M", "-o", "name"); out != "llama-2\n" {
		t.Errorf("create -o name said %q", out)
	}
	mustRun(t, nil, "create", "other", "1M")

	// ls: names and patterns filter, meta is in JSON, --json still works.
	var segs []map[string]any
	decode(t, mustRun(t, nil, "ls", "llama-*", "-o", "json"), &segs)
	if len(segs) != 2 || segs[0]["name"] != "llama-1" || segs[1]["name"] != "llama-2" || segs[0]["meta"] == nil {
		t.Errorf("ls 'llama-*' -o json: %v", segs)
	}
	segs = nil
	decode(t, mustRun(t, nil, "ls", "--json", "other"), &segs)
	if len(segs) != 1 || segs[0]["name"] != "other" || segs[0]["mode"] != "0600" {
		t.Errorf("ls --json other: %v", segs)
	}
	if out := mustRun(t, nil, "ls", "-o", "name"); out != "llama-1\nllama-2\nother\n" {
		t.Errorf("ls -o name said %q", out)
	}
	if out := mustRun(t, nil, "ls", "no-match-*"); out != "" {
		t.Errorf("ls of a pattern that matches nothing said %q", out)
	}
	if out := mustRun(t, nil, "ls", "-o", "wide", "other"); !strings.Contains(out, "UUID") || !strings.Contains(out, "host memory") || strings.Contains(out, "llama") {
		t.Errorf("ls -o wide other:\n%s", out)
	}
	var one map[string]any
	if err := yaml.Unmarshal([]byte(mustRun(t, nil, "stat", "llama-1", "-o", "yaml")), &one); err != nil || one["mode"] != "0640" || one["owner"] != "root" {
		t.Errorf("stat -o yaml: %v (%v)", one, err)
	}

	// put and get say what they copied.
	src := filepath.Join(dir, "src")
	os.WriteFile(src, []byte("some bytes"), 0o644)
	var res map[string]any
	decode(t, mustRun(t, nil, "put", "p", src, "-o", "json"), &res)
	if res["name"] != "p" || res["bytes"] != float64(10) || res["copier"] != "daemon" || res["segment"].(map[string]any)["mode"] != "0600" {
		t.Errorf("put -o json: %v", res)
	}
	res = nil
	decode(t, mustRun(t, nil, "get", "p", filepath.Join(dir, "out"), "-o", "json", "--copier", "client"), &res)
	if res["name"] != "p" || res["bytes"] != float64(10) || res["copier"] != "client" {
		t.Errorf("get -o json: %v", res)
	}

	// Commands that print nothing by default print what -o asks.
	if out := mustRun(t, nil, "mv", "p", "q", "-o", "name"); out != "q\n" {
		t.Errorf("mv -o name said %q", out)
	}
	if out := mustRun(t, nil, "chmod", "0644", "q", "-o", "name"); out != "q\n" {
		t.Errorf("chmod -o name said %q", out)
	}
	segs = nil
	decode(t, mustRun(t, nil, "evict", "q", "-o", "json"), &segs)
	if len(segs) != 1 || segs[0]["tier"] != "host" || segs[0]["mode"] != "0644" {
		t.Errorf("evict -o json: %v", segs)
	}
	if out := mustRun(t, nil, "load", "q", "-o", "name"); out != "q\n" {
		t.Errorf("load -o name said %q", out)
	}
	segs = nil
	decode(t, mustRun(t, nil, "pin", "q", "-o", "json"), &segs)
	if len(segs) != 1 || segs[0]["pinned"] != true {
		t.Errorf("pin -o json: %v", segs)
	}
	var gone []map[string]any
	decode(t, mustRun(t, nil, "rm", "-f", "q", "nope", "-o", "json"), &gone)
	if len(gone) != 2 || gone[0]["removed"] != true || gone[1]["removed"] != false {
		t.Errorf("rm -f -o json: %v", gone)
	}
	if out := mustRun(t, nil, "rm", "other"); out != "" {
		t.Errorf("rm said %q, want nothing", out)
	}
	r := cli(t, nil, "info", "-o", "name")
	if r.code != exitcode.Usage {
		t.Errorf("info -o name: exit %d, want %d (info has no names)", r.code, exitcode.Usage)
	}
	var inf map[string]any
	decode(t, mustRun(t, nil, "info", "--json"), &inf)
	if inf["backend"] != "host" {
		t.Errorf("info --json: %v", inf)
	}
}

func decode(t *testing.T, s string, v any) {
	t.Helper()
	if err := json.Unmarshal([]byte(s), v); err != nil {
		t.Fatalf("%v:\n%s", err, s)
	}
}

// timeRFC3339 reads a time JSON wrote.
func timeRFC3339(v any) (string, error) {
	var tm struct{ T jsonTime }
	b, _ := json.Marshal(map[string]any{"T": v})
	err := json.Unmarshal(b, &tm)
	return string(tm.T), err
}

type jsonTime string

func (j *jsonTime) UnmarshalJSON(b []byte) error {
	s, err := strconv.Unquote(string(b))
	if err != nil {
		return err
	}
	if !regexp.MustCompile(`^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z$`).MatchString(s) {
		return &json.UnsupportedValueError{Str: s}
	}
	*j = jsonTime(s)
	return nil
}

// TestVersion: one version for the binary, the wheel and the image, and
// the daemon's beside the client's.
func TestVersion(t *testing.T) {
	b, err := os.ReadFile("../../VERSION")
	if err != nil {
		t.Fatal(err)
	}
	want := strings.TrimSpace(string(b))
	if out := mustRun(t, nil, "--version"); out != "gpushm "+want+"\n" {
		t.Errorf("--version said %q, want %q", out, "gpushm "+want)
	}
	// The Python package says the same (scripts/build-wheel refuses to
	// build otherwise).
	for file, re := range map[string]string{
		"../../python/pyproject.toml":     `(?m)^version = "([^"]+)"$`,
		"../../python/gpushm/__init__.py": `(?m)^__version__ = "([^"]+)"$`,
	} {
		b, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		if m := regexp.MustCompile(re).FindSubmatch(b); m == nil || string(m[1]) != want {
			t.Errorf("%s has version %q, VERSION %q", file, m, want)
		}
	}

	sock := filepath.Join(testutil.SocketDir(t), "gpushm.sock")
	out := mustRun(t, nil, "--socket", sock, "version")
	if !strings.HasPrefix(out, "client:  gpushm "+want+" (go") || !strings.Contains(out, "daemon:  none answered: cannot reach daemon at "+sock) {
		t.Errorf("version with no daemon:\n%s", out)
	}
	startDaemonProc(t, sock)
	out = mustRun(t, nil, "--socket", sock, "version")
	if !regexp.MustCompile(`daemon:  gpushm ` + regexp.QuoteMeta(want) + `, backend host, pid \d+, at ` + regexp.QuoteMeta(sock) + "\n$").MatchString(out) {
		t.Errorf("version:\n%s", out)
	}
	var v struct {
		Client struct{ Version string }
		Daemon struct{ Version, Backend, Socket string }
	}
	decode(t, mustRun(t, nil, "--socket", sock, "version", "-o", "json"), &v)
	if v.Client.Version != want || v.Daemon.Version != want || v.Daemon.Backend != "host" || v.Daemon.Socket != sock {
		t.Errorf("version -o json: %+v", v)
	}
}

// TestCompletion: the shells' scripts, and what a TAB offers: segment
// names from the daemon (quietly none when none answers), and flag values.
func TestCompletion(t *testing.T) {
	for _, shell := range []string{"bash", "zsh", "fish"} {
		if out := mustRun(t, nil, "completion", shell); !strings.Contains(out, "__complete") {
			t.Errorf("completion %s wrote no script:\n%.200s", shell, out)
		}
	}
	if out := mustRun(t, nil, "--help"); !strings.Contains(out, "  completion ") {
		t.Error("--help does not list completion")
	}
	dir := testutil.SocketDir(t)
	sock := filepath.Join(dir, "gpushm.sock")
	t.Setenv("GPUSHM_SOCKET", sock)
	// No daemon: no names, no error, success.
	if r := cli(t, nil, "__complete", "rm", ""); r.code != 0 || completions(r.stdout) != "" || strings.Contains(r.stdout+r.stderr, "gpushm:") {
		t.Errorf("__complete rm with no daemon: exit %d, %q, %q", r.code, r.stdout, r.stderr)
	}
	startDaemonProc(t, sock)
	mustRun(t, nil, "create", "alpha", "1M")
	mustRun(t, nil, "create", "beta", "1M")
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"rm", ""}, "alpha beta"},
		{[]string{"rm", "alpha", ""}, "beta"},
		{[]string{"stat", "b"}, "beta"},
		{[]string{"stat", "alpha", ""}, ""},
		{[]string{"ls", ""}, "alpha beta"},
		{[]string{"get", ""}, "alpha beta"},
		{[]string{"mv", ""}, "alpha beta"},
		{[]string{"mv", "alpha", ""}, ""},
		{[]string{"chmod", "0640", ""}, "alpha beta"},
		{[]string{"chmod", ""}, "0600 0640 0644 0660 0666"},
		{[]string{"evict", "al"}, "alpha"},
		{[]string{"load", ""}, "alpha beta"},
		{[]string{"pin", ""}, "alpha beta"},
		{[]string{"unpin", ""}, "alpha beta"},
		{[]string{"put", ""}, ""},
		{[]string{"put", "--new-version", ""}, "alpha beta"},
		{[]string{"put", "--copier", ""}, "auto daemon client"},
		{[]string{"get", "--direct", ""}, "auto always never"},
		{[]string{"daemon", "--backend", ""}, "auto cuda host"},
		{[]string{"create", "--device", ""}, "0"},
		{[]string{"ls", "-o", ""}, "json yaml wide name"},
		{[]string{"info", "-o", ""}, "json yaml wide"},
	} {
		r := cli(t, nil, append([]string{"__complete"}, tc.args...)...)
		if got := completions(r.stdout); r.code != 0 || got != tc.want {
			t.Errorf("__complete %q: %q (exit %d, %s), want %q", tc.args, got, r.code, r.stderr, tc.want)
		}
	}
}

// completions are the values __complete offered, without descriptions or
// the directive line.
func completions(out string) string {
	var vals []string
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		if line == "" || strings.HasPrefix(line, ":") {
			continue
		}
		v, _, _ := strings.Cut(line, "\t")
		vals = append(vals, v)
	}
	return strings.Join(vals, " ")
}

// TestManPages: a page for every command, with its examples.
func TestManPages(t *testing.T) {
	dir := t.TempDir()
	mustRun(t, nil, "man", dir)
	for _, page := range []string{"gpushm.1", "gpushm-put.1", "gpushm-ls.1", "gpushm-version.1", "gpushm-completion-bash.1"} {
		b, err := os.ReadFile(filepath.Join(dir, page))
		if err != nil {
			t.Error(err)
			continue
		}
		if !strings.Contains(string(b), ".TH \"GPUSHM\" \"1\"") {
			t.Errorf("%s is not a man page:\n%.300s", page, b)
		}
	}
	b, _ := os.ReadFile(filepath.Join(dir, "gpushm-put.1"))
	if !strings.Contains(string(b), "EXAMPLE") || !strings.Contains(string(b), "gpushm put weights model.bin") {
		t.Errorf("gpushm-put.1 has no examples:\n%s", b)
	}
}

// TestEveryCommandHasExamples: the help of every command people type shows
// examples.
func TestEveryCommandHasExamples(t *testing.T) {
	root, _ := newRoot()
	walk(root, func(c *cobra.Command) {
		for p := c; p != nil; p = p.Parent() {
			switch {
			case p.Hidden, p.Name() == "help", p.Name() == "completion":
				return // cobra's own, or not for people
			case p != c && p.Name() == "bench":
				return // benchmarks, whose flags are their examples
			}
		}
		if c.Example == "" {
			t.Errorf("%s has no examples", c.CommandPath())
		}
	})
}

// TestLsNoHeaders: --no-headers leaves out the table's header line alone,
// with -o wide too, and refuses a format that has none.
func TestLsNoHeaders(t *testing.T) {
	cliDaemon(t)
	mustRun(t, nil, "create", "nh-a", "1K")
	mustRun(t, nil, "create", "nh-b", "1K")
	for _, args := range [][]string{{"ls", "--no-headers"}, {"ls", "--no-headers", "-o", "wide"}} {
		out := mustRun(t, nil, args...)
		lines := strings.Split(strings.TrimSpace(out), "\n")
		if len(lines) != 2 || !strings.HasPrefix(lines[0], "nh-a ") || !strings.HasPrefix(lines[1], "nh-b ") {
			t.Errorf("gpushm %s:\n%s\nwant the two rows alone", strings.Join(args, " "), out)
		}
	}
	if out := mustRun(t, nil, "ls"); !strings.HasPrefix(out, "NAME ") {
		t.Errorf("ls without --no-headers:\n%s\nwant the header first", out)
	}
	if r := cli(t, nil, "ls", "--no-headers", "-o", "json"); r.code != 2 {
		t.Errorf("ls --no-headers -o json: exit %d, %q; want 2", r.code, r.stderr)
	}
}
