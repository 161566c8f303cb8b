package main

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

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/bytesize"
	"github.com/gpushm/gpushm/internal/wire"
)

// Exit statuses (docs/cli.md, "Exit status"), so that a script can tell
// failures apart: 2 for a wrong command line as coreutils has it, 128+N
// for a signal as a shell reports it, and one status for each errno class
// a script acts on differently.
const (
	exitFailure     = 1
	exitUsage       = 2
	exitNotFound    = 3 // ENOENT
	exitPermission  = 4 // EACCES, EPERM
	exitExists      = 5 // EEXIST
	exitBusy        = 6 // EBUSY, EAGAIN, ETIMEDOUT
	exitNoSpace     = 7 // ENOSPC, ENOMEM, EDQUOT
	exitUnreachable = 8 // no daemon answered
	exitInterrupted = 130
)

// exitHelp is the exit statuses as root --help lists them.
const exitHelp = `Exit status:
  0    success
  1    any other failure (the message says what)
  2    usage: a wrong command line (the usage line follows the message)
  3    not found (ENOENT): no such segment, or no such file
  4    permission denied (EACCES, EPERM)
  5    exists (EEXIST)
  6    busy (EBUSY, EAGAIN, ETIMEDOUT): open, still being written, or not
       complete within --wait
  7    no space (ENOSPC, ENOMEM): a quota, a limit, or the device's memory
  8    no daemon answered on the socket
  130  interrupted (SIGINT; 143 for SIGTERM): put and get leave nothing
       behind
The daemon's own failures are 1, usage 2.`

// exitCode ends the command with that status and no message: another
// process already said what went wrong.
type exitCode int

func (e exitCode) Error() string { return fmt.Sprintf("exit status %d", int(e)) }

// usageError is a command line that is wrong: its message is followed by
// the command's usage line.
type usageError struct {
	cmd *cobra.Command
	err error
}

func (e *usageError) Error() string { return e.err.Error() }
func (e *usageError) Unwrap() error { return e.err }

// usagef is a usageError of cmd.
func usagef(cmd *cobra.Command, format string, args ...any) error {
	return &usageError{cmd, fmt.Errorf(format, args...)}
}

// unreachableError is a dial that no daemon answered: its message (the
// client's) names every socket tried.
type unreachableError struct{ err error }

func (e *unreachableError) Error() string { return e.err.Error() }
func (e *unreachableError) Unwrap() error { return e.err }

// daemonError is a failure of a command that is not a client of the
// daemon (the daemon itself, install-systemd, bench): its status is 1,
// whatever errno it carries, as systemd and other supervisors expect.
type daemonError struct{ err error }

func (e *daemonError) Error() string { return e.err.Error() }
func (e *daemonError) Unwrap() error { return e.err }

// errnoError is a failure said in the command's words that carries the
// errno a script tells it by (status): "t exists", not "file exists".
type errnoError struct {
	msg   string
	errno syscall.Errno
}

func errnof(errno syscall.Errno, format string, args ...any) error {
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
		return exitUsage, "EINVAL"
	}
	if s := interruption(); s != 0 {
		return 128 + int(s), "EINTR"
	}
	var de *daemonError
	if errors.As(err, &de) {
		return exitFailure, errnoName(err)
	}
	var ne *unreachableError
	if errors.As(err, &ne) {
		return exitUnreachable, "ECONNREFUSED"
	}
	var errno syscall.Errno
	if !errors.As(err, &errno) {
		if errors.Is(err, context.Canceled) {
			return exitInterrupted, "EINTR"
		}
		return exitFailure, errnoName(err)
	}
	switch errno {
	case syscall.ENOENT:
		return exitNotFound, errnoName(err)
	case syscall.EACCES, syscall.EPERM:
		return exitPermission, errnoName(err)
	case syscall.EEXIST:
		return exitExists, errnoName(err)
	case syscall.EBUSY, syscall.EAGAIN, syscall.ETIMEDOUT:
		return exitBusy, errnoName(err)
	case syscall.ENOSPC, syscall.ENOMEM, syscall.EDQUOT:
		return exitNoSpace, errnoName(err)
	case syscall.ECONNREFUSED:
		// The daemon went away during the command and did not come back.
		return exitUnreachable, errnoName(err)
	}
	return exitFailure, errnoName(err)
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

