// Command gpushm is the gpushm daemon and its command-line client
// (internal/cli).
package main

import (
	"os"

	"github.com/gpushm/gpushm/internal/cli"
)

func main() { os.Exit(cli.Main(os.Args[1:])) }
