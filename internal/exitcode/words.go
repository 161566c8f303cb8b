package exitcode

import (
	"context"
	"errors"
	"strconv"
	"strings"

	"github.com/gpushm/gpushm/internal/wire"
)

// Failed says err in a command's words: "rm a: no such segment" where the
// daemon said `unlink: no such segment: "a"`. The protocol operation
// that starts the daemon's message (and the client's "gpushm: op NAME:")
// is not the command's word, and the name is said once. An error that
// names no segment, such as a dial's, is returned as it is.
func Failed(verb, name string, err error) error {
	if err == nil || IsNoDaemon(err) {
		return err
	}
	var ue *usageError
	if errors.As(err, &ue) {
		return err
	}
	var we *wordsError
	if errors.As(err, &we) {
		return err // said in words already
	}
	return &wordsError{verb: verb, name: name, err: err}
}

type wordsError struct {
	verb, name string
	err        error
}

func (e *wordsError) Unwrap() error { return e.err }

func (e *wordsError) Error() string {
	what := e.verb
	if e.name != "" {
		what += " " + QuoteName(e.name)
	}
	return what + ": " + plain(e.err, e.name)
}

// QuoteName quotes a name only when it would not read as one word.
func QuoteName(name string) string {
	if name == "" || strings.ContainsAny(name, " \t\n\"'\\") || strconv.Quote(name) != `"`+name+`"` {
		return strconv.Quote(name)
	}
	return name
}

// protocolOps are the operations a daemon's or the client's message may
// start with: every one of wire.Operations but hello, a part of dialing
// whose failures are the dial's.
var protocolOps = func() []string {
	var ops []string
	for _, o := range wire.Operations {
		if o.Name != wire.OpHello {
			ops = append(ops, o.Name)
		}
	}
	return ops
}()

// plain is err's message without the protocol's words: the daemon's
// message (the client's wrapping repeats the operation and the name), less
// the operation it starts with and the name it ends with.
func plain(err error, name string) string {
	if errors.Is(err, context.Canceled) {
		return "interrupted"
	}
	msg := err.Error()
	var we *wire.Error
	if errors.As(err, &we) {
		msg = we.Message
	}
	quoted := strconv.Quote(name)
	for trimmed := true; trimmed; {
		trimmed = false
		if rest, ok := strings.CutPrefix(msg, "gpushm: "); ok {
			msg, trimmed = rest, true
		}
		for _, op := range protocolOps {
			for _, p := range []string{op + ": ", op + " " + quoted + ": "} {
				if rest, ok := strings.CutPrefix(msg, p); ok {
					msg, trimmed = rest, true
				}
			}
		}
	}
	return strings.TrimSuffix(msg, ": "+quoted)
}
