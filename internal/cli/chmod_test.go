package cli

import (
	"strings"
	"testing"
)

// TestModeChange: chmod's modes as chmod(1) reads them, octal and
// symbolic, applied to a segment's mode; what segments lack is refused.
func TestModeChange(t *testing.T) {
	for _, tc := range []struct {
		mode string
		old  uint32
		want uint32
	}{
		{"0640", 0o600, 0o640},
		{"644", 0o000, 0o644},
		{"g+r", 0o600, 0o640},
		{"a-w", 0o666, 0o444},
		{"u=rw,go=", 0o777, 0o600},
		{"+r", 0o200, 0o644},
		{"go-rwx", 0o755, 0o700},
		{"o=g", 0o650, 0o655},
		{"u+rw-x", 0o100, 0o600},
		{"ug=r,o+w", 0o000, 0o442},
		{"a=", 0o777, 0o000},
	} {
		c, err := parseModeChange(tc.mode)
		if err != nil {
			t.Fatalf("%q: %v", tc.mode, err)
		}
		if got := c.apply(tc.old); got != tc.want {
			t.Errorf("%q on %#o = %#o, want %#o", tc.mode, tc.old, got, tc.want)
		}
	}
	for _, tc := range []struct{ mode, err string }{
		{"", "want + - or ="},
		{"u", "want + - or ="},
		{"u+s", "no 's' bit"},
		{"o+t", "no 't' bit"},
		{"a+X", "no 'X' bit"},
		{"z+r", "where +, - or = goes"},
		{"u+q", "not a permission"},
		{"g+r,", "want + - or ="},
		{"1000", "want octal"},
		{"0999", "want octal"},
	} {
		if _, err := parseModeChange(tc.mode); err == nil || !strings.Contains(err.Error(), tc.err) {
			t.Errorf("%q: %v, want an error saying %q", tc.mode, err, tc.err)
		}
	}
}
