package kvcore

import (
	"fmt"
	"strings"
)

// Models are the models one mesh serves, by name: the registry every
// service resolves a request's, task's or key's model in. The first is
// the default (the services' KVMESH_MODEL). It is a value built once at
// start and read concurrently; nothing changes it.
type Models struct {
	list   []*Model
	byName map[string]*Model
	keys   map[string]KeyBuilder
}

// NewModels returns the registry of ms (the first the default), each
// validated, with its keys under prefix. Two models of one name are an
// ErrDuplicateModel error: a name is what requests and keys carry.
func NewModels(prefix string, ms ...*Model) (*Models, error) {
	if len(ms) == 0 {
		return nil, fmt.Errorf("%w: no model to serve", ErrUnknownModel)
	}
	r := &Models{byName: make(map[string]*Model, len(ms)), keys: make(map[string]KeyBuilder, len(ms))}
	for _, m := range ms {
		if err := m.Validate(); err != nil {
			return nil, err
		}
		if _, dup := r.byName[m.Name]; dup {
			return nil, fmt.Errorf("%w: %q", ErrDuplicateModel, m.Name)
		}
		kb, err := NewKeyBuilder(prefix, m)
		if err != nil {
			return nil, err
		}
		r.list = append(r.list, m)
		r.byName[m.Name], r.keys[m.Name] = m, kb
	}
	return r, nil
}

// Default is the first model: the services' KVMESH_MODEL.
func (r *Models) Default() *Model { return r.list[0] }

// All lists the models, the default first.
func (r *Models) All() []*Model { return r.list }

// Names lists the models' names, the default first.
func (r *Models) Names() []string {
	out := make([]string, len(r.list))
	for i, m := range r.list {
		out[i] = m.Name
	}
	return out
}

// Get returns the model named name, or an ErrModelNotServed error naming
// the served ones.
func (r *Models) Get(name string) (*Model, error) {
	if m, ok := r.byName[name]; ok {
		return m, nil
	}
	return nil, fmt.Errorf("%w: %q (this mesh serves %s)", ErrModelNotServed, name, strings.Join(r.Names(), ", "))
}

// Keys returns the key builder of the model named name (its prefix, name
// and fingerprint), or an ErrModelNotServed error.
func (r *Models) Keys(name string) (KeyBuilder, error) {
	if kb, ok := r.keys[name]; ok {
		return kb, nil
	}
	_, err := r.Get(name)
	return KeyBuilder{}, err
}

// ParseOwn parses key as a key of one of the served models (KeyBuilder.
// ParseOwn of the model its key names): ok is false for a key of another
// deployment, model or fingerprint.
func (r *Models) ParseOwn(key string) (p KeyParts, ok bool, err error) {
	p, err = ParseKey(key)
	if err != nil {
		return KeyParts{}, false, err
	}
	kb, found := r.keys[p.Model]
	return p, found && kb.owns(p), nil
}
