// Command gpushm is the gpushm daemon and its command-line client.
package main

import (
	"fmt"
	"os"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "0.1.0-dev"

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintf(os.Stderr, "gpushm: %v\n", err)
		os.Exit(1)
	}
}
