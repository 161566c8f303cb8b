// Package bench is the machinery behind 'gpushm bench' and 'gpushm demo':
// private daemons on sockets of their own, the second processes (the
// hidden '__child' command, this binary exec'd again), the driver's floors
// measured without a daemon, patterns to verify bytes by, and what a run
// leaves behind. The commands stay where users find them; internal/cli only
// adds them to its root.
package bench
