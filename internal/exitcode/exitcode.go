// Package exitcode tells a command's failures apart for scripts: it gives
// each class of error its exit status (docs/cli.md, "Exit status") and
// the errno name a script may test, and writes the error for a person, or
// as one object for -o json and -o yaml, in the command's words.
package exitcode

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"regexp"
	"strconv"
	"strings"
	"syscall"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"
	"sigs.k8s.io/yaml"

	"github.com/gpushm/gpushm/internal/bytesize"
	"github.com/gpushm/gpushm/internal/interrupt"
	"github.com/gpushm/gpushm/internal/wire"
)

// Exit statuses, so that a script can tell failures apart: 2 for a wrong
// command line as coreutils has it, 128+N for a signal as a shell reports
// it, and one status for each errno class a script acts on differently.
const (
	Failure     = 1
	Usage       = 2
	NotFound    = 3 // ENOENT
	Permission  = 4 // EACCES, EPERM
	Exists      = 5 // EEXIST
	Busy        = 6 // EBUSY, EAGAIN, ETIMEDOUT
	NoSpace     = 7 // ENOSPC, ENOMEM, EDQUOT
	Unreachable = 8 // no daemon answered
	Interrupted = 130
)

// Help is the exit statuses as root --help lists them.
const Help = `Exit status:
  0    success
  1    any other failure (the message says what)
  2    usage: a wrong command line (the usage line follows the message)
  3    not found (ENOENT): no such segment, or no such file
  4    permission denied (EACCES, EPERM), a daemon's socket this user may
       not connect to included
  5    exists (EEXIST)
  6    busy (EBUSY, EAGAIN, ETIMEDOUT): open, still being written, or not
       complete within --wait
  7    no space (ENOSPC, ENOMEM): a quota, a limit, or the device's memory
  8    no daemon answered on the socket
  130  interrupted (SIGINT; 143 for SIGTERM): put and get leave nothing
       behind
The daemon's own failures are 1, usage 2.`

// Code ends the command with that status and no message: another process
// already said what went wrong.
type Code int

func (e Code) Error() string { return fmt.Sprintf("exit status %d", int(e)) }

// usageError is a command line that is wrong: its message is followed by
// the command's usage line.
type usageError struct {
	cmd *cobra.Command
	err error
}

func (e *usageError) Error() string { return e.err.Error() }
func (e *usageError) Unwrap() error { return e.err }

// Usagef is a wrong command line of cmd, which exits 2 and prints cmd's
// usage line after the message.
func Usagef(cmd *cobra.Command, format string, args ...any) error {
	return &usageError{cmd, fmt.Errorf(format, args...)}
}

// StrictArgs makes a wrong number of arguments to cmd a usage error that
// says what the command takes, from its usage line.
func StrictArgs(cmd *cobra.Command) {
	check := cmd.Args
	if check == nil {
		return
	}
	cmd.Args = func(cmd *cobra.Command, args []string) error {
		if err := check(cmd, args); err != nil {
			want := strings.TrimSpace(strings.TrimPrefix(cmd.Use, cmd.Name()))
			switch {
			case want == "":
				return Usagef(cmd, "%s takes no arguments, got %s", cmd.Name(), strconv.Quote(args[0]))
			case len(args) == 0:
				return Usagef(cmd, "%s: want %s", cmd.Name(), want)
			}
			return Usagef(cmd, "%s: want %s, got %s", cmd.Name(), want, plural(len(args), "argument"))
		}
		return nil
	}
}

// plural is "1 argument", "2 arguments".
func plural(n int, what string) string {
	if n == 1 {
		return "1 " + what
	}
	return strconv.Itoa(n) + " " + what + "s"
}

// FlagError is a usage error for a flag cobra could not parse. A negative
// number read as a flag says what to do, since it is never meant as one:
// number says what a number there is ("a size is positive").
func FlagError(cmd *cobra.Command, err error, number string) error {
	msg := err.Error()
	if i := strings.Index(msg, "' in -"); strings.HasPrefix(msg, "unknown shorthand flag: '") && i > 0 {
		arg := msg[i+len("' in "):]
		if _, nerr := strconv.ParseFloat(arg, 64); nerr == nil {
			return Usagef(cmd, "%s: %s is not a flag, and %s (an argument that starts with '-' goes after '--')", cmd.Name(), arg, number)
		}
	}
	return Usagef(cmd, "%s: %s", cmd.Name(), msg)
}

