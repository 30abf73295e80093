// Package config loads a service's settings from environment variables into
// one struct, driven by struct tags, and describes the resolved settings for
// logs and documentation.
//
// A service declares its settings once, with their defaults beside them:
//
//	type Config struct {
//		HTTPAddr        string        `env:"KVMESH_HTTP_ADDR" doc:"listen address"`
//		DatabaseURL     string        `env:"KVMESH_DATABASE_URL" secret:"true" required:"true" doc:"PostgreSQL URL"`
//		Brokers         []string      `env:"KVMESH_KAFKA_BROKERS" doc:"Kafka bootstrap brokers"`
//		ShutdownTimeout time.Duration `env:"KVMESH_SHUTDOWN_TIMEOUT" doc:"graceful shutdown limit"`
//	}
//
//	// SetDefaults sets the defaults (config.Defaulter).
//	func (c *Config) SetDefaults() {
//		c.HTTPAddr = ":8082"
//		c.Brokers = []string{"127.0.0.1:9092"}
//		c.ShutdownTimeout = httpserver.DefaultShutdownTimeout
//	}
//
// and main calls Load(&cfg, os.LookupEnv). The tags are:
//
//   - env: the variable name. Fields without it are skipped, except struct
//     fields, whose own fields are loaded as if declared in the parent
//     (nested structs are flattened, so settings several programs share
//     are declared once, in a struct each program's Config embeds).
//   - doc: a one-line description for Describe and MarkdownTable.
//   - secret:"true": the value is never shown; Describe masks it as "***".
//     A secret may also be given in a file: NAME_FILE names a file whose
//     content (trailing newlines trimmed) is the value, as container
//     secrets are mounted. Setting both NAME and NAME_FILE is an error.
//   - required:"true": Load fails when neither the variable nor a default
//     gives a value.
//
// Defaults are typed Go values set by the struct's SetDefaults method
// (Defaulter), never tags: a variable that is unset takes its field's
// value in a freshly defaulted struct, unless that is the zero value (no
// default).
//
// Supported field types are string, bool, every signed and unsigned integer
// kind, float32/float64, time.Duration, []string (comma-separated, blanks
// trimmed, empty items dropped) and any type whose pointer implements
// encoding.TextUnmarshaler. A variable that is set but empty counts as unset.
package config

import (
	"encoding"
	"errors"
	"fmt"
	"os"
	"reflect"
	"strconv"
	"strings"
	"time"
)

// Errors returned by Load, wrapped with the variable name and value.
var (
	// ErrNotStructPointer means Load was given something other than a
	// non-nil pointer to a struct.
	ErrNotStructPointer = errors.New("config: destination must be a non-nil pointer to a struct")
	// ErrInvalidValue means a variable or default could not be parsed into
	// its field's type.
	ErrInvalidValue = errors.New("config: invalid value")
	// ErrMissing means a required variable had no value and no default.
	ErrMissing = errors.New("config: missing required variable")
	// ErrUnsupportedType means a tagged field has a type Load cannot set.
	ErrUnsupportedType = errors.New("config: unsupported field type")
	// ErrSecretFile means a secret's NAME_FILE could not be read, or was set
	// next to NAME.
	ErrSecretFile = errors.New("config: secret file")
	// ErrRenamed means a variable that was renamed is still set: a
	// service's Validate refuses it, naming the new variable, rather than
	// ignore what the operator meant.
	ErrRenamed = errors.New("config: the variable was renamed")
)

// FileSuffix is appended to a secret setting's variable name to name the
// variable that holds the path of a file with its value.
const FileSuffix = "_FILE"

// Validator is implemented by configuration structs that check their own
// consistency. Load calls Validate after every field has been set.
type Validator interface {
	// Validate reports whether the loaded configuration is usable.
	Validate() error
}

var (
	durationType        = reflect.TypeFor[time.Duration]()
	textUnmarshalerType = reflect.TypeFor[encoding.TextUnmarshaler]()
	textMarshalerType   = reflect.TypeFor[encoding.TextMarshaler]()
)

// Load fills the struct that dst points to from the variables that lookup
// returns (os.LookupEnv in a main, a map in tests), applying the defaults its
// SetDefaults states (Defaulter). Every bad or missing variable is reported,
// joined into one error that names each variable and its bad value (secret
// values are not shown). When the struct implements Validator, Validate runs
// after a successful load.
func Load(dst any, lookup func(string) (string, bool)) error {
	rv := reflect.ValueOf(dst)
	if rv.Kind() != reflect.Pointer || rv.IsNil() || rv.Elem().Kind() != reflect.Struct {
		return ErrNotStructPointer
	}
	var errs []error
	walkDefaults(rv.Elem(), defaultsOf(rv.Elem().Type()), func(sf reflect.StructField, fv, dv reflect.Value) {
		if err := loadField(sf, fv, dv, lookup, true); err != nil {
			errs = append(errs, err)
		}
	})
	if err := errors.Join(errs...); err != nil {
		return err
	}
	if v, ok := dst.(Validator); ok {
		if err := v.Validate(); err != nil {
			return fmt.Errorf("config: validate: %w", err)
		}
	}
	return nil
}

