package server

import (
	"errors"
	"syscall"
	"testing"
	"time"
)

// TestCopyLimits: a user gets at most maxUserCopies copies at once, the
// next refused with EAGAIN; all users together maxCopies, the next waiting
// for one to end.
func TestCopyLimits(t *testing.T) {
	var l copyLimits
	for range maxUserCopies {
		if err := l.enter(1000); err != nil {
			t.Fatal(err)
		}
	}
	if err := l.enter(1000); !errors.Is(err, syscall.EAGAIN) {
		t.Fatalf("copy %d of one user: %v, want EAGAIN", maxUserCopies+1, err)
	}
	for uid := uint32(2000); uid < 2000+maxCopies-maxUserCopies; uid++ {
		if err := l.enter(uid); err != nil {
			t.Fatal(err)
		}
	}
	entered := make(chan error)
	go func() { entered <- l.enter(3000) }()
	select {
	case err := <-entered:
		t.Fatalf("copy past the daemon's %d ran at once (%v)", maxCopies, err)
	case <-time.After(50 * time.Millisecond):
	}
	l.leave(1000)
	if err := <-entered; err != nil {
		t.Fatal(err)
	}
	l.leave(2000)
	if err := l.enter(1000); err != nil {
		t.Fatalf("a user below its limit again: %v", err)
	}
}
