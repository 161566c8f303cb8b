//go:build !linux

package layout

import (
	"errors"
	"os"
)

func fstat(*os.File) (Identity, error) { return Identity{}, errors.ErrUnsupported }
