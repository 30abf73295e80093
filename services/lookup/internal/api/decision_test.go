package api

import (
	"fmt"
	"reflect"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
	"github.com/kvmesh/kvmesh/services/lookup/internal/connector"
)

func TestBuildDecision(t *testing.T) {
	q := &connector.Query{EngineID: "e", RequestID: "r", NumTokens: 48, NumComputedTokens: 0}
	src := &contract.PDSource{EngineID: "p", BlockTable: kvcore.BlockTable{{1, 2}}, Tokens: 48}
	spec := &kvcore.LoadSpec{KVPoolCachedTokens: 32}
	result := func(answers ...connector.Answer) connector.Result {
		r := connector.Result{Names: []string{connector.NamePD, connector.NameStore}, Answers: answers}
		r.Selection = kvcore.SelectChild(r.ChildAnswers())
		return r
	}
	cases := []struct {
		name string
		res  connector.Result
		want contract.LookupDecision
	}{
		{
			"pd chosen carries its source",
			result(connector.Answer{Tokens: 32, Spec: spec, Async: true, PD: src}, connector.Answer{Tokens: 32, Spec: spec, Async: true}),
			contract.LookupDecision{Chosen: "pd", ExternalTokens: 32, LoadAsync: true, PD: src, Children: []contract.ChildDecision{
				{Name: "pd", Tokens: 32, Spec: spec}, {Name: "store", Tokens: 32, Spec: spec}}},
		},
		{
			"store chosen carries no pd source",
			result(connector.Answer{}, connector.Answer{Tokens: 32, Spec: spec}),
			contract.LookupDecision{Chosen: "store", ExternalTokens: 32, Children: []contract.ChildDecision{
				{Name: "pd"}, {Name: "store", Tokens: 32, Spec: spec}}},
		},
		{
			"pending answers not yet, with no count",
			result(connector.Answer{Tokens: 32, Spec: spec, Async: true, PD: src}, connector.Answer{Pending: true}),
			contract.LookupDecision{Pending: true, Children: []contract.ChildDecision{
				{Name: "pd", Tokens: 32, Spec: spec}, {Name: "store", Pending: true}}},
		},
		{
			"failed store answers 0 and is named; pd wins",
			result(connector.Answer{Tokens: 32, Spec: spec, Async: true, PD: src},
				connector.Answer{Failed: fmt.Errorf("%w: %w", connector.ErrStore, kvstore.ErrUnavailable)}),
			contract.LookupDecision{Chosen: "pd", ExternalTokens: 32, LoadAsync: true, PD: src, Children: []contract.ChildDecision{
				{Name: "pd", Tokens: 32, Spec: spec}, {Name: "store", Failed: kvstore.StatusUnavailable}}},
		},
		{
			"disabled: no children",
			connector.Result{Selection: kvcore.Selection{Chosen: kvcore.NoChild}},
			contract.LookupDecision{Children: []contract.ChildDecision{}},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got := buildDecision("id", "m", q, tc.res)
			want := tc.want
			want.Schema, want.DecisionID, want.EngineID, want.RequestID, want.Model = contract.SchemaLookupDecision, "id", "e", "r", "m"
			want.NumTokens = 48
			if !reflect.DeepEqual(*got, want) {
				t.Fatalf("decision\n%+v\nwant\n%+v", *got, want)
			}
		})
	}
}
