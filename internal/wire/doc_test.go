package wire

import (
	"maps"
	"os"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// TestProtocolDocRequests holds docs/protocol.md's request table to the
// decoder, which refuses what the table does not allow: the op row lists
// Operations in its order, each has a section, every field of Request
// has a row, and each row's "used by" names exactly the operations that
// take the field (their fields in Operations). A field or operation
// added without its row, or a row left behind, fails here, not in a
// third-party client.
func TestProtocolDocRequests(t *testing.T) {
	doc, err := os.ReadFile("../../docs/protocol.md")
	if err != nil {
		t.Fatal(err)
	}
	ops, rows := requestTable(t, string(doc))
	if want := operationNames(); !slices.Equal(ops, want) {
		t.Errorf("the op row lists %v, wire.Operations %v (in this order)", ops, want)
	}
	// Each operation has a section under "## Operations", whose title
	// names it ("### fill and dump").
	_, opsPart, _ := strings.Cut(string(doc), "\n## Operations\n")
	opsPart, _, _ = strings.Cut(opsPart, "\n## ")
	titled := map[string]bool{}
	for _, m := range regexp.MustCompile(`(?m)^### (.*)$`).FindAllStringSubmatch(opsPart, -1) {
		for _, w := range strings.FieldsFunc(m[1], func(r rune) bool { return r == ' ' || r == ',' }) {
			titled[w] = true
		}
	}
	for _, op := range operationNames() {
		if !titled[op] {
			t.Errorf("docs/protocol.md has no section (### under \"## Operations\") for %s", op)
		}
	}
	var tags []string
	rt := reflect.TypeFor[Request]()
	for i := range rt.NumField() {
		if tag, _, _ := strings.Cut(rt.Field(i).Tag.Get("json"), ","); tag != "" && tag != "-" {
			tags = append(tags, tag)
		}
	}
	slices.Sort(tags)
	if got := slices.Sorted(maps.Keys(rows)); !slices.Equal(got, tags) {
		t.Errorf("the table has rows for %v, Request has the fields %v", got, tags)
	}
	for i, name := range fieldNames {
		var want []string
		for op, fields := range usedFields() {
			if fields&(1<<i) != 0 {
				want = append(want, op)
			}
		}
		slices.Sort(want)
		if got := rows[name]; !slices.Equal(got, want) {
			t.Errorf("`%s` is used by %v in the table, by %v in the decoder", name, got, want)
		}
	}
}

// requestTable reads the table under "## Requests": the operations of its
// op row, in its order, and for each other field the operations of its "used
// by" column ("all" and "any" stand for every operation), sorted, merged
// over the rows that name the field.
func requestTable(t *testing.T, doc string) (ops []string, rows map[string][]string) {
	t.Helper()
	_, table, ok := strings.Cut(doc, "\n## Requests\n")
	if !ok {
		t.Fatal(`docs/protocol.md has no "## Requests"`)
	}
	table, _, _ = strings.Cut(table, "\n## ")
	code := regexp.MustCompile("`([a-z_]+)`")
	all := slices.Sorted(maps.Keys(usedFields()))
	rows = map[string][]string{}
	for line := range strings.Lines(table) {
		cells := strings.Split(line, "|")
		if !strings.HasPrefix(line, "| `") || len(cells) != 6 {
			continue
		}
		var names []string
		for _, m := range code.FindAllStringSubmatch(cells[1], -1) {
			names = append(names, m[1])
		}
		if slices.Equal(names, []string{"op"}) {
			for _, m := range code.FindAllStringSubmatch(cells[4], -1) {
				ops = append(ops, m[1])
			}
		}
		var by []string
		for _, item := range strings.Split(cells[3], ",") {
			word, _, _ := strings.Cut(strings.TrimSpace(item), " ")
			switch word = strings.Trim(word, "`"); word {
			case "all", "any":
				by = append(by, all...)
			case "":
				t.Errorf("row %q: an empty \"used by\" item", strings.TrimSpace(line))
			default:
				by = append(by, word)
			}
		}
		for _, name := range names {
			rows[name] = append(rows[name], by...)
		}
	}
	for name, by := range rows {
		slices.Sort(by)
		rows[name] = slices.Compact(by)
	}
	// id and op are every request's, outside the decoder's field set.
	for _, name := range []string{"id", "op"} {
		if !slices.Equal(rows[name], all) {
			t.Errorf("`%s` is used by %v in the table, want all", name, rows[name])
		}
	}
	return ops, rows
}

// operationNames are the names of Operations, in its order.
func operationNames() []string {
	var names []string
	for _, o := range Operations {
		names = append(names, o.Name)
	}
	return names
}

// usedFields is the fields each operation reads, from Operations.
func usedFields() map[string]uint64 {
	m := map[string]uint64{}
	for _, o := range Operations {
		m[o.Name] = o.fields
	}
	return m
}