// ScanFormat finds -o (or --json) in a command line before cobra parses
// it, so that an error in parsing (an unknown flag) is written in the
// format asked for too.
func ScanFormat(args []string) string {
	for i, a := range args {
		switch {
		case a == "--":
			return ""
		case a == "--json":
			return "json"
		case (a == "-o" || a == "--output") && i+1 < len(args):
			return args[i+1]
		case strings.HasPrefix(a, "--output="):
			return strings.TrimPrefix(a, "--output=")
		case strings.HasPrefix(a, "-o"):
			return strings.TrimPrefix(strings.TrimPrefix(a, "-o"), "=")
		}
	}
	return ""
}

// noDaemonError is a dial that no daemon answered: its message (the
// client's) names every socket tried.
type noDaemonError struct{ err error }

func (e *noDaemonError) Error() string { return e.err.Error() }
func (e *noDaemonError) Unwrap() error { return e.err }

// NoDaemon is err, a dial's that no daemon answered, which exits 8 and
// is said as it is (Failed leaves it).
func NoDaemon(err error) error { return &noDaemonError{err} }

// IsNoDaemon says whether err is NoDaemon's: nothing was asked of a
// daemon.
func IsNoDaemon(err error) bool {
	var ne *noDaemonError
	return errors.As(err, &ne)
}

// notClientError is a failure of a command that is not a client of the
// daemon (the daemon itself, install-systemd, bench).
type notClientError struct{ err error }

func (e *notClientError) Error() string { return e.err.Error() }
func (e *notClientError) Unwrap() error { return e.err }

// NotClient is err, a failure of a command that is not a client of the
// daemon: its status is 1, whatever errno it carries, as systemd and
// other supervisors expect.
func NotClient(err error) error { return &notClientError{err} }

// errnoError is a failure said in the command's words that carries the
// errno a script tells it by (status): "t exists", not "file exists".
type errnoError struct {
	msg   string
	errno syscall.Errno
}

// Errnof is a failure said in the command's words that exits, and is
// coded, as errno.
func Errnof(errno syscall.Errno, format string, args ...any) error {
	return &errnoError{fmt.Sprintf(format, args...), errno}
}

func (e *errnoError) Error() string { return e.msg }
func (e *errnoError) Unwrap() error { return e.errno }

// status is err's exit status and the errno name a script may test: the
// protocol's code (docs/protocol.md, "Error codes") where the error has
// one.
func status(err error) (int, string) {
	var ue *usageError
	if errors.As(err, &ue) {
		return Usage, "EINVAL"
	}
	if s := interrupt.Signal(); s != 0 {
		return 128 + int(s), "EINTR"
	}
	var nc *notClientError
	if errors.As(err, &nc) {
		return Failure, errnoName(err)
	}
	if IsNoDaemon(err) {
		if errors.Is(err, syscall.EACCES) || errors.Is(err, syscall.EPERM) {
			return Permission, "EACCES" // a socket is there, but not for this user
		}
		return Unreachable, "ECONNREFUSED"
	}
	var errno syscall.Errno
	if !errors.As(err, &errno) {
		if errors.Is(err, context.Canceled) {
			return Interrupted, "EINTR"
		}
		return Failure, errnoName(err)
	}
	switch errno {
	case syscall.ENOENT:
		return NotFound, errnoName(err)
	case syscall.EACCES, syscall.EPERM:
		return Permission, errnoName(err)
	case syscall.EEXIST:
		return Exists, errnoName(err)
	case syscall.EBUSY, syscall.EAGAIN, syscall.ETIMEDOUT:
		return Busy, errnoName(err)
	case syscall.ENOSPC, syscall.ENOMEM, syscall.EDQUOT:
		return NoSpace, errnoName(err)
	case syscall.ECONNREFUSED:
		// The daemon went away during the command and did not come back.
		return Unreachable, errnoName(err)
	}
	return Failure, errnoName(err)
}

