// Package bytesize reads and prints sizes as people write them: 64M,
// 2GiB, 1.5T.
package bytesize

import (
	"fmt"
	"math"
	"strconv"
	"strings"
)

// Parse reads sizes as coreutils does: a plain number is bytes; K, M, G,
// T (optionally followed by iB) are powers of 1024; KB, MB, GB, TB powers of
// 1000.
func Parse(s string) (int64, error) {
	t := strings.TrimSpace(s)
	i := 0
	for i < len(t) && (t[i] >= '0' && t[i] <= '9' || t[i] == '.') {
		i++
	}
	num, unit := t[:i], strings.ToUpper(strings.TrimSpace(t[i:]))
	if num == "" {
		return 0, fmt.Errorf("invalid size %q (want a number with an optional unit: 4096, 64MiB, 1G)", s)
	}
	mult := float64(1)
	switch unit {
	case "", "B":
	case "K", "KI", "KIB":
		mult = 1 << 10
	case "M", "MI", "MIB":
		mult = 1 << 20
	case "G", "GI", "GIB":
		mult = 1 << 30
	case "T", "TI", "TIB":
		mult = 1 << 40
	case "KB":
		mult = 1e3
	case "MB":
		mult = 1e6
	case "GB":
		mult = 1e9
	case "TB":
		mult = 1e12
	default:
		return 0, fmt.Errorf("invalid size %q: unknown unit %q (use K, M, G, T, KiB, MiB, GiB, TiB, KB, MB, GB, TB)", s, t[i:])
	}
	if !strings.Contains(num, ".") {
		n, err := strconv.ParseInt(num, 10, 64)
		if err != nil {
			return 0, fmt.Errorf("invalid size %q: %w", s, err)
		}
		if n > math.MaxInt64/int64(mult) {
			return 0, fmt.Errorf("invalid size %q: too large", s)
		}
		return n * int64(mult), nil
	}
	f, err := strconv.ParseFloat(num, 64)
	if err != nil {
		return 0, fmt.Errorf("invalid size %q: %w", s, err)
	}
	v := f * mult
	if v >= math.MaxInt64 {
		return 0, fmt.Errorf("invalid size %q: too large", s)
	}
	return int64(math.Ceil(v)), nil
}

// ParseList reads a comma-separated list of sizes.
func ParseList(list string) ([]int64, error) {
	var out []int64
	for _, s := range strings.Split(list, ",") {
		n, err := Parse(s)
		if err != nil {
			return nil, err
		}
		out = append(out, n)
	}
	return out, nil
}

// Format prints bytes in binary units, exactly when it can.
func Format(n int64) string {
	units := []string{"B", "KiB", "MiB", "GiB", "TiB", "PiB"}
	v, i := float64(n), 0
	for v >= 1024 && i < len(units)-1 {
		v /= 1024
		i++
	}
	if i == 0 {
		return fmt.Sprintf("%d B", n)
	}
	if v == math.Trunc(v) {
		return fmt.Sprintf("%.0f %s", v, units[i])
	}
	return fmt.Sprintf("%.1f %s", v, units[i])
}
