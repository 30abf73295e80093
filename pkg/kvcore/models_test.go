package kvcore

import (
	"errors"
	"testing"
)

func TestModels(t *testing.T) {
	tp8, dense, mamba := mustPreset(t, "hybrid-mla-linear-tp8"), mustPreset(t, "dense"), mustPreset(t, "full-swa-mamba")
	r, err := NewModels("dep", tp8, dense, mamba)
	if err != nil {
		t.Fatal(err)
	}
	if r.Default() != tp8 || len(r.All()) != 3 || r.Names()[1] != dense.Name {
		t.Fatalf("default %s, names %v", r.Default().Name, r.Names())
	}
	if m, err := r.Get(mamba.Name); err != nil || m != mamba {
		t.Fatalf("Get(%s) = %v, %v", mamba.Name, m, err)
	}
	if _, err := r.Get("llama"); !errors.Is(err, ErrModelNotServed) || !errors.Is(err, ErrUnknownModel) {
		t.Fatalf("Get of an unserved model: %v", err)
	}
	kb, err := r.Keys(dense.Name)
	if err != nil || kb.Model != dense.Name || kb.Fingerprint != dense.Fingerprint() || kb.Prefix != "dep" {
		t.Fatalf("Keys(%s) = %+v, %v", dense.Name, kb, err)
	}
	key := kb.Key(Rank{}, 0, BlockHash{7})
	if p, ok, err := r.ParseOwn(key); err != nil || !ok || p.Model != dense.Name {
		t.Fatalf("ParseOwn of a served model's key: %+v %v %v", p, ok, err)
	}
	other, _ := NewKeyBuilder("dep", mustPreset(t, "hybrid-mla-linear")) // same name as tp8, another layout
	for _, k := range []string{other.Key(Rank{}, 0, BlockHash{7}), kb.WithPrefix("elsewhere").Key(Rank{}, 0, BlockHash{7})} {
		if _, ok, err := r.ParseOwn(k); err != nil || ok {
			t.Fatalf("ParseOwn(%s) = %v, %v; want not ours", k, ok, err)
		}
	}
	if _, _, err := r.ParseOwn("junk"); err == nil {
		t.Fatal("ParseOwn of junk: nil error")
	}
	if _, err := NewModels("dep", dense, mustPreset(t, "dense")); !errors.Is(err, ErrDuplicateModel) {
		t.Fatalf("two models of one name: %v", err)
	}
	if _, err := NewModels("dep"); err == nil {
		t.Fatal("no model: nil error")
	}
}

func mustPreset(t *testing.T, name string) *Model {
	t.Helper()
	m, err := Preset(name)
	if err != nil {
		t.Fatal(err)
	}
	return m
}
