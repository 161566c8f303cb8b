package exitcode

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"syscall"
	"testing"

	"github.com/spf13/cobra"

	"github.com/gpushm/gpushm/internal/wire"
)

// TestWrite: each class of failure has its status and errno name, and is
// written after "gpushm: " on a line of its own, said once.
func TestWrite(t *testing.T) {
	cmd := &cobra.Command{Use: "mv OLD NEW", Run: func(*cobra.Command, []string) {}}
	tests := []struct {
		err  error
		code int
		text string
	}{
		{Usagef(cmd, "mv: want OLD NEW"), Usage, "gpushm: mv: want OLD NEW\nUsage: mv OLD NEW\n(see 'mv --help')\n"},
		{NoDaemon(errors.New("gpushm: cannot reach daemon at /x.sock")), Unreachable, "gpushm: cannot reach daemon at /x.sock\n"},
		// A socket there that refuses this user: permission, not no daemon.
		{NoDaemon(fmt.Errorf("gpushm: cannot reach daemon at /x.sock: %w", syscall.EACCES)), Permission, "gpushm: cannot reach daemon at /x.sock: permission denied\n"},
		{NotClient(fmt.Errorf("open x: %w", syscall.ENOENT)), Failure, "gpushm: open x: no such file or directory\n"},
		{&fs.PathError{Op: "open", Path: "/f", Err: syscall.ENOENT}, NotFound, "gpushm: open /f: no such file or directory\n"},
		{Failed("rm", "a", &wire.Error{Code: "EACCES", Message: `unlink: permission denied: "a"`}), Permission, "gpushm: rm a: permission denied\n"},
		{Errnof(syscall.EEXIST, "b exists"), Exists, "gpushm: b exists\n"},
		{fmt.Errorf("wait: %w", syscall.EAGAIN), Busy, "gpushm: wait: resource temporarily unavailable\n"},
		{fmt.Errorf("gpushm: create: 4294967296 bytes: %w", syscall.ENOSPC), NoSpace, "gpushm: create: 4294967296 bytes (4 GiB): no space left on device\n"},
		{Failed("get", "w", context.Canceled), Interrupted, "gpushm: get w: interrupted\n"},
		{errors.Join(Failed("rm", "x", Errnof(syscall.ENOENT, "no such segment")), Failed("rm", "y", syscall.EPERM)), NotFound,
			"gpushm: rm x: no such segment\ngpushm: rm y: operation not permitted\n"},
		{Code(42), 42, ""},
		{nil, 0, ""},
	}
	for _, tc := range tests {
		var b bytes.Buffer
		if code := Write(&b, tc.err, ""); code != tc.code || b.String() != tc.text {
			t.Errorf("Write(%v) = %d, %q; want %d, %q", tc.err, code, b.String(), tc.code, tc.text)
		}
	}
}

// TestWriteObject: with -o json an error is one object, with the errno
// name, the status, each failure of several, and the usage line.
func TestWriteObject(t *testing.T) {
	var b bytes.Buffer
	err := errors.Join(Failed("rm", "x", Errnof(syscall.ENOENT, "no such segment")), Failed("rm", "y", syscall.EPERM))
	if code := Write(&b, err, "json"); code != NotFound {
		t.Errorf("Write = %d, want %d", code, NotFound)
	}
	var o errorObject
	if err := json.Unmarshal(b.Bytes(), &o); err != nil || o.Error != "rm x: no such segment" || o.Code != "ENOENT" ||
		len(o.Errors) != 2 || o.Errors[1].Code != "EPERM" || o.Errors[1].Exit != Permission {
		t.Errorf("Write, json: %s (%v)", b.Bytes(), err)
	}
	b.Reset()
	cmd := &cobra.Command{Use: "ls [NAME]...", Run: func(*cobra.Command, []string) {}}
	Write(&b, Usagef(cmd, "ls: -o bogus"), "json")
	if err := json.Unmarshal(b.Bytes(), &o); err != nil || o.Usage != "ls [NAME]..." || o.Exit != Usage || o.Code != "EINVAL" {
		t.Errorf("Write, json, of a usage error: %s (%v)", b.Bytes(), err)
	}
}

// TestFailed: a failure is said in the command's words, the protocol's
// operation and the quoted name left out, a name quoted only where it
// would not read as one word.
func TestFailed(t *testing.T) {
	tests := []struct {
		verb, name string
		err        error
		want       string
	}{
		{"rm", "a", &wire.Error{Code: "ENOENT", Message: `unlink: no such segment: "a"`}, "rm a: no such segment"},
		{"mv", "a b", fmt.Errorf("gpushm: rename %q: %w", "a b", syscall.EPERM), `mv "a b": operation not permitted`},
		{"ls", "", errors.New("gpushm: list: boom"), "ls: boom"},
	}
	for _, tc := range tests {
		if got := Failed(tc.verb, tc.name, tc.err).Error(); got != tc.want {
			t.Errorf("Failed(%q, %q, %v) = %q, want %q", tc.verb, tc.name, tc.err, got, tc.want)
		}
	}
	said := Failed("rm", "a", syscall.ENOENT)
	if Failed("ls", "b", said) != said || Failed("x", "", nil) != nil {
		t.Error("Failed said again what was said, or made a failure of nil")
	}
	unreachable := NoDaemon(errors.New("no daemon"))
	if Failed("rm", "a", unreachable) != unreachable || !IsNoDaemon(Failed("rm", "a", unreachable)) {
		t.Error("Failed reworded a dial's failure")
	}
}

// TestStrictArgs: a wrong number of arguments says what the command
// takes.
func TestStrictArgs(t *testing.T) {
	for _, tc := range []struct {
		use  string
		args []string
		want string
	}{
		{"info", []string{"x"}, `info takes no arguments, got "x"`},
		{"create NAME SIZE", nil, "create: want NAME SIZE"},
		{"mv OLD NEW", []string{"a"}, "mv: want OLD NEW, got 1 argument"},
		{"mv OLD NEW", []string{"a", "b", "c"}, "mv: want OLD NEW, got 3 arguments"},
	} {
		cmd := &cobra.Command{Use: tc.use, Args: cobra.ExactArgs(2)}
		if tc.use == "info" {
			cmd.Args = cobra.NoArgs
		}
		StrictArgs(cmd)
		err := cmd.Args(cmd, tc.args)
		var ue *usageError
		if !errors.As(err, &ue) || err.Error() != tc.want {
			t.Errorf("%s with %q: %v, want the usage error %q", tc.use, tc.args, err, tc.want)
		}
	}
}

// TestScanFormat: -o is found before cobra parses the command line, and
// not after "--".
func TestScanFormat(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"ls", "-o", "json"}, "json"},
		{[]string{"ls", "-oyaml"}, "yaml"},
		{[]string{"ls", "-o=wide"}, "wide"},
		{[]string{"ls", "--output=name"}, "name"},
		{[]string{"stat", "--json", "x"}, "json"},
		{[]string{"rm", "--", "-o"}, ""},
		{[]string{"ls"}, ""},
	} {
		if got := ScanFormat(tc.args); got != tc.want {
			t.Errorf("ScanFormat(%q) = %q, want %q", tc.args, got, tc.want)
		}
	}
}
