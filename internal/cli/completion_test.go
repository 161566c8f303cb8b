package cli

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestBashCompletionAlone: the bash script completes commands and segment
// names in a bash without the bash-completion package (--norc: nothing
// loaded), and prints no error.
func TestBashCompletionAlone(t *testing.T) {
	bash, err := exec.LookPath("bash")
	if err != nil {
		t.Skip("no bash")
	}
	_, sock := cliDaemon(t)
	mustRun(t, nil, "create", "comp-weights", "1K")
	bin := t.TempDir()
	if err := os.Symlink(os.Args[0], filepath.Join(bin, "gpushm")); err != nil {
		t.Fatal(err)
	}
	script := filepath.Join(bin, "gpushm.bash")
	os.WriteFile(script, []byte(mustRun(t, nil, "completion", "bash")), 0o644)
	complete := func(line string) (string, string) {
		t.Helper()
		words := strings.Fields(line)
		if strings.HasSuffix(line, " ") {
			words = append(words, "")
		}
		prog := `source "$1"; shift
COMP_WORDS=("$@"); COMP_CWORD=$(($# - 1)); COMP_LINE="$*"; COMP_POINT=${#COMP_LINE}
__start_gpushm gpushm "${COMP_WORDS[COMP_CWORD]}" "${COMP_WORDS[COMP_CWORD-1]}"
printf '%s\n' "${COMPREPLY[@]}"`
		cmd := exec.Command(bash, append([]string{"--norc", "--noprofile", "-c", prog, "bash", script}, words...)...)
		cmd.Env = append(os.Environ(), "PATH="+bin+":"+os.Getenv("PATH"), "GPUSHM_SOCKET="+sock)
		var out, errb strings.Builder
		cmd.Stdout, cmd.Stderr = &out, &errb
		if err := cmd.Run(); err != nil {
			t.Fatalf("completing %q: %v\n%s", line, err, errb.String())
		}
		// compopt refuses outside a real TAB: this harness calls the
		// function directly, which is all that differs.
		var errs []string
		for _, l := range strings.Split(strings.TrimSpace(errb.String()), "\n") {
			if l != "" && !strings.Contains(l, "compopt: not currently executing completion function") {
				errs = append(errs, l)
			}
		}
		return out.String(), strings.Join(errs, "\n")
	}
	for _, tc := range []struct{ line, want string }{
		{"gpushm da", "daemon"},
		{"gpushm stat comp-", "comp-weights"},
	} {
		out, errs := complete(tc.line)
		if !strings.Contains(out, tc.want) || errs != "" {
			t.Errorf("completing %q: got %q, stderr %q; want %q and no error", tc.line, out, errs, tc.want)
		}
	}
}
