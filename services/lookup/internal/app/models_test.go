package app_test

import (
	"net/http"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// TestManyModels: one lookup serving two models (KVMESH_MODEL and
// KVMESH_MODELS, the same hash block size, so one prompt has one hash
// chain in both) answers each model from its own keys only: the blocks
// stored under model-b are a hit for model-b and a miss for model-a, and
// model-a's own blocks a hit for it; a model the mesh does not serve is
// refused (400, field model, naming the served ones), never looked up.
func TestManyModels(t *testing.T) {
	env := servicetest.NewEnv(t)
	seed := newSeeder(t, env.RedisURL)
	specA := strings.Replace(specDense, "name: test-model", "name: model-a", 1)
	specB := strings.Replace(specDense, "name: test-model", "name: model-b", 1)
	s := startLookup(t, env, map[string]string{"KVMESH_MODEL": writeSpec(t, specA), "KVMESH_MODELS": writeSpec(t, specB)})
	b, err := kvcore.ParseModel([]byte(specB))
	if err != nil {
		t.Fatal(err)
	}
	keysB := kvcore.KeysOf(b).WithPrefix(s.prefix)
	toks := tokens(48, 4242)
	hashes := kvcore.HashChain(toks, 16, nil)
	seed.put(t, groupKeys(keysB, 0, hashes, 0, 1, 2)...)

	ask := func(id, model string) map[string]any {
		q := body(id, toks, 0)
		q["model"] = model
		return q
	}
	hit := expect{external: 32, loadAsync: true, chosen: "store",
		children: []contract.ChildDecision{store(32, &kvcore.LoadSpec{KVPoolCachedTokens: 32})}}
	miss := expect{children: []contract.ChildDecision{store(0, nil)}}
	hit.check(t, s.lookup(t, ask("models-b", "model-b")))
	miss.check(t, s.lookup(t, ask("models-a", "model-a")))
	seed.put(t, groupKeys(s.keys(), 0, hashes, 0, 1, 2)...)
	hit.check(t, s.lookup(t, ask("models-a-saved", "model-a")))

	p := s.post(t, ask("models-unserved", "llama-9000"), nil).problem(t, http.StatusBadRequest)
	if detail, _ := p.Extras["detail"].(string); p.Extras["field"] != "model" ||
		!strings.Contains(p.Detail+detail, "model-a, model-b") {
		t.Fatalf("unserved model: %+v; want field model naming model-a, model-b", p)
	}
}
