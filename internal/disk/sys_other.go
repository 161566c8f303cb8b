//go:build !linux

package disk

import "errors"

// Elsewhere than Linux, the store writes through the page cache and fsync.
const oDirect = 0

func directAlign(int) (int64, bool) { return 4096, false }
func reserve(int, int64) error      { return nil }
func directRefused(error) bool      { return errors.ErrUnsupported != nil }
