// Package owner names a segment's owner and group as this machine names
// its users and groups, and reads the [OWNER][:GROUP] that chown takes,
// by name or number.
package owner

import (
	"fmt"
	"os/user"
	"strconv"
	"strings"
)

// User is uid's name on this machine, or the number.
func User(uid uint32) string {
	id := strconv.FormatUint(uint64(uid), 10)
	if u, err := user.LookupId(id); err == nil {
		return u.Username
	}
	return id
}

// Group is gid's name, or the number.
func Group(gid uint32) string {
	id := strconv.FormatUint(uint64(gid), 10)
	if g, err := user.LookupGroupId(id); err == nil {
		return g.Name
	}
	return id
}

// Format is "owner:group", by name where this machine has one.
func Format(uid, gid uint32) string { return User(uid) + ":" + Group(gid) }

// Parse reads OWNER, OWNER:GROUP or :GROUP; -1 is "leave as it is".
func Parse(s string) (uid, gid int64, err error) {
	u, g, _ := strings.Cut(s, ":")
	if uid, err = lookupID(u, "owner", func(n string) (string, error) {
		pw, err := user.Lookup(n)
		if err != nil {
			return "", err
		}
		return pw.Uid, nil
	}); err != nil {
		return 0, 0, err
	}
	if gid, err = lookupID(g, "group", func(n string) (string, error) {
		gr, err := user.LookupGroup(n)
		if err != nil {
			return "", err
		}
		return gr.Gid, nil
	}); err != nil {
		return 0, 0, err
	}
	if uid < 0 && gid < 0 {
		return 0, 0, fmt.Errorf("%q names neither an owner nor a group", s)
	}
	return uid, gid, nil
}

// lookupID reads a number, or a name through byName; "" is -1.
func lookupID(s, what string, byName func(string) (string, error)) (int64, error) {
	if s == "" {
		return -1, nil
	}
	if n, err := strconv.ParseUint(s, 10, 32); err == nil {
		return int64(n), nil
	}
	id, err := byName(s)
	if err == nil {
		var n int64
		if n, err = strconv.ParseInt(id, 10, 64); err == nil {
			return n, nil
		}
	}
	return 0, fmt.Errorf("%s %q: %w", what, s, err)
}
