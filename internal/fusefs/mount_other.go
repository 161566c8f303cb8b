//go:build !linux

package fusefs

import (
	"errors"
	"log/slog"
)

var errLinuxOnly = errors.New("the FUSE view is implemented for Linux only")

func prepare(string, *slog.Logger) error { return errLinuxOnly }

func lazyUnmount(string) error { return errLinuxOnly }