// exit writes err to w, as the -o format asks, and returns the process's
// exit status: 0 for no error.
func exit(w io.Writer, err error) int {
	if err == nil {
		return 0
	}
	var quiet exitCode
	if errors.As(err, &quiet) {
		return int(quiet)
	}
	code, name := status(err)
	switch output {
	case "json", "yaml":
		writeErrorObject(w, err, code, name)
	default:
		writeErrorText(w, err)
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

func writeErrorObject(w io.Writer, err error, code int, name string) {
	errs := split(err)
	o := errorObject{Error: message(errs[0]), Code: name, Exit: code}
	if len(errs) > 1 {
		for _, e := range errs {
			c, n := status(e)
			o.Errors = append(o.Errors, errorObject{Error: message(e), Code: n, Exit: c})
		}
	}
	var ue *usageError
	if errors.As(err, &ue) {
		o.Usage = useLine(ue.cmd)
	}
	var b []byte
	if output == "yaml" {
		b, _ = yaml.Marshal(o)
	} else {
		b, _ = json.Marshal(o)
		b = append(b, '\n')
	}
	w.Write(b)
}

// writeErrorText writes each failure on a line of its own, after
// "gpushm: " (which notices do not start with), and the usage line after
// a wrong command line.
func writeErrorText(w io.Writer, err error) {
	for _, e := range split(err) {
		fmt.Fprintf(w, "gpushm: %s\n", message(e))
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
	var de *daemonError
	if errors.As(err, &de) {
		err = de.err
	}
	if j, ok := err.(interface{ Unwrap() []error }); ok && !isUnreachable(err) {
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

func isUnreachable(err error) bool {
	var ne *unreachableError
	return errors.As(err, &ne)
}

// message is err's text for a person: without the "gpushm: " the client
// puts first (the line starts with it already), and with each byte count
// in binary units beside it.
func message(err error) string {
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

// failed says err in a command's words: "rm a: no such segment" where the
// daemon said `unlink: no such segment: "a"`. The protocol operation
// that starts the daemon's message (and the client's "gpushm: op NAME:")
// is not the command's word, and the name is said once. An error that
// names no segment, such as a dial's, is returned as it is.
func failed(verb, name string, err error) error {
	if err == nil || isUnreachable(err) {
		return err
	}
	var ue *usageError
	if errors.As(err, &ue) {
		return err
	}
	var we *wordsError
	if errors.As(err, &we) {
		return err // said in words already
	}
	return &wordsError{verb: verb, name: name, err: err}
}

type wordsError struct {
	verb, name string
	err        error
}

func (e *wordsError) Unwrap() error { return e.err }

func (e *wordsError) Error() string {
	what := e.verb
	if e.name != "" {
		what += " " + quoteName(e.name)
	}
	return what + ": " + plain(e.err, e.name)
}

// quoteName quotes a name only when it would not read as one word.
func quoteName(name string) string {
	if name == "" || strings.ContainsAny(name, " \t\n\"'\\") || strconv.Quote(name) != `"`+name+`"` {
		return strconv.Quote(name)
	}
	return name
}

// protocolOps are the operations a daemon's or the client's message may
// start with.
var protocolOps = []string{
	wire.OpCreate, wire.OpOpen, wire.OpClose, wire.OpUnlink, wire.OpStat, wire.OpList,
	wire.OpChmod, wire.OpChown, wire.OpRename, wire.OpPublish, wire.OpReclaim, wire.OpCommit,
	wire.OpFill, wire.OpDump, wire.OpEvict, wire.OpLoad, wire.OpPin, wire.OpWaitVersion, wire.OpInfo,
}

// plain is err's message without the protocol's words: the daemon's
// message (the client's wrapping repeats the operation and the name), less
// the operation it starts with and the name it ends with.
func plain(err error, name string) string {
	if errors.Is(err, context.Canceled) {
		return "interrupted"
	}
	msg := err.Error()
	var we *gpushm.Error
	if errors.As(err, &we) {
		msg = we.Message
	}
	quoted := strconv.Quote(name)
	for trimmed := true; trimmed; {
		trimmed = false
		if rest, ok := strings.CutPrefix(msg, "gpushm: "); ok {
			msg, trimmed = rest, true
		}
		for _, op := range protocolOps {
			for _, p := range []string{op + ": ", op + " " + quoted + ": "} {
				if rest, ok := strings.CutPrefix(msg, p); ok {
					msg, trimmed = rest, true
				}
			}
		}
	}
	return strings.TrimSuffix(msg, ": "+quoted)
}
