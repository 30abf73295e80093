package kvcore

import (
	"encoding/json"
	"strconv"
)

// The JSON of a block table is most of a step record's and a task's bytes,
// and encoding/json handles it one element at a time through BlockID's
// (Un)MarshalJSON: reflection and an interface call per block id, and on
// encoding a validation and compaction of each element's output. A table
// encodes and decodes here in one pass instead; the wire format is the
// same ([[0,1,null],[7]]: integers, null for NullBlock, null for a nil
// group or table).

// plainTable is BlockTable without its JSON methods: the reference
// behaviour, which the fast paths fall back to.
type plainTable [][]BlockID

// MarshalJSON writes the table as encoding/json writes [][]BlockID.
func (t BlockTable) MarshalJSON() ([]byte, error) {
	return t.AppendJSON(nil), nil
}

// AppendJSON appends the table's JSON to buf.
func (t BlockTable) AppendJSON(buf []byte) []byte {
	if t == nil {
		return append(buf, "null"...)
	}
	buf = append(buf, '[')
	for i, g := range t {
		if i > 0 {
			buf = append(buf, ',')
		}
		if g == nil {
			buf = append(buf, "null"...)
			continue
		}
		buf = append(buf, '[')
		for j, b := range g {
			if j > 0 {
				buf = append(buf, ',')
			}
			if b == NullBlock {
				buf = append(buf, "null"...)
			} else {
				buf = strconv.AppendInt(buf, int64(b), 10)
			}
		}
		buf = append(buf, ']')
	}
	return append(buf, ']')
}

// UnmarshalJSON reads a table of integers and nulls in one pass; anything
// else (whitespace is fine) goes through encoding/json as [][]BlockID
// would, errors included.
func (t *BlockTable) UnmarshalJSON(data []byte) error {
	if out, ok := parseTable(data); ok {
		*t = out
		return nil
	}
	var p plainTable
	if err := json.Unmarshal(data, &p); err != nil {
		return err
	}
	*t = BlockTable(p)
	return nil
}

// parseTable parses data as a block table of integers and nulls; ok is
// false for anything else (strings, fractions, exponents, overflow, a
// syntax error), which the caller hands to encoding/json.
func parseTable(data []byte) (BlockTable, bool) {
	p := tableParser{data: data}
	p.space()
	if p.literal("null") {
		p.space()
		return nil, p.i == len(p.data)
	}
	if !p.byte('[') {
		return nil, false
	}
	out := BlockTable{}
	p.space()
	if p.byte(']') {
		p.space()
		return out, p.i == len(p.data)
	}
	for {
		p.space()
		g, ok := p.group()
		if !ok {
			return nil, false
		}
		out = append(out, g)
		p.space()
		if p.byte(',') {
			continue
		}
		if !p.byte(']') {
			return nil, false
		}
		p.space()
		return out, p.i == len(p.data)
	}
}

type tableParser struct {
	data []byte
	i    int
}

func (p *tableParser) space() {
	for p.i < len(p.data) {
		switch p.data[p.i] {
		case ' ', '\t', '\n', '\r':
			p.i++
		default:
			return
		}
	}
}

func (p *tableParser) byte(c byte) bool {
	if p.i < len(p.data) && p.data[p.i] == c {
		p.i++
		return true
	}
	return false
}

func (p *tableParser) literal(s string) bool {
	if len(p.data)-p.i >= len(s) && string(p.data[p.i:p.i+len(s)]) == s {
		p.i += len(s)
		return true
	}
	return false
}

// group parses one group: null, or an array of integers and nulls.
func (p *tableParser) group() ([]BlockID, bool) {
	if p.literal("null") {
		return nil, true
	}
	if !p.byte('[') {
		return nil, false
	}
	p.space()
	if p.byte(']') {
		return []BlockID{}, true
	}
	// Most groups are short; a comma count sizes the rest.
	out := make([]BlockID, 0, p.estimate())
	for {
		p.space()
		b, ok := p.id()
		if !ok {
			return nil, false
		}
		out = append(out, b)
		p.space()
		if p.byte(',') {
			continue
		}
		return out, p.byte(']')
	}
}

// estimate counts the elements up to the group's closing bracket.
func (p *tableParser) estimate() int {
	n := 1
	for j := p.i; j < len(p.data); j++ {
		switch p.data[j] {
		case ',':
			n++
		case ']':
			return n
		}
	}
	return n
}

// id parses null or a JSON integer that fits in an int64.
func (p *tableParser) id() (BlockID, bool) {
	if p.literal("null") {
		return NullBlock, true
	}
	neg := p.byte('-')
	digits := p.i
	var v uint64
	for p.i < len(p.data) {
		c := p.data[p.i]
		if c < '0' || c > '9' {
			break
		}
		if v > (1<<63)/10 {
			return 0, false
		}
		v = v*10 + uint64(c-'0')
		p.i++
	}
	n := p.i - digits
	switch {
	case n == 0, n > 1 && p.data[digits] == '0': // no digits; a leading zero is not JSON
		return 0, false
	case p.i < len(p.data) && (p.data[p.i] == '.' || p.data[p.i] == 'e' || p.data[p.i] == 'E'):
		return 0, false // a fraction or exponent: encoding/json's verdict
	case !neg && v > 1<<63-1, neg && v > 1<<63:
		return 0, false
	}
	if neg {
		return BlockID(-int64(v)), true // -1<<63 too: int64(1<<63) is its own negation
	}
	return BlockID(v), true
}
