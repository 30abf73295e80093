package config

import (
	"errors"
	"fmt"
	"reflect"
	"slices"
)

// ErrDefault means a default is stated twice or names no setting.
var ErrDefault = errors.New("config: bad default")

// Defaulter is implemented (on the pointer) by a configuration struct, or a
// struct nested in one, whose settings take some defaults from Go values,
// typically a library's exported Default constants, instead of a default
// tag, so that each default is stated once, where the library falls back
// to it. ConfigDefaults maps a variable name to its default value; the value
// is rendered as Describe renders values (a time.Duration as 5s, a []string
// comma-separated) and then parsed like the variable. A variable must not
// have both a default tag and a ConfigDefaults entry. ConfigDefaults is
// called on a zero struct, so it must not depend on the receiver's fields.
type Defaulter interface {
	// ConfigDefaults returns the defaults by variable name.
	ConfigDefaults() map[string]any
}

var defaulterType = reflect.TypeFor[Defaulter]()

// valueDefaults collects the ConfigDefaults of struct type t and of the
// struct types nested in it (as walk descends), rendered as text. A variable
// given two different values is reported.
func valueDefaults(t reflect.Type) (map[string]string, error) {
	out := map[string]string{}
	var errs []error
	var collect func(t reflect.Type)
	collect = func(t reflect.Type) {
		if reflect.PointerTo(t).Implements(defaulterType) {
			d, _ := reflect.New(t).Interface().(Defaulter)
			for name, v := range d.ConfigDefaults() {
				text := formatValue(reflect.ValueOf(v))
				if prev, ok := out[name]; ok && prev != text {
					errs = append(errs, fmt.Errorf("%w: %s has two defaults, %q and %q", ErrDefault, name, prev, text))
					continue
				}
				out[name] = text
			}
		}
		for i := range t.NumField() {
			sf := t.Field(i)
			if !sf.IsExported() {
				continue
			}
			if _, tagged := sf.Tag.Lookup("env"); !tagged && sf.Type.Kind() == reflect.Struct {
				collect(sf.Type)
			}
		}
	}
	collect(t)
	return out, errors.Join(errs...)
}

// checkDefaults reports each value default that names no setting of v, or a
// setting that also has a default tag.
func checkDefaults(v reflect.Value, defs map[string]string) error {
	seen := map[string]bool{}
	var errs []error
	walk(v, func(sf reflect.StructField, _ reflect.Value) {
		name := sf.Tag.Get("env")
		if _, ok := defs[name]; !ok {
			return
		}
		seen[name] = true
		if tag, ok := sf.Tag.Lookup("default"); ok {
			errs = append(errs, fmt.Errorf("%w: %s has a default tag %q and a ConfigDefaults value %q",
				ErrDefault, name, tag, defs[name]))
		}
	})
	names := make([]string, 0, len(defs))
	for name := range defs {
		if !seen[name] {
			names = append(names, name)
		}
	}
	slices.Sort(names)
	for _, name := range names {
		errs = append(errs, fmt.Errorf("%w: ConfigDefaults names %s, which is no setting", ErrDefault, name))
	}
	return errors.Join(errs...)
}

// defaultOf returns a field's default: its default tag, else its entry in
// defs.
func defaultOf(sf reflect.StructField, defs map[string]string) (string, bool) {
	if def, ok := sf.Tag.Lookup("default"); ok {
		return def, true
	}
	def, ok := defs[sf.Tag.Get("env")]
	return def, ok
}

// FillZero gives each named variable's field of the struct that dst points
// to its default (from the tag or ConfigDefaults) when the field holds its
// zero value, for a configuration built in code rather than loaded. Naming
// a variable that is not a setting of dst, or that has no default, is an
// error.
func FillZero(dst any, names ...string) error {
	rv := reflect.ValueOf(dst)
	if rv.Kind() != reflect.Pointer || rv.IsNil() || rv.Elem().Kind() != reflect.Struct {
		return ErrNotStructPointer
	}
	defs, err := valueDefaults(rv.Elem().Type())
	if err != nil {
		return err
	}
	want := map[string]bool{}
	for _, name := range names {
		want[name] = true
	}
	var errs []error
	walk(rv.Elem(), func(sf reflect.StructField, fv reflect.Value) {
		name := sf.Tag.Get("env")
		if !want[name] {
			return
		}
		delete(want, name)
		def, ok := defaultOf(sf, defs)
		if !ok || def == "" {
			errs = append(errs, fmt.Errorf("%w: %s has no default", ErrDefault, name))
			return
		}
		if !fv.IsZero() {
			return
		}
		if err := setValue(fv, def); err != nil {
			errs = append(errs, fmt.Errorf("%s (default)=%q: %w", name, def, err))
		}
	})
	for _, name := range names {
		if want[name] {
			errs = append(errs, fmt.Errorf("%w: %s is no setting", ErrDefault, name))
		}
	}
	return errors.Join(errs...)
}
