package config

import (
	"errors"
	"fmt"
	"reflect"
)

// ErrDefault means FillZero was asked for a default that is not there: a
// variable that is no setting, or a setting without a default.
var ErrDefault = errors.New("config: bad default")

// Defaulter is implemented (on the pointer) by a configuration struct, or
// a struct nested in one, whose settings have defaults other than their
// zero values. SetDefaults is the one place those defaults are stated, as
// typed Go values beside the struct (often a library's exported Default
// constants): it sets them on a zero struct. Load, FillZero, Describe and
// Defaults call it on a fresh value, first on every nested struct and then
// on the struct that holds them, so a struct may override the default of
// a struct it embeds (a service's own port in the shared HTTP settings).
// SetDefaults must depend neither on the receiver's fields nor on the
// environment, and a setting whose default is its zero value has none.
type Defaulter interface {
	// SetDefaults sets the struct's defaults.
	SetDefaults()
}

var defaulterType = reflect.TypeFor[Defaulter]()

// Defaults returns a T (a configuration struct) holding every setting's
// default: the value a Load from an empty environment starts from, and the
// body of a component's DefaultConfig.
func Defaults[T any]() T {
	var v T
	rv := reflect.ValueOf(&v).Elem()
	if rv.Kind() == reflect.Struct {
		applyDefaults(rv)
	}
	return v
}

// defaultsOf returns a new value of struct type t with its defaults set.
func defaultsOf(t reflect.Type) reflect.Value {
	v := reflect.New(t).Elem()
	applyDefaults(v)
	return v
}

// applyDefaults calls SetDefaults on the structs nested in v (as walk
// descends into them), innermost first, and then on v itself.
func applyDefaults(v reflect.Value) {
	t := v.Type()
	for i := range t.NumField() {
		sf := t.Field(i)
		if !sf.IsExported() {
			continue
		}
		if _, tagged := sf.Tag.Lookup("env"); !tagged && sf.Type.Kind() == reflect.Struct {
			applyDefaults(v.Field(i))
		}
	}
	if v.CanAddr() && reflect.PointerTo(t).Implements(defaulterType) {
		d, _ := v.Addr().Interface().(Defaulter)
		d.SetDefaults()
	}
}

// walkDefaults calls fn for every setting of v (as walk does) with the
// same field of def, a value of v's type holding the defaults.
func walkDefaults(v, def reflect.Value, fn func(sf reflect.StructField, fv, dv reflect.Value)) {
	t := v.Type()
	for i := range t.NumField() {
		sf := t.Field(i)
		if !sf.IsExported() {
			continue
		}
		fv, dv := v.Field(i), def.Field(i)
		if _, tagged := sf.Tag.Lookup("env"); tagged {
			fn(sf, fv, dv)
			continue
		}
		if sf.Type.Kind() == reflect.Struct {
			walkDefaults(fv, dv, fn)
		}
	}
}

// hasDefault reports whether dv, a setting's default, is one: a zero value
// is none.
func hasDefault(dv reflect.Value) bool {
	return !dv.IsZero()
}

// setDefault sets fv to its default dv, copying a slice so that the
// default is not shared.
func setDefault(fv, dv reflect.Value) {
	if dv.Kind() == reflect.Slice {
		c := reflect.MakeSlice(dv.Type(), dv.Len(), dv.Len())
		reflect.Copy(c, dv)
		fv.Set(c)
		return
	}
	fv.Set(dv)
}

// FillZero gives each named variable's field of the struct that dst points
// to its default (from SetDefaults) when the field holds its zero value,
// for a configuration built in code rather than loaded. Naming a variable
// that is not a setting of dst, or that has no default, is an error.
func FillZero(dst any, names ...string) error {
	rv := reflect.ValueOf(dst)
	if rv.Kind() != reflect.Pointer || rv.IsNil() || rv.Elem().Kind() != reflect.Struct {
		return ErrNotStructPointer
	}
	want := map[string]bool{}
	for _, name := range names {
		want[name] = true
	}
	var errs []error
	walkDefaults(rv.Elem(), defaultsOf(rv.Elem().Type()), func(sf reflect.StructField, fv, dv reflect.Value) {
		name := sf.Tag.Get("env")
		if !want[name] {
			return
		}
		delete(want, name)
		if !hasDefault(dv) {
			errs = append(errs, fmt.Errorf("%w: %s has no default", ErrDefault, name))
			return
		}
		if fv.IsZero() {
			setDefault(fv, dv)
		}
	})
	for _, name := range names {
		if want[name] {
			errs = append(errs, fmt.Errorf("%w: %s is no setting", ErrDefault, name))
		}
	}
	return errors.Join(errs...)
}
