package cli

import (
	"context"
	"fmt"
	"strconv"
	"strings"

	"github.com/spf13/cobra"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/complete"
	"github.com/gpushm/gpushm/internal/exitcode"
	"github.com/gpushm/gpushm/internal/report"
)

func chmodCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "chmod MODE NAME...",
		Short: "Change segments' permission bits (0640, g+r, u=rw,go=)",
		Long: `Change the permission bits of segments, as chmod(1) does for files: an octal
mode (0640), or symbolic clauses separated by commas, each who (u, g, o, a;
none is a) then one or more of +, - or = with r, w, x or the bits of u, g
or o (g+r, a-w, u=rw,go=, o=g). Unlike chmod(1), a clause without who is
not masked by the umask, and s, t and X are refused: segments have none.
The owner's bits govern the owner, the group's bits members of the
segment's group, the other bits everyone else: r lets a process open the
segment read-only, rw read-write. Only the owner or root may chmod. It
prints nothing, unless -o asks: each segment as it is now.`,
		Example: `  gpushm chmod 0640 weights
  gpushm chmod g+r weights
  gpushm chmod u=rw,go= $(gpushm ls -o name 'private-*')`,
		Args:              cobra.MinimumNArgs(2),
		ValidArgsFunction: complete.NamesAfter(dial, cobra.FixedCompletions(complete.Modes, cobra.ShellCompDirectiveNoFileComp)),
		RunE: func(cmd *cobra.Command, args []string) error {
			change, err := parseModeChange(args[0])
			if err != nil {
				return exitcode.Usagef(cmd, "chmod: mode %q: %v", args[0], err)
			}
			return eachChanged(cmd.Context(), "chmod", args[1:], func(c *gpushm.Client, name string) error {
				var old uint32
				if !change.absolute() {
					s, err := c.Stat(cmd.Context(), name)
					if err != nil {
						return err
					}
					old = s.Mode
				}
				return c.Chmod(cmd.Context(), name, change.apply(old))
			})
		},
	}
	addOutput(cmd, false)
	return cmd
}

// A modeChange is a chmod(1) mode: octal, or symbolic clauses applied in
// turn to the mode a segment has.
type modeChange struct {
	octal   int64 // -1: symbolic
	clauses []modeClause
}

type modeClause struct {
	who uint32 // the bits the clause may touch: 0o700, 0o070, 0o007, or their union
	ops []modeOp
}

type modeOp struct {
	op   byte   // '+', '-' or '='
	perm uint32 // r=4, w=2, x=1
	from uint32 // a class whose bits to copy (shift 6, 3, 0), or noCopy
}

const noCopy = 99

func (m modeChange) absolute() bool { return m.octal >= 0 }

func (m modeChange) apply(mode uint32) uint32 {
	if m.absolute() {
		return uint32(m.octal)
	}
	mode &= 0o777
	for _, c := range m.clauses {
		for _, o := range c.ops {
			perm := o.perm
			if o.from != noCopy {
				perm = mode >> o.from & 7
			}
			bits := perm * 0o111 & c.who
			switch o.op {
			case '+':
				mode |= bits
			case '-':
				mode &^= bits
			case '=':
				mode = mode&^c.who | bits
			}
		}
	}
	return mode
}

// parseModeChange reads an octal mode (at most 0777) or chmod(1)'s symbolic
// clauses ("u=rw,go=", "a-w", "+r").
func parseModeChange(s string) (modeChange, error) {
	if s != "" && s[0] >= '0' && s[0] <= '7' {
		m, err := strconv.ParseUint(s, 8, 32)
		if err != nil || m > 0o777 {
			return modeChange{}, fmt.Errorf("want octal permission bits such as 0640, or symbolic ones such as g+r")
		}
		return modeChange{octal: int64(m)}, nil
	}
	var out modeChange
	out.octal = -1
	parts := strings.Split(s, ",")
	for _, part := range parts {
		c, err := parseClause(part)
		if err != nil {
			if len(parts) > 1 {
				err = fmt.Errorf("%q: %w", part, err)
			}
			return modeChange{}, err
		}
		out.clauses = append(out.clauses, c)
	}
	return out, nil
}

func parseClause(s string) (modeClause, error) {
	var c modeClause
	i := 0
	for ; i < len(s) && strings.IndexByte("ugoa", s[i]) >= 0; i++ {
		c.who |= map[byte]uint32{'u': 0o700, 'g': 0o070, 'o': 0o007, 'a': 0o777}[s[i]]
	}
	if c.who == 0 {
		c.who = 0o777
	}
	if i == len(s) {
		return c, fmt.Errorf("want + - or = after who (u, g, o, a), as in g+r")
	}
	for i < len(s) {
		op := s[i]
		if op != '+' && op != '-' && op != '=' {
			return c, fmt.Errorf("%q where +, - or = goes (a clause is who, then +, - or = and r, w, x)", op)
		}
		i++
		o := modeOp{op: op, from: noCopy}
		if i < len(s) && strings.IndexByte("ugo", s[i]) >= 0 {
			o.from = map[byte]uint32{'u': 6, 'g': 3, 'o': 0}[s[i]]
			i++
		} else {
			for ; i < len(s) && strings.IndexByte("+-=", s[i]) < 0; i++ {
				switch s[i] {
				case 'r':
					o.perm |= 4
				case 'w':
					o.perm |= 2
				case 'x':
					o.perm |= 1
				case 's', 't', 'X':
					return c, fmt.Errorf("segments have no %q bit (only r, w, x)", s[i])
				default:
					return c, fmt.Errorf("%q is not a permission (r, w, x)", s[i])
				}
			}
		}
		c.ops = append(c.ops, o)
	}
	return c, nil
}

// eachChanged runs fn for every name as eachName does, then prints the
// segments changed as -o asks.
func eachChanged(ctx context.Context, verb string, names []string, fn func(c *gpushm.Client, name string) error) error {
	var changed []gpushm.SegmentInfo
	err := eachName(ctx, verb, names, func(c *gpushm.Client, name string) error {
		if err := fn(c, name); err != nil {
			return err
		}
		if output == "" || output == "wide" {
			return nil
		}
		s, err := c.Stat(ctx, name)
		if err != nil {
			return err
		}
		changed = append(changed, *s)
		return nil
	})
	if exitcode.IsNoDaemon(err) {
		return err // nothing was asked of a daemon
	}
	switch output {
	case "json", "yaml":
		if perr := printValue(report.Segments(changed)); err == nil {
			err = perr
		}
	case "name":
		for _, s := range changed {
			printNames(s.Name)
		}
	}
	return err
}
