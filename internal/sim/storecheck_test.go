package sim

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
)

// TestCheckValues: a stored value is right only when it decodes under the
// model's fingerprint to exactly its key's content; a key the store no
// longer has is gone, not wrong.
func TestCheckValues(t *testing.T) {
	m := preset(t, "hybrid-mla-linear")
	kb := kvcore.KeysOf(m).WithPrefix("dep")
	hashes := kvcore.HashChain(make([]uint32, 64), 16, []byte("salt"))
	fp := m.Fingerprint()
	key := func(g, i int) string { return kb.Key(kvcore.Rank{}, g, hashes[i]) }
	right := func(g, i int) []byte { return dataplane.EncodeValue(fp, BlockContent(m, g, kvcore.Rank{}, hashes[i])) }
	st := kvstore.NewMemory(kvstore.MemoryOptions{})
	defer st.Close()
	items := []kvstore.Item{
		{Key: key(0, 0), Value: right(0, 0)},
		{Key: key(1, 1), Value: right(1, 1)},
		{Key: key(0, 2), Value: right(0, 3)},      // another block's bytes
		{Key: key(1, 2), Value: right(1, 2)[:10]}, // truncated
		{Key: key(0, 3), Value: dataplane.EncodeValue("other", BlockContent(m, 0, kvcore.Rank{}, hashes[3]))}, // other layout
	}
	if _, err := st.Put(context.Background(), items); err != nil {
		t.Fatal(err)
	}
	// key(1,3) and key(1,0) were evicted; a BlockRemoved named key(1,3) only.
	keys := []string{key(0, 0), key(1, 1), key(0, 2), key(1, 2), key(0, 3), key(1, 3), key(1, 0)}
	removed := func(k string) bool { return k == key(1, 3) || k == key(0, 0) }
	for name, batch := range map[string]int{"one batch": 256, "small batches": 1} {
		t.Run(name, func(t *testing.T) {
			var c StoreCheck
			if err := checkValues(context.Background(), st, m, time.Second, keys, &c, batch, removed); err != nil {
				t.Fatal(err)
			}
			if c.Checked != 5 || c.Wrong != 3 || c.Gone != 2 || c.GoneAnnounced != 1 || len(c.Wrongs) != 3 {
				t.Fatalf("%+v: want 5 checked, 3 wrong, 2 gone of which 1 announced", c)
			}
			for _, w := range c.Wrongs {
				if w.Key == key(0, 0) || w.Key == key(1, 1) || w.Problem == "" {
					t.Fatalf("wrong %+v", w)
				}
			}
		})
	}
	if p := newContents(m).checkValue("not-a-key", right(0, 0)); !strings.Contains(p, "not-a-key") {
		t.Fatalf("an unparseable key: %q", p)
	}
}

// TestCheckValueNamespaces: at TP8 a value is right only under a namespace
// of its group and with that namespace's bytes: the one MLA namespace, or
// the linear-attention state of the rank the namespace names.
func TestCheckValueNamespaces(t *testing.T) {
	m := tpModel(t, 8)
	kb := kvcore.KeysOf(m)
	h := kvcore.HashChain(make([]uint32, 16), 16, nil)[0]
	c, fp := newContents(m), m.Fingerprint()
	value := func(g int, r kvcore.Rank) []byte { return dataplane.EncodeValue(fp, BlockContent(m, g, r, h)) }
	for name, tc := range map[string]struct {
		key   string
		value []byte
		want  string
	}{
		"MLA, from any rank":        {kb.Key(kvcore.Rank{}, 0, h), value(0, kvcore.Rank{TP: 6}), ""},
		"MLA under tp_rank:3":       {kb.Key(kvcore.Rank{TP: 3}, 0, h), value(0, kvcore.Rank{TP: 3}), "not one of group 0's"},
		"state of its rank":         {kb.Key(kvcore.Rank{TP: 3}, 1, h), value(1, kvcore.Rank{TP: 3}), ""},
		"state of another rank":     {kb.Key(kvcore.Rank{TP: 3}, 1, h), value(1, kvcore.Rank{TP: 2}), "other bytes"},
		"state beyond the TP ranks": {kb.Key(kvcore.Rank{TP: 8}, 1, h), value(1, kvcore.Rank{TP: 8}), "not one of group 1's"},
	} {
		if got := c.checkValue(tc.key, tc.value); (tc.want == "") != (got == "") || !strings.Contains(got, tc.want) {
			t.Errorf("%s: %q, want %q", name, got, tc.want)
		}
	}
}
