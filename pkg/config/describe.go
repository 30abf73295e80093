package config

import (
	"encoding"
	"fmt"
	"log/slog"
	"net/url"
	"reflect"
	"regexp"
	"strconv"
	"strings"
	"time"
)

// Masked replaces secret values and URL passwords in Describe's output.
const Masked = "***"

// Field describes one setting of a configuration struct.
type Field struct {
	// Env is the environment variable name.
	Env string
	// Value is the current value as text. Secret values are Masked (an
	// unset secret stays empty, so a missing secret is visible) and
	// passwords inside URLs or key=value connection strings are masked.
	Value string
	// Default is the default the struct's SetDefaults states (empty for
	// a zero value: no default), masked like Value.
	Default string
	// Doc is the description from the doc tag.
	Doc string
	// Type names the value's form: string, bool, int, uint, float,
	// duration, list or text.
	Type string
	// Secret reports whether the field is tagged secret.
	Secret bool
	// Required reports whether the field is tagged required.
	Required bool
}

// Describe lists the settings of v, a configuration struct or a pointer to
// one, in declaration order with nested structs flattened. It returns nil
// when v is not a struct.
func Describe(v any) []Field {
	rv := reflect.ValueOf(v)
	for rv.Kind() == reflect.Pointer && !rv.IsNil() {
		rv = rv.Elem()
	}
	if rv.Kind() != reflect.Struct {
		return nil
	}
	var fields []Field
	walkDefaults(rv, defaultsOf(rv.Type()), func(sf reflect.StructField, fv, dv reflect.Value) {
		secret := isTrue(sf.Tag.Get("secret"))
		def := ""
		if hasDefault(dv) {
			def = formatValue(dv)
		}
		fields = append(fields, Field{
			Env:      sf.Tag.Get("env"),
			Value:    mask(formatValue(fv), secret),
			Default:  mask(def, secret),
			Doc:      sf.Tag.Get("doc"),
			Type:     typeName(fv.Type()),
			Secret:   secret,
			Required: isTrue(sf.Tag.Get("required")),
		})
	})
	return fields
}

// LogValue returns the settings of v as a slog group of variable = masked
// value, for logging the resolved configuration at start-up.
func LogValue(v any) slog.Value {
	fields := Describe(v)
	attrs := make([]slog.Attr, 0, len(fields))
	for _, f := range fields {
		attrs = append(attrs, slog.String(f.Env, f.Value))
	}
	return slog.GroupValue(attrs...)
}

// MarkdownTable renders the settings of v as a Markdown table (variable,
// type, default, description) for docs/configuration.md.
func MarkdownTable(v any) string {
	var b strings.Builder
	b.WriteString("| Variable | Type | Default | Description |\n")
	b.WriteString("|---|---|---|---|\n")
	for _, f := range Describe(v) {
		def := ""
		if f.Default != "" {
			def = "`" + f.Default + "`"
		}
		desc := f.Doc
		if f.Required {
			desc = sentence(desc, "Required.")
		}
		if f.Secret {
			desc = sentence(desc, "Secret: never logged.")
		}
		fmt.Fprintf(&b, "| `%s` | %s | %s | %s |\n", f.Env, f.Type, escapeCell(def), escapeCell(desc))
	}
	return b.String()
}

// sentence appends note to desc as a new sentence.
func sentence(desc, note string) string {
	desc = strings.TrimSpace(desc)
	if desc != "" && !strings.HasSuffix(desc, ".") {
		desc += "."
	}
	return strings.TrimSpace(desc + " " + note)
}

func escapeCell(s string) string {
	return strings.ReplaceAll(s, "|", `\|`)
}

// formatValue renders a field's current value as the text Load would accept.
func formatValue(fv reflect.Value) string {
	if fv.Type().Implements(textMarshalerType) {
		m, _ := fv.Interface().(encoding.TextMarshaler)
		if b, err := m.MarshalText(); err == nil {
			return string(b)
		}
	}
	if fv.Type() == durationType {
		return formatDuration(time.Duration(fv.Int()))
	}
	switch fv.Kind() {
	case reflect.String:
		return fv.String()
	case reflect.Bool:
		return strconv.FormatBool(fv.Bool())
	case reflect.Slice:
		if fv.Type().Elem().Kind() == reflect.String {
			items := make([]string, fv.Len())
			for i := range items {
				items[i] = fv.Index(i).String()
			}
			return strings.Join(items, ",")
		}
	}
	return fmt.Sprint(fv.Interface())
}

// formatDuration is d as time.Duration.String writes it, without zero
// trailing units: 1h rather than 1h0m0s, 2m rather than 2m0s (as an
// operator writes it; time.ParseDuration reads both).
func formatDuration(d time.Duration) string {
	s := d.String()
	if strings.HasSuffix(s, "m0s") {
		s = strings.TrimSuffix(s, "0s")
	}
	if strings.HasSuffix(s, "h0m") {
		s = strings.TrimSuffix(s, "0m")
	}
	return s
}

// typeName names the form of a field's value for documentation.
func typeName(t reflect.Type) string {
	switch {
	case t == durationType:
		return "duration"
	case reflect.PointerTo(t).Implements(textUnmarshalerType):
		return "text"
	}
	switch t.Kind() {
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		return "int"
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return "uint"
	case reflect.Float32, reflect.Float64:
		return "float"
	case reflect.Slice:
		return "list"
	}
	return t.Kind().String()
}

// mask hides a secret value entirely and passwords inside any value.
func mask(s string, secret bool) string {
	if s == "" {
		return ""
	}
	if secret {
		return Masked
	}
	return MaskPasswords(s)
}

// kvPassword matches password=... in key=value connection strings and in
// URL query strings.
var kvPassword = regexp.MustCompile(`(?i)(\bpassword\s*=\s*)('[^']*'|[^\s&,]+)`)

// urlUserinfo matches the user:password@ part of a URL that url.Parse
// rejected, so an unparsable URL still has its password masked.
var urlUserinfo = regexp.MustCompile(`(://[^/:@\s]*:)[^\s]*@`)

// MaskPasswords masks the password of every URL in a comma-separated value
// (postgres://u:pw@h/db becomes postgres://u:***@h/db) and every
// password=... item of a key=value connection string or query.
func MaskPasswords(s string) string {
	items := strings.Split(s, ",")
	for i, item := range items {
		items[i] = maskURLPassword(item)
	}
	return kvPassword.ReplaceAllString(strings.Join(items, ","), "${1}"+Masked)
}

func maskURLPassword(s string) string {
	if !strings.Contains(s, "://") {
		return s
	}
	u, err := url.Parse(strings.TrimSpace(s))
	if err != nil {
		return urlUserinfo.ReplaceAllString(s, "${1}"+Masked+"@")
	}
	if u.User == nil {
		return s
	}
	if _, has := u.User.Password(); !has {
		return s
	}
	// Redacted writes the password as "xxxxx"; the username is escaped, so
	// ":xxxxx@" can only be the password.
	return strings.Replace(u.Redacted(), ":xxxxx@", ":"+Masked+"@", 1)
}
