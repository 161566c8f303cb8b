package gpushm

import (
	_ "embed"
	"strings"
)

//go:embed VERSION
var version string

// Version is gpushm's version, from the VERSION file at the module's root:
// the one source of the command's version (gpushm --version, and the
// daemon's in hello), the Python wheel's (scripts/build-wheel) and the
// container image's tag (scripts/build-image).
func Version() string { return strings.TrimSpace(version) }
