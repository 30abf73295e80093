package sendpolicy_test

import (
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/services/sender/internal/sendpolicy"
)

func TestQuotaFit(t *testing.T) {
	for _, tc := range []struct {
		name  string
		q     sendpolicy.QuotaLimit
		u     sendpolicy.Usage
		sizes []int64
		fit   int
		over  sendpolicy.Usage
	}{
		{"no limit", sendpolicy.QuotaLimit{}, sendpolicy.Usage{Bytes: 1 << 40, Keys: 1 << 30}, []int64{10, 10}, 2, sendpolicy.Usage{}},
		{"bytes room for two", sendpolicy.QuotaLimit{MaxBytes: 100}, sendpolicy.Usage{Bytes: 75, Keys: 5}, []int64{10, 10, 10}, 2, sendpolicy.Usage{Bytes: 5}},
		{"keys room for one", sendpolicy.QuotaLimit{MaxKeys: 6}, sendpolicy.Usage{Bytes: 75, Keys: 5}, []int64{10, 10}, 1, sendpolicy.Usage{Keys: 1}},
		{"both, keys bind", sendpolicy.QuotaLimit{MaxBytes: 1000, MaxKeys: 5}, sendpolicy.Usage{Keys: 5}, []int64{1}, 0, sendpolicy.Usage{Keys: 1}},
		{"exactly full fits", sendpolicy.QuotaLimit{MaxBytes: 20, MaxKeys: 2}, sendpolicy.Usage{}, []int64{10, 10}, 2, sendpolicy.Usage{}},
		{"already over", sendpolicy.QuotaLimit{MaxBytes: 10}, sendpolicy.Usage{Bytes: 30}, []int64{1}, 0, sendpolicy.Usage{Bytes: 21}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := tc.q.Fit(tc.u, tc.sizes); got != tc.fit {
				t.Errorf("Fit = %d, want %d", got, tc.fit)
			}
			var add sendpolicy.Usage
			for _, s := range tc.sizes {
				add = add.Add(sendpolicy.Usage{Bytes: s, Keys: 1})
			}
			if got := tc.q.Over(tc.u, add); got != tc.over {
				t.Errorf("Over = %+v, want %+v", got, tc.over)
			}
		})
	}
}

func TestVictims(t *testing.T) {
	t0 := time.Unix(1_800_000_000, 0)
	cands := []sendpolicy.QuotaCandidate{
		{Key: "a", Bytes: 10, StoredAt: t0, Idle: time.Second}, // oldest, but read a second ago
		{Key: "b", Bytes: 10, StoredAt: t0.Add(time.Second), Idle: time.Hour},
		{Key: "c", Bytes: 10, StoredAt: t0.Add(2 * time.Second), Idle: time.Hour},
		{Key: "d", Bytes: 30, StoredAt: t0.Add(3 * time.Second), Idle: time.Minute},
	}
	for _, tc := range []struct {
		name  string
		cands []sendpolicy.QuotaCandidate
		need  sendpolicy.Usage
		want  []string
		freed sendpolicy.Usage
	}{
		{"nothing needed", cands, sendpolicy.Usage{}, nil, sendpolicy.Usage{}},
		{"idlest first, then first stored", cands, sendpolicy.Usage{Keys: 2}, []string{"b", "c"}, sendpolicy.Usage{Bytes: 20, Keys: 2}},
		{"bytes", cands, sendpolicy.Usage{Bytes: 25}, []string{"b", "c", "d"}, sendpolicy.Usage{Bytes: 50, Keys: 3}},
		{"not enough", cands, sendpolicy.Usage{Keys: 9}, []string{"b", "c", "d", "a"}, sendpolicy.Usage{Bytes: 60, Keys: 4}},
		{"no idle times: store order", []sendpolicy.QuotaCandidate{
			{Key: "y", Bytes: 1, StoredAt: t0.Add(time.Second)}, {Key: "x", Bytes: 1, StoredAt: t0},
		}, sendpolicy.Usage{Keys: 1}, []string{"x"}, sendpolicy.Usage{Bytes: 1, Keys: 1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, freed := sendpolicy.Victims(tc.cands, tc.need)
			var keys []string
			for _, v := range got {
				keys = append(keys, v.Key)
			}
			if len(keys) != len(tc.want) || freed != tc.freed {
				t.Fatalf("Victims = %v (%+v), want %v (%+v)", keys, freed, tc.want, tc.freed)
			}
			for i := range keys {
				if keys[i] != tc.want[i] {
					t.Fatalf("Victims = %v, want %v", keys, tc.want)
				}
			}
		})
	}
}
