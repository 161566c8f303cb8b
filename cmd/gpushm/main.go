// Command gpushm is the gpushm daemon and its command-line client.
package main

import (
	"os"

	"github.com/gpushm/gpushm/internal/exitcode"
)

func main() {
	err := run(os.Args[1:])
	os.Exit(exitcode.Write(os.Stderr, err, output))
}
