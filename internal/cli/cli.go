// Package cli is gpushm's command line: every command, one file each (its
// flags, help, examples, and the glue to the packages below), and Main,
// which cmd/gpushm runs. The daemon is this same program: 'gpushm daemon'
// re-executes the binary (os.Executable) for its supervisor and serving
// processes, and --detach for its background one.
//
// The commands print through Stdout and Stderr, so that a test runs a
// command in its own process and reads what it wrote (as tailscale's
// cmd/tailscale/cli does); what reads or writes a file given as "-" (put,
// get, cat) uses the process's standard input and output.
package cli

import (
	"io"
	"os"

	"github.com/gpushm/gpushm/internal/exitcode"
	"github.com/gpushm/gpushm/internal/terminal"
)

// Stdout and Stderr are where the commands print; a test sets them to
// buffers. Main is not safe to run twice at once: it sets these, the
// flags and -o for the run.
var (
	Stdout io.Writer = os.Stdout
	Stderr io.Writer = os.Stderr
)

// argv is the arguments of the Main that runs, for --detach, which runs
// the same command again in the background.
var argv []string

// Main runs the command line args (without the program's name) and returns
// the process's exit status (internal/exitcode), having said any error on
// Stderr.
func Main(args []string) int {
	argv = args
	err := run(args)
	return exitcode.Write(Stderr, err, output)
}

// isTerminal says whether w is a terminal (terminal.Is), as Stdout is when
// a user runs a command, and never when a test has set it.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	return ok && terminal.Is(f)
}
