//go:build !linux

package xfer

import (
	"errors"
	"os"
)

func openDirect(*os.File) (int, int64)                     { return -1, 0 }
func ownDirect(*os.File) (bool, int64)                     { return false, 0 }
func preadDirect(int, []byte, int64, int64) (int64, error) { return 0, errors.ErrUnsupported }
func directUnsupported(error) bool                         { return true }
func closeFDInt(int)                                       {}
func allocAligned(n int) ([]byte, error)                   { return make([]byte, n), nil }
func freeAligned([]byte)                                   {}
func newResidency(*os.File, int64) residency               { return nil }

func allocateAhead(*os.File, int64, int64, <-chan struct{}) {}
