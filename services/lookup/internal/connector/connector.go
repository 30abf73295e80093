// Package connector is the lookup service's connector chain: the children
// of a MultiConnector (store, pd) that each answer how many of a request's
// prompt tokens they can supply, and the chain that asks every one of them
// and selects the answer, as vLLM's MultiConnector does.
package connector

import (
	"context"
	"errors"
	"fmt"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
)

// Names of the children a chain can be built from.
const (
	NameStore = "store"
	NamePD    = "pd"
)

// DefaultChain is the chain used when none is configured
// (KVMESH_LOOKUP_CONNECTORS): the store alone. Each call returns a new
// slice.
func DefaultChain() []string { return []string{NameStore} }

// Errors of the connector chain.
var (
	// ErrStore wraps a failed store existence check. The store child
	// fails open: it answers 0 tokens and carries the error in
	// Answer.Failed (it is never a guessed positive count).
	ErrStore = errors.New("store existence check failed")
	// ErrUnknownConnector is returned for a chain entry that names no child.
	ErrUnknownConnector = errors.New("unknown connector")
	// ErrDuplicateConnector is returned for a chain naming a child twice.
	ErrDuplicateConnector = errors.New("connector named twice")
	// ErrEmptyChain is returned for a chain with no children.
	ErrEmptyChain = errors.New("connector chain is empty")
)

// Query is one request's lookup, validated: every child answers the same
// query.
type Query struct {
	// EngineID and RequestID identify the request.
	EngineID, RequestID string
	// Tenant is the request's tenant (kvcore.ValidateTenant): the store
	// child checks only its keys.
	Tenant string
	// NumTokens is the request's token count.
	NumTokens int
	// NumComputedTokens is what the engine already holds (its prefix cache).
	NumComputedTokens int
	// Hashes is the request's hash chain at the model's hash block size,
	// covering at least NumTokens / hash_block_size blocks.
	Hashes []kvcore.BlockHash
	// LoadAsync is whether a positive answer is loaded asynchronously.
	LoadAsync bool
	// Transfer is the disaggregated-prefill source, when the engine sent
	// kv_transfer_params.
	Transfer *contract.PDSource
}

// Answer is one child's answer.
type Answer struct {
	// Tokens is the number of external tokens the child can supply
	// (hit − num_computed_tokens, or 0).
	Tokens int
	// Pending is set when the child's lookup has not finished ("not yet").
	Pending bool
	// Spec is the LoadSpec the child kept; nil when Tokens is 0.
	Spec *kvcore.LoadSpec
	// Async is whether the child would load asynchronously.
	Async bool
	// PD is the prefill source a pd child would load from.
	PD *contract.PDSource
	// Failed is set when the child could not check its source (a store
	// outage: it wraps ErrStore). The child then answers 0 (Tokens 0, no
	// Spec, not pending) and the chain goes on: fail open, per child.
	Failed error
}

// FailureReason names a failed answer's cause for metrics and the
// decision: a kvstore failure status ("unavailable", "timeout",
// "closed", …); "" when the answer did not fail.
func (a Answer) FailureReason() string {
	if a.Failed == nil {
		return ""
	}
	return kvstore.FailureStatus(a.Failed)
}

// Connector is one child of the chain.
type Connector interface {
	// Name is the child's name in the chain ("store", "pd").
	Name() string
	// Lookup answers q. A source the child cannot check (a store outage)
	// is an answer of 0 with Answer.Failed set: the chain goes on. An
	// error is a query the child refuses (a bug, not an outage): the whole
	// lookup fails, and it is never turned into a count.
	Lookup(ctx context.Context, q *Query) (Answer, error)
}

// Deps are what children may need.
type Deps struct {
	// Model is the served model's layout.
	Model *kvcore.Model
	// Keys builds store keys (prefix and model name).
	Keys kvcore.KeyBuilder
	// Store is the store pool, for the store child.
	Store kvstore.Store
}

