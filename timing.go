package gpushm

import (
	"os"
	"runtime"
	"strconv"
	"time"
)

// How long a client spins for a reply, waits for one, and waits for a
// daemon that went away: the defaults, and the environment variables that
// override them.

// DefaultSpin is how long a client polls for a reply before it sleeps:
// longer than a typical round trip (about 20 us), so that the reply is
// usually seen without a thread wake-up. On machines of fewer than 4 cores
// the client does not spin, since it would take the core the daemon needs.
// GPUSHM_SPIN (a Go duration, "0" to disable) overrides both.
const DefaultSpin = 200 * time.Microsecond

// ClientSpin is the spin this process's clients use: GPUSHM_SPIN if set,
// else DefaultSpin, or none below 4 cores.
func ClientSpin() time.Duration {
	if v := os.Getenv("GPUSHM_SPIN"); v != "" {
		if d, err := time.ParseDuration(v); err == nil {
			return d
		}
	}
	if runtime.NumCPU() < 4 {
		return 0
	}
	return DefaultSpin
}

// DefaultReconnect is how long a client keeps trying to reach a daemon
// that went away (restarted, upgraded) before an operation fails.
// GPUSHM_RECONNECT (a Go duration, "0" to never reconnect) overrides it.
const DefaultReconnect = 30 * time.Second

func clientReconnect() time.Duration {
	if v := os.Getenv("GPUSHM_RECONNECT"); v != "" {
		if d, err := time.ParseDuration(v); err == nil {
			return d
		}
	}
	return DefaultReconnect
}

// DefaultTimeout bounds how long a client waits for each reply (and for
// the daemon to take each request), so that a daemon that never answers
// cannot hang it: after a timeout the connection is unusable and the
// operation fails with an error matching os.ErrDeadlineExceeded. Far longer
// than any operation takes; a context's deadline can shorten it.
// GPUSHM_TIMEOUT (a Go duration or a number of seconds, "0" to wait for
// ever) overrides it.
const DefaultTimeout = 60 * time.Second

func clientTimeout() time.Duration {
	v := os.Getenv("GPUSHM_TIMEOUT")
	if d, err := time.ParseDuration(v); err == nil && d >= 0 {
		return d
	}
	if s, err := strconv.ParseFloat(v, 64); err == nil && s >= 0 && s < 1e9 {
		return time.Duration(s * float64(time.Second))
	}
	return DefaultTimeout
}