// errnoName is the name of err's errno: the protocol's name for the codes
// it has, the kernel's for others (a local file's EISDIR), else EIO, which
// the protocol uses for "anything else; the message says what".
func errnoName(err error) string {
	var errno syscall.Errno
	if !errors.As(err, &errno) {
		return wire.Code(err)
	}
	if name := unix.ErrnoName(errno); name != "" {
		return name
	}
	return wire.Code(err)
}

// Write writes err to w, as the -o format asks ("json" and "yaml" an
// object, anything else text), and returns the process's exit status: 0
// for no error.
func Write(w io.Writer, err error, format string) int {
	if err == nil {
		return 0
	}
	var quiet Code
	if errors.As(err, &quiet) {
		return int(quiet)
	}
	code, name := status(err)
	switch format {
	case "json", "yaml":
		writeObject(w, err, code, name, format)
	default:
		WriteText(w, err)
	}
	return code
}

// errorObject is an error as -o json and -o yaml print it.
type errorObject struct {
	Error string `json:"error"`
	Code  string `json:"code"`
	Exit  int    `json:"exit"`
	// Usage is the command's usage line, for a wrong command line.
	Usage string `json:"usage,omitempty"`
	// Errors are each failure of a command given several names, when
	// more than one failed; Error and Code are the first's.
	Errors []errorObject `json:"errors,omitempty"`
}

func writeObject(w io.Writer, err error, code int, name, format string) {
	errs := split(err)
	o := errorObject{Error: Message(errs[0]), Code: name, Exit: code}
	if len(errs) > 1 {
		for _, e := range errs {
			c, n := status(e)
			o.Errors = append(o.Errors, errorObject{Error: Message(e), Code: n, Exit: c})
		}
	}
	var ue *usageError
	if errors.As(err, &ue) {
		o.Usage = useLine(ue.cmd)
	}
	var b []byte
	if format == "yaml" {
		b, _ = yaml.Marshal(o)
	} else {
		b, _ = json.Marshal(o)
		b = append(b, '\n')
	}
	w.Write(b)
}

// WriteText writes each failure on a line of its own, after "gpushm: "
// (which notices do not start with), and the usage line after a wrong
// command line.
func WriteText(w io.Writer, err error) {
	for _, e := range split(err) {
		fmt.Fprintf(w, "gpushm: %s\n", Message(e))
	}
	var ue *usageError
	if errors.As(err, &ue) {
		fmt.Fprintf(w, "Usage: %s\n(see '%s --help')\n", useLine(ue.cmd), ue.cmd.CommandPath())
	}
}

// useLine is cmd's usage line; a command's own, or a command's that takes
// commands (gpushm COMMAND).
func useLine(cmd *cobra.Command) string {
	if cmd.HasAvailableSubCommands() && !cmd.Runnable() {
		return cmd.CommandPath() + " COMMAND [flags]"
	}
	return cmd.UseLine()
}

// split is the failures err joins (a command given several names goes on
// past failures), or err alone.
func split(err error) []error {
	var nc *notClientError
	if errors.As(err, &nc) {
		err = nc.err
	}
	if j, ok := err.(interface{ Unwrap() []error }); ok && !IsNoDaemon(err) {
		var errs []error
		for _, e := range j.Unwrap() {
			if e != nil {
				errs = append(errs, e)
			}
		}
		if len(errs) > 0 {
			return errs
		}
	}
	return []error{err}
}

// Message is err's text for a person: without the "gpushm: " the client
// puts first (the line starts with it already), and with each byte count
// in binary units beside it.
func Message(err error) string {
	return withUnits(strings.TrimPrefix(err.Error(), "gpushm: "))
}

// byteCount is a count of bytes in a message, large enough for a unit to
// help.
var byteCount = regexp.MustCompile(`\b(\d{4,}) bytes\b`)

// withUnits writes "109951162777600 bytes" as "109951162777600 bytes (100
// TiB)".
func withUnits(s string) string {
	return byteCount.ReplaceAllStringFunc(s, func(m string) string {
		n, err := strconv.ParseInt(strings.TrimSuffix(m, " bytes"), 10, 64)
		if err != nil {
			return m
		}
		return m + " (" + bytesize.Format(n) + ")"
	})
}
