package report

import (
	"fmt"
	"path"
	"strings"

	"github.com/gpushm/gpushm"
)

// CheckPatterns refuses a pattern of ls that path.Match cannot read.
func CheckPatterns(args []string) error {
	for _, a := range args {
		if _, err := path.Match(a, ""); err != nil {
			return fmt.Errorf("pattern %q: %w", a, err)
		}
	}
	return nil
}

// Select is the segments of all that args, ls's names and shell globs,
// name or match (all of them for no args), and the names that name none:
// a pattern that matches none is no error.
func Select(all []gpushm.SegmentInfo, args []string) (segs []gpushm.SegmentInfo, missing []string) {
	matched := make([]bool, len(args))
	for _, s := range all {
		keep := len(args) == 0
		for i, a := range args {
			if ok, _ := path.Match(a, s.Name); ok {
				matched[i], keep = true, true
			}
		}
		if keep {
			segs = append(segs, s)
		}
	}
	for i, a := range args {
		if !matched[i] && !isPattern(a) {
			missing = append(missing, a)
		}
	}
	return segs, missing
}

// isPattern says whether an argument of ls is a glob rather than a name.
func isPattern(arg string) bool { return strings.ContainsAny(arg, "*?[\\") }
