package main

import "testing"

func TestForbidden(t *testing.T) {
	for _, tc := range []struct {
		from, to string
		test     bool
		bad      bool
	}{
		{"cmd/gpushm", "internal/server", false, true},
		{"cmd/gpushm", "internal/supervisor", true, false},
		{"cmd/gpushm", "internal/daemon", false, false},
		{"internal/daemon", "internal/supervisor", false, false},
		{"internal/testdaemon", "internal/backend", false, false},
		{"internal/fusefs", "internal/backend", false, true},
		{"internal/bench", "internal/server", false, true},
		{"internal/server", "internal/backend", false, true},
		{"internal/server", "internal/backend", true, false},
		{"internal/server", "internal/memfd", false, false},
		{"internal/backend", "internal/memfd", false, false},
		{"internal/supervisor", "internal/server", false, true},
		{".", "internal/segment", false, true},
		{".", "internal/server", false, true},
		{".", "internal/wire", false, false},
		{".", "internal/testdaemon", true, false},
		{".", "internal/testdaemon", false, true},
		{"internal/bench", "cmd/gpushm", false, true},
		{"internal/bench", "cmd/gpushm", true, true},
		{"checkpoint", ".", false, false},
		{"checkpoint", "internal/layout", false, false},
		{"checkpoint", "internal/segment", false, true},
		{"internal/report", "internal/wire", false, false},
		{"internal/report", "internal/segment", false, true},
		{"internal/complete", "internal/daemon", false, true},
		{"cmd/gpushm", "internal/wire", false, true},
		{"cmd/gpushm", "internal/segment", false, true},
		{"cmd/gpushm", "internal/xfer", false, true},
		{"cmd/gpushm", "internal/layout", true, false},
		{"cmd/gpushm", "internal/exitcode", false, false},
		{"cmd/gpushm", "checkpoint", false, false},
	} {
		if got := forbidden(tc.from, tc.to, tc.test) != ""; got != tc.bad {
			t.Errorf("forbidden(%q, %q, test %v) = %q, want forbidden %v", tc.from, tc.to, tc.test, forbidden(tc.from, tc.to, tc.test), tc.bad)
		}
	}
}
