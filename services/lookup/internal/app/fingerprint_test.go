package app_test

import (
	"net/http"
	"testing"

	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// TestLayoutChangeIsAMiss: blocks stored under one model layout hit for a
// lookup serving that layout and miss — never hit — for one whose spec
// changes what decides a block's bytes (the KV dtype, the layout version,
// the engine version), on one store and one deployment prefix: the
// fingerprint is a segment of every key the lookup checks. Writing the
// new layout's keys makes the new layout hit.
func TestLayoutChangeIsAMiss(t *testing.T) {
	env := servicetest.NewEnv(t)
	seed := newSeeder(t, env.RedisURL)
	prefix := randomID("layout-")
	start := func(spec string) *lookupService {
		return startLookup(t, env, map[string]string{"KVMESH_MODEL": writeSpec(t, spec), "KVMESH_KEY_PREFIX": prefix})
	}
	old := start(specDense)
	toks := tokens(48, 977)
	hashes := kvcore.HashChain(toks, 16, nil)
	seed.put(t, groupKeys(old.keys(), 0, hashes, 0, 1, 2)...)

	hit := expect{external: 32, loadAsync: true, chosen: "store",
		children: []contract.ChildDecision{store(32, &kvcore.LoadSpec{KVPoolCachedTokens: 32})}}
	miss := expect{children: []contract.ChildDecision{store(0, nil)}}
	hit.check(t, old.lookup(t, body("layout-old", toks, 0)))

	for _, change := range []struct{ name, field string }{
		{"kv_dtype", "kv_dtype: fp8_e4m3\n"},
		{"layout_version", "layout_version: 2\n"},
		{"engine_version", "engine_version: 0.11.2\n"},
	} {
		t.Run(change.name, func(t *testing.T) {
			s := start(specDense + change.field)
			if s.model.Fingerprint() == old.model.Fingerprint() {
				t.Fatalf("%s left the fingerprint %s", change.name, s.model.Fingerprint())
			}
			miss.check(t, s.lookup(t, body("layout-"+change.name, toks, 0)))
			seed.put(t, groupKeys(s.keys(), 0, hashes, 0, 1, 2)...)
			hit.check(t, s.lookup(t, body("layout-"+change.name+"-saved", toks, 0)))
		})
	}
	hit.check(t, old.lookup(t, body("layout-old-again", toks, 0)))
}

// TestLookupRefusesAnotherEngineVersion: a lookup serving a spec that pins
// engine_version answers an engine stating that version, or none, and
// refuses one stating another (400, field engine_version), in the JSON and
// the binary body; a malformed version is refused too.
func TestLookupRefusesAnotherEngineVersion(t *testing.T) {
	env := servicetest.NewEnv(t)
	seed := newSeeder(t, env.RedisURL)
	s := startLookup(t, env, map[string]string{"KVMESH_MODEL": writeSpec(t, specDense+"engine_version: 0.11.2\n")})
	toks := tokens(48, 978)
	hashes := kvcore.HashChain(toks, 16, nil)
	seed.put(t, groupKeys(s.keys(), 0, hashes, 0, 1, 2)...)
	hit := expect{external: 32, loadAsync: true, chosen: "store",
		children: []contract.ChildDecision{store(32, &kvcore.LoadSpec{KVPoolCachedTokens: 32})}}
	for _, stated := range []string{"0.11.2", ""} {
		b := body("version-ok-"+stated, toks, 0)
		if stated != "" {
			b["engine_version"] = stated
		}
		hit.check(t, s.lookup(t, b))
	}
	for _, stated := range []string{"0.12.0", "0.11.2 rc1"} {
		b := body("version-refused", toks, 0)
		b["engine_version"] = stated
		if p := s.post(t, b, nil).problem(t, http.StatusBadRequest); p.Extras["field"] != "engine_version" {
			t.Errorf("engine version %q: problem %+v, want field engine_version", stated, p)
		}
		head := map[string]any{"engine_id": "engine-0", "request_id": "version-bin", "model": "test-model",
			"block_hash_bytes": len(hashes[0]), "num_tokens": 48, "engine_version": stated}
		if p := s.post(t, binaryBody(t, head, hashes), binaryType).problem(t, http.StatusBadRequest); p.Extras["field"] != "engine_version" {
			t.Errorf("binary, engine version %q: problem %+v, want field engine_version", stated, p)
		}
	}
}
