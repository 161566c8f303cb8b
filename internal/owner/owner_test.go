package owner

import "testing"

// TestParse: OWNER, OWNER:GROUP or :GROUP, by name or number; names this
// machine lacks, or neither an owner nor a group, are errors.
func TestParse(t *testing.T) {
	tests := []struct {
		in       string
		uid, gid int64
		ok       bool
	}{
		{"0", 0, -1, true},
		{"root:root", 0, 0, true},
		{":65534", -1, 65534, true},
		{"nobody:nogroup", 65534, 65534, true},
		{"65534:", 65534, -1, true},
		{":", 0, 0, false},
		{"no-such-user-here", 0, 0, false},
		{"0:no-such-group-here", 0, 0, false},
	}
	for _, tc := range tests {
		uid, gid, err := Parse(tc.in)
		if (err == nil) != tc.ok || tc.ok && (uid != tc.uid || gid != tc.gid) {
			t.Errorf("Parse(%q) = %d, %d, %v; want %d, %d, ok=%v", tc.in, uid, gid, err, tc.uid, tc.gid, tc.ok)
		}
	}
}
