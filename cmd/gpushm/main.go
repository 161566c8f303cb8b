// Command gpushm is the gpushm daemon and its command-line client.
package main

import (
	"errors"
	"fmt"
	"os"
	"strings"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "0.1.0-dev"

func main() {
	if err := run(os.Args[1:]); err != nil {
		var quiet exitCode
		if errors.As(err, &quiet) {
			os.Exit(int(quiet))
		}
		// The client's errors already say who speaks.
		fmt.Fprintf(os.Stderr, "gpushm: %s\n", strings.TrimPrefix(err.Error(), "gpushm: "))
		os.Exit(1)
	}
}

// exitCode ends the command with that status and no message: another
// process already said what went wrong.
type exitCode int

func (e exitCode) Error() string { return fmt.Sprintf("exit status %d", int(e)) }
