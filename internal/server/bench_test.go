package server_test

import (
	"context"
	"testing"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/testdaemon"
)

// BenchmarkOpenClose times an open and close through the daemon, host
// backend, without mapping: the protocol's own cost.
func BenchmarkOpenClose(b *testing.B) {
	d := testdaemon.Start(b, "host")
	ctx := context.Background()
	c, err := gpushm.Dial(ctx, d.Socket)
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	if _, _, err := c.CreateOnly(ctx, "b", 4096, nil); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for range b.N {
		s, err := c.Open(ctx, "b", nil)
		if err != nil {
			b.Fatal(err)
		}
		s.Close()
	}
}
