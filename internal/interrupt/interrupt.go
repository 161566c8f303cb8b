// Package interrupt makes a command that copies (put, get) interruptible:
// the first SIGINT or SIGTERM cancels its context, and it unwinds as it
// does on any failure, leaving nothing behind (an uncommitted segment goes
// with its connection; a file is written under a temporary name and
// renamed only once complete), then exits 128+N as a shell would report
// the signal. What a context cannot stop (a copy this process makes
// itself, a read of a pipe) ends by itself; a second signal does not wait
// for it, and ends the process at once after the cleanups registered with
// AtExit.
package interrupt

import (
	"context"
	"os"
	"os/signal"
	"sync"
	"sync/atomic"
	"syscall"
)

// caught is the signal that interrupted the command, or 0: the process's,
// since the exit status a shell reports is the process's.
var caught atomic.Int32

// Signal is the signal that interrupted the command, or 0.
func Signal() syscall.Signal { return syscall.Signal(caught.Load()) }

// Context returns a context that the first SIGINT or SIGTERM cancels, and
// the function that stops listening for them, which the command calls
// before it returns.
func Context(parent context.Context) (context.Context, func()) {
	ctx, cancel := context.WithCancel(parent)
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		select {
		case s := <-sigs:
			caught.Store(int32(s.(syscall.Signal)))
			cancel()
		case <-done:
			return
		}
		select {
		case s := <-sigs:
			forcedExit(128 + int(s.(syscall.Signal)))
		case <-done:
		}
	}()
	return ctx, func() {
		signal.Stop(sigs)
		close(done)
		wg.Wait()
		cancel()
	}
}

// cleanups are what a forced exit undoes: files a command has not
// finished writing.
var cleanups struct {
	sync.Mutex
	next int
	fns  map[int]func()
}

// AtExit has a forced exit call fn, until the returned function is
// called.
func AtExit(fn func()) (cancel func()) {
	cleanups.Lock()
	defer cleanups.Unlock()
	if cleanups.fns == nil {
		cleanups.fns = make(map[int]func())
	}
	id := cleanups.next
	cleanups.next++
	cleanups.fns[id] = fn
	return func() {
		cleanups.Lock()
		defer cleanups.Unlock()
		delete(cleanups.fns, id)
	}
}

func forcedExit(code int) {
	cleanups.Lock()
	for _, fn := range cleanups.fns {
		fn()
	}
	os.Stderr.WriteString("\ngpushm: interrupted\n")
	os.Exit(code)
}
