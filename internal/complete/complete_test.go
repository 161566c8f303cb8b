package complete

import (
	"context"
	"errors"
	"slices"
	"testing"

	"github.com/spf13/cobra"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/testdaemon"
)

// TestNames: segment names come from the daemon, less those given, at
// the positions asked for; with no daemon there are none, and no error.
func TestNames(t *testing.T) {
	d := testdaemon.Start(t, "host")
	dial := func(ctx context.Context) (*gpushm.Client, error) { return gpushm.Dial(ctx, d.Socket) }
	ctx := context.Background()
	c, err := dial(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for _, name := range []string{"alpha", "alps", "beta"} {
		if _, _, err := c.CreateOnly(ctx, name, 4096, nil); err != nil {
			t.Fatal(err)
		}
	}
	cmd := &cobra.Command{}
	cmd.SetContext(ctx)
	for _, tc := range []struct {
		fn     cobra.CompletionFunc
		args   []string
		prefix string
		want   []cobra.Completion
		dir    cobra.ShellCompDirective
	}{
		{Names(dial), nil, "al", []cobra.Completion{"alpha\t4 KiB, host memory", "alps\t4 KiB, host memory"}, cobra.ShellCompDirectiveNoFileComp},
		{Names(dial), []string{"alpha"}, "al", []cobra.Completion{"alps\t4 KiB, host memory"}, cobra.ShellCompDirectiveNoFileComp},
		{Names(dial, 0), []string{"alpha"}, "", nil, cobra.ShellCompDirectiveNoFileComp},
		{NamesAfter(dial, nil), nil, "", nil, cobra.ShellCompDirectiveNoFileComp},
		{NamesAfter(dial, nil), []string{"0640"}, "b", []cobra.Completion{"beta\t4 KiB, host memory"}, cobra.ShellCompDirectiveNoFileComp},
		{NamesThenFiles(dial, func(*cobra.Command) bool { return false }), nil, "", nil, cobra.ShellCompDirectiveNoFileComp},
		{NamesThenFiles(dial, func(*cobra.Command) bool { return true }), []string{"beta"}, "", nil, cobra.ShellCompDirectiveDefault},
	} {
		got, dir := tc.fn(cmd, tc.args, tc.prefix)
		if !slices.Equal(got, tc.want) || dir != tc.dir {
			t.Errorf("completing %q after %q: %q, %v; want %q, %v", tc.prefix, tc.args, got, dir, tc.want, tc.dir)
		}
	}
	none := func(context.Context) (*gpushm.Client, error) { return nil, errors.New("no daemon") }
	if got, dir := Names(none)(cmd, nil, ""); got != nil || dir != cobra.ShellCompDirectiveNoFileComp {
		t.Errorf("completing with no daemon: %q, %v; want nothing", got, dir)
	}
}
