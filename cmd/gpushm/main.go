// Command gpushm is the gpushm daemon and its command-line client.
package main

import (
	"os"
)

func main() {
	err := run(os.Args[1:])
	os.Exit(exit(os.Stderr, err))
}
