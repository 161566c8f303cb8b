//go:build !linux

package checkpoint

import (
	"errors"
	"os"
)

func fstat(*os.File) (Identity, error) { return Identity{}, errors.ErrUnsupported }
