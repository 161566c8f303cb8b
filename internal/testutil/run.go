package testutil

import (
	"bytes"
	"errors"
	"os/exec"
	"strings"
	"testing"
)

// Run runs cmd to its end and returns what it wrote and its exit code; a
// command that cannot run at all fails the test.
func Run(t testing.TB, cmd *exec.Cmd) (stdout, stderr string, code int) {
	t.Helper()
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	return out.String(), errb.String(), code
}

// ErrorSays says whether an error line of a command's stderr (one that
// starts "gpushm: ") mentions want.
func ErrorSays(stderr, want string) bool {
	for line := range strings.Lines(stderr) {
		if strings.HasPrefix(line, "gpushm: ") && strings.Contains(line, want) {
			return true
		}
	}
	return false
}
