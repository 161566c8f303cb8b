package server

import (
	"testing"

	"github.com/gpushm/gpushm/internal/wire"
)

// TestHandlersAreOperations holds the dispatch to wire.Operations: a
// handler for every operation of the protocol, and none for anything
// else.
func TestHandlersAreOperations(t *testing.T) {
	for _, o := range wire.Operations {
		if handlers[o.Name] == nil {
			t.Errorf("wire.Operations has %q, the server no handler for it", o.Name)
		}
	}
	for name := range handlers {
		if !wire.Known(name) {
			t.Errorf("the server has a handler for %q, which is not in wire.Operations", name)
		}
	}
}