// Overlay sets, in the struct that dst points to, only the settings whose
// variable lookup gives (a secret's NAME_FILE included), keeping every
// other field as it is: no defaults, no required settings and no Validate.
// It is for a command whose flags fall back to the services' variables,
// read through the same structs the services embed.
func Overlay(dst any, lookup func(string) (string, bool)) error {
	rv := reflect.ValueOf(dst)
	if rv.Kind() != reflect.Pointer || rv.IsNil() || rv.Elem().Kind() != reflect.Struct {
		return ErrNotStructPointer
	}
	var errs []error
	none := reflect.New(rv.Elem().Type()).Elem()
	walkDefaults(rv.Elem(), none, func(sf reflect.StructField, fv, dv reflect.Value) {
		if err := loadField(sf, fv, dv, lookup, false); err != nil {
			errs = append(errs, err)
		}
	})
	return errors.Join(errs...)
}

// loadField sets one field from its variable or its default dv (none when
// zero); an unset required setting without a default is an error when
// required is set.
func loadField(sf reflect.StructField, fv, dv reflect.Value, lookup func(string) (string, bool), required bool) error {
	name := sf.Tag.Get("env")
	raw, ok := lookup(name)
	source := name
	if isTrue(sf.Tag.Get("secret")) {
		fromFile, found, err := secretFile(name, raw, ok, lookup)
		if err != nil {
			return err
		}
		if found {
			raw, ok, source = fromFile, true, name+FileSuffix
		}
	}
	if !ok || raw == "" {
		if hasDefault(dv) {
			setDefault(fv, dv)
			return nil
		}
		if required && isTrue(sf.Tag.Get("required")) {
			return fmt.Errorf("%w: %s is not set%s", ErrMissing, name, docSuffix(sf))
		}
		return nil
	}
	if err := setValue(fv, raw); err != nil {
		shown := strconv.Quote(raw)
		if isTrue(sf.Tag.Get("secret")) {
			shown = "(secret, not shown)"
		}
		return fmt.Errorf("%s=%s: %w", source, shown, err)
	}
	return nil
}

// secretFile reads a secret's value from the file NAME_FILE names, when
// it is set: found reports that it was. Setting both NAME (set is ok with
// a non-empty raw) and NAME_FILE is refused, as is an unreadable file.
func secretFile(name, raw string, set bool, lookup func(string) (string, bool)) (value string, found bool, err error) {
	path, ok := lookup(name + FileSuffix)
	if !ok || path == "" {
		return "", false, nil
	}
	if set && raw != "" {
		return "", false, fmt.Errorf("%w: %s and %s%s are both set; set one", ErrSecretFile, name, name, FileSuffix)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return "", false, fmt.Errorf("%w: %s%s: %w", ErrSecretFile, name, FileSuffix, err)
	}
	return strings.TrimRight(string(b), "\r\n"), true, nil
}

func docSuffix(sf reflect.StructField) string {
	if doc := sf.Tag.Get("doc"); doc != "" {
		return " (" + doc + ")"
	}
	return ""
}

func isTrue(s string) bool {
	b, err := strconv.ParseBool(s)
	return err == nil && b
}

// setValue parses raw into fv according to fv's type.
func setValue(fv reflect.Value, raw string) error {
	if reflect.PointerTo(fv.Type()).Implements(textUnmarshalerType) {
		u, _ := fv.Addr().Interface().(encoding.TextUnmarshaler)
		if err := u.UnmarshalText([]byte(raw)); err != nil {
			return fmt.Errorf("%w: %w", ErrInvalidValue, err)
		}
		return nil
	}
	if fv.Type() == durationType {
		d, err := time.ParseDuration(raw)
		if err != nil {
			return fmt.Errorf("%w: want a duration such as 5s or 250ms", ErrInvalidValue)
		}
		fv.SetInt(int64(d))
		return nil
	}
	return setKind(fv, raw)
}

// setKind handles the basic kinds.
func setKind(fv reflect.Value, raw string) error {
	bits := 0
	switch fv.Kind() {
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64,
		reflect.Float32, reflect.Float64:
		bits = fv.Type().Bits()
	}
	switch fv.Kind() {
	case reflect.String:
		fv.SetString(raw)
	case reflect.Bool:
		b, err := strconv.ParseBool(raw)
		if err != nil {
			return fmt.Errorf("%w: want true or false", ErrInvalidValue)
		}
		fv.SetBool(b)
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		n, err := strconv.ParseInt(raw, 10, bits)
		if err != nil {
			return fmt.Errorf("%w: want a %d-bit integer", ErrInvalidValue, bits)
		}
		fv.SetInt(n)
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		n, err := strconv.ParseUint(raw, 10, bits)
		if err != nil {
			return fmt.Errorf("%w: want a non-negative %d-bit integer", ErrInvalidValue, bits)
		}
		fv.SetUint(n)
	case reflect.Float32, reflect.Float64:
		f, err := strconv.ParseFloat(raw, bits)
		if err != nil {
			return fmt.Errorf("%w: want a number", ErrInvalidValue)
		}
		fv.SetFloat(f)
	case reflect.Slice:
		if fv.Type().Elem().Kind() != reflect.String {
			return fmt.Errorf("%w: %s", ErrUnsupportedType, fv.Type())
		}
		fv.Set(reflect.ValueOf(splitList(raw)).Convert(fv.Type()))
	default:
		return fmt.Errorf("%w: %s", ErrUnsupportedType, fv.Type())
	}
	return nil
}

// splitList splits a comma-separated list, trimming blanks and dropping
// empty items.
func splitList(raw string) []string {
	parts := strings.Split(raw, ",")
	out := make([]string, 0, len(parts))
	for _, p := range parts {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}