// CheckNames reports the first problem with a chain's child names: an empty
// chain, an unknown name or a name given twice.
func CheckNames(names []string) error {
	if len(names) == 0 {
		return ErrEmptyChain
	}
	seen := map[string]bool{}
	for _, n := range names {
		if n != NameStore && n != NamePD {
			return fmt.Errorf("%q (want %s or %s): %w", n, NameStore, NamePD, ErrUnknownConnector)
		}
		if seen[n] {
			return fmt.Errorf("%q: %w", n, ErrDuplicateConnector)
		}
		seen[n] = true
	}
	return nil
}

// Build makes the chain's children, in the order of names.
func Build(names []string, d Deps) (*Chain, error) {
	if err := CheckNames(names); err != nil {
		return nil, err
	}
	children := make([]Connector, 0, len(names))
	for _, n := range names {
		switch n {
		case NameStore:
			children = append(children, NewStore(d.Model, d.Keys, d.Store))
		case NamePD:
			children = append(children, NewPD(d.Model))
		}
	}
	return NewChain(children...)
}

// Chain is a MultiConnector: an ordered list of children.
type Chain struct {
	children []Connector
}

// NewChain returns a chain of children, which must have distinct names.
func NewChain(children ...Connector) (*Chain, error) {
	if len(children) == 0 {
		return nil, ErrEmptyChain
	}
	seen := map[string]bool{}
	for _, c := range children {
		if seen[c.Name()] {
			return nil, fmt.Errorf("%q: %w", c.Name(), ErrDuplicateConnector)
		}
		seen[c.Name()] = true
	}
	return &Chain{children: children}, nil
}

// Names returns the children's names, in chain order.
func (c *Chain) Names() []string {
	out := make([]string, len(c.children))
	for i, child := range c.children {
		out[i] = child.Name()
	}
	return out
}

// Result is the chain's answer: every child's answer in chain order and
// the selection among them.
type Result struct {
	// Names are the children's names, aligned with Answers.
	Names []string
	// Answers are the children's answers, in chain order.
	Answers []Answer
	// Selection is kvcore.SelectChild over the answers.
	Selection kvcore.Selection
}

// Chosen returns the chosen child's answer, or false when none is chosen.
func (r Result) Chosen() (Answer, bool) {
	if r.Selection.Chosen < 0 || r.Selection.Chosen >= len(r.Answers) {
		return Answer{}, false
	}
	return r.Answers[r.Selection.Chosen], true
}

// ChildAnswers converts the answers for kvcore.SelectChild and the decision.
func (r Result) ChildAnswers() []kvcore.ChildAnswer {
	out := make([]kvcore.ChildAnswer, len(r.Answers))
	for i, a := range r.Answers {
		out[i] = kvcore.ChildAnswer{Name: r.Names[i], Tokens: a.Tokens, Pending: a.Pending, Spec: a.Spec, Failed: a.Failed != nil}
	}
	return out
}

// Failures lists the children whose check failed, in chain order: the
// index into Names and Answers of each answer with Failed set.
func (r Result) Failures() []int {
	var out []int
	for i, a := range r.Answers {
		if a.Failed != nil {
			out = append(out, i)
		}
	}
	return out
}

// Lookup asks every child, in order and with no short-circuit, then
// selects (kvcore.SelectChild, after vLLM's
// MultiConnector.get_num_new_matched_tokens): "not yet" if any child is
// pending, else the first child with a positive count. A child whose
// check failed answered 0 (Answer.Failed) and the chain went on; a
// child's error fails the whole lookup.
func (c *Chain) Lookup(ctx context.Context, q *Query) (Result, error) {
	res := Result{Names: make([]string, len(c.children)), Answers: make([]Answer, len(c.children))}
	for i, child := range c.children {
		a, err := child.Lookup(ctx, q)
		if err != nil {
			return Result{}, fmt.Errorf("connector %s: %w", child.Name(), err)
		}
		res.Names[i], res.Answers[i] = child.Name(), a
	}
	res.Selection = kvcore.SelectChild(res.ChildAnswers())
	return res, nil
}
