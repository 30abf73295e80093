package deploy

import (
	"slices"
	"strings"
)

// promKeywords are PromQL words that are never metric names: binary and
// set operators, modifiers, and the aggregation operators (which may be
// followed by "by (...)" rather than by their parenthesis).
var promKeywords = map[string]bool{
	"and": true, "or": true, "unless": true, "bool": true, "offset": true, "atan2": true,
	"by": true, "without": true, "on": true, "ignoring": true, "group_left": true, "group_right": true,
	"sum": true, "min": true, "max": true, "avg": true, "group": true, "stddev": true, "stdvar": true,
	"count": true, "count_values": true, "bottomk": true, "topk": true, "quantile": true,
	"limitk": true, "limit_ratio": true, "inf": true, "nan": true,
}

// labelListKeywords are followed by a parenthesised list of label names.
var labelListKeywords = map[string]bool{
	"by": true, "without": true, "on": true, "ignoring": true, "group_left": true, "group_right": true,
}

// MetricNames returns the metric names a PromQL expression selects, in
// order of first appearance: identifiers that are not functions, keywords,
// label names, label values, durations, numbers or Grafana variables
// ($var, ${var}, $__rate_interval). Grafana's label_values(metric, label)
// and query_result(query) variable functions are understood too.
func MetricNames(expr string) []string {
	expr = unwrapGrafanaFunction(strings.TrimSpace(expr))
	var out []string
	for i := 0; i < len(expr); {
		c := expr[i]
		switch {
		case c == '"' || c == '\'' || c == '`':
			i = skipString(expr, i)
		case c == '{':
			i = skipBalanced(expr, i, '{', '}')
		case c == '[':
			i = skipBalanced(expr, i, '[', ']')
		case c == '$':
			i = skipVariable(expr, i)
		case c >= '0' && c <= '9' || c == '.' && i+1 < len(expr) && expr[i+1] >= '0' && expr[i+1] <= '9':
			i = skipWhile(expr, i, func(c byte) bool { return isNameByte(c, false) || c == '.' })
		case isNameByte(c, true) || c == ':':
			end := skipWhile(expr, i, func(c byte) bool { return isNameByte(c, false) || c == ':' })
			word, next := expr[i:end], skipSpace(expr, end)
			i = end
			switch {
			case labelListKeywords[word] && next < len(expr) && expr[next] == '(':
				i = skipBalanced(expr, next, '(', ')')
			case promKeywords[strings.ToLower(word)]:
			case next < len(expr) && expr[next] == '(':
			default:
				if !slices.Contains(out, word) {
					out = append(out, word)
				}
			}
		default:
			i++
		}
	}
	return out
}

// unwrapGrafanaFunction reduces Grafana's variable functions to the
// PromQL they contain: label_values(m, label) to m, label_values(label)
// and metrics(regex) to nothing, query_result(q) to q.
func unwrapGrafanaFunction(expr string) string {
	inner := func(prefix string) (string, bool) {
		if !strings.HasPrefix(expr, prefix) || !strings.HasSuffix(expr, ")") {
			return "", false
		}
		return expr[len(prefix) : len(expr)-1], true
	}
	if in, ok := inner("label_values("); ok {
		if i := strings.LastIndex(in, ","); i >= 0 {
			return in[:i]
		}
		return ""
	}
	if _, ok := inner("metrics("); ok {
		return ""
	}
	if in, ok := inner("query_result("); ok {
		return in
	}
	return expr
}

// skipString returns the index after the string literal starting at i.
func skipString(s string, i int) int {
	quote := s[i]
	for j := i + 1; j < len(s); j++ {
		switch {
		case s[j] == '\\' && quote != '`':
			j++
		case s[j] == quote:
			return j + 1
		}
	}
	return len(s)
}

// skipBalanced returns the index after the bracket closing the one at i,
// skipping strings inside.
func skipBalanced(s string, i int, open, close byte) int {
	depth := 0
	for j := i; j < len(s); {
		switch s[j] {
		case '"', '\'', '`':
			j = skipString(s, j)
			continue
		case open:
			depth++
		case close:
			depth--
			if depth == 0 {
				return j + 1
			}
		}
		j++
	}
	return len(s)
}

// skipVariable returns the index after the Grafana variable at i.
func skipVariable(s string, i int) int {
	if i+1 < len(s) && s[i+1] == '{' {
		return skipBalanced(s, i+1, '{', '}')
	}
	return skipWhile(s, i+1, func(c byte) bool { return isNameByte(c, false) })
}

// skipWhile returns the first index from i where ok is false.
func skipWhile(s string, i int, ok func(byte) bool) int {
	for i < len(s) && ok(s[i]) {
		i++
	}
	return i
}

// skipSpace returns the first index from i that is not white space.
func skipSpace(s string, i int) int {
	return skipWhile(s, i, func(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' })
}
