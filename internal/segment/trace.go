package segment

import "time"

// Trace collects how long the steps of one operation took, for a client
// that asks (the protocol's "trace"; benchmarks print it). A nil *Trace
// records nothing, so the paths that time steps need no test of their own.
type Trace struct {
	Steps []Step
	last  time.Time
}

// Step is one timed part of an operation.
type Step struct {
	Name string
	D    time.Duration
}

// NewTrace starts a trace at start.
func NewTrace(start time.Time) *Trace { return &Trace{last: start} }

// Mark ends the step called name at now: it lasted since the previous
// mark (or the start).
func (t *Trace) Mark(name string) {
	if t == nil {
		return
	}
	now := time.Now()
	t.Steps = append(t.Steps, Step{Name: name, D: now.Sub(t.last)})
	t.last = now
}

// Pooled is implemented by memory that can say whether it came from an
// allocator's pool of allocations made ahead of time; a trace names the
// allocation step after it.
type Pooled interface {
	FromPool() bool
}

// allocStep names the allocation step of a trace: "alloc-pool" for memory
// that was ready before it was asked for, "alloc" otherwise.
func allocStep(mem Memory) string {
	if p, ok := mem.(Pooled); ok && p.FromPool() {
		return "alloc-pool"
	}
	if c, ok := mem.(*ChannelMemory); ok {
		return allocStep(c.Data)
	}
	return "alloc"
}
