package kvcore

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"
)

// refTable decodes data as encoding/json decodes [][]BlockID.
func refTable(data []byte) (BlockTable, error) {
	var p plainTable
	err := json.Unmarshal(data, &p)
	return BlockTable(p), err
}

var tableInputs = []string{
	`null`, `[]`, ` [ ] `, `[[]]`, `[null]`, `[[1,2,3],[7]]`, `[[0,null,5],null,[]]`,
	"[\n [ 1 , 2 ] ,\t[3]\r]", `[[-1]]`, `[[-0]]`, `[[9223372036854775807]]`, `[[-9223372036854775808]]`,
	`[[9223372036854775808]]`, `[[-9223372036854775809]]`, `[[99999999999999999999]]`, `[[1.5]]`, `[[1e3]]`,
	`[[1E3]]`, `[["1"]]`, `[[01]]`, `[1]`, `[[1],]`, `[[1,]]`, `[[1]`, `[[1]]x`, `{}`, `[[true]]`, `[[nul]]`,
	`[[-]]`, `[[--1]]`, `["x"]`, `[[1],[2],[3],[4]]`,
}

func TestBlockTableDecodesAsEncodingJSON(t *testing.T) {
	for _, in := range tableInputs {
		want, werr := refTable([]byte(in))
		var got BlockTable
		gerr := json.Unmarshal([]byte(in), &got)
		if (werr == nil) != (gerr == nil) {
			t.Errorf("%s: error %v, encoding/json %v", in, gerr, werr)
			continue
		}
		if werr == nil && !reflect.DeepEqual(got, want) {
			t.Errorf("%s: %#v, encoding/json %#v", in, got, want)
		}
		// As a field, where a record carries it.
		var s struct {
			T BlockTable `json:"t"`
		}
		var r struct {
			T plainTable `json:"t"`
		}
		serr, rerr := json.Unmarshal([]byte(`{"t":`+in+`}`), &s), json.Unmarshal([]byte(`{"t":`+in+`}`), &r)
		if (serr == nil) != (rerr == nil) || (rerr == nil && !reflect.DeepEqual(s.T, BlockTable(r.T))) {
			t.Errorf("field %s: %#v %v, encoding/json %#v %v", in, s.T, serr, r.T, rerr)
		}
	}
}

func TestBlockTableEncodesAsEncodingJSON(t *testing.T) {
	tables := []BlockTable{nil, {}, {nil}, {{}}, {{1, 2, NullBlock}, {7}}, {{-5, 0, 1 << 40}}}
	for _, tb := range tables {
		got, err := json.Marshal(tb)
		if err != nil {
			t.Fatal(err)
		}
		// The reference: every element through BlockID.MarshalJSON.
		ref := make([][]BlockID, len(tb))
		copy(ref, tb)
		if tb == nil {
			ref = nil
		}
		want, _ := json.Marshal(ref)
		if string(got) != string(want) {
			t.Errorf("%#v: %s, want %s", tb, got, want)
		}
		var back BlockTable
		if err := json.Unmarshal(got, &back); err != nil || !reflect.DeepEqual(back, tb) {
			t.Errorf("%s decodes to %#v (%v), want %#v", got, back, err, tb)
		}
	}
}

func FuzzBlockTableJSON(f *testing.F) {
	for _, in := range tableInputs {
		f.Add(in)
	}
	f.Fuzz(func(t *testing.T, in string) {
		want, werr := refTable([]byte(in))
		var got BlockTable
		gerr := json.Unmarshal([]byte(in), &got)
		if (werr == nil) != (gerr == nil) || (werr == nil && !reflect.DeepEqual(got, want)) {
			t.Fatalf("%q: %#v %v, encoding/json %#v %v", in, got, gerr, want, werr)
		}
	})
}

func TestIsHashHex(t *testing.T) {
	for _, c := range []struct {
		s    string
		want bool
	}{
		{"", false}, {"a", false}, {"ab", true}, {"0123456789abcdef", true}, {strings.Repeat("ab", 32), true},
		{strings.Repeat("ab", 31) + "aG", false}, {strings.Repeat("ab", 31) + "Ab", false}, {"g0", false},
		{"0/", false}, {"0:", false}, {"`a", false}, {"a\x00", false}, {strings.Repeat("f", 63) + "\xff", false},
	} {
		if got := IsHashHex(c.s); got != c.want {
			t.Errorf("IsHashHex(%q) = %v, want %v", c.s, got, c.want)
		}
	}
}
