package bus

import (
	"fmt"
	"slices"
	"testing"

	"github.com/segmentio/kafka-go"
)

func TestSpreadBalancerDealsEveryPartition(t *testing.T) {
	topics := []string{"a", "b", "c"}
	var parts []kafka.Partition
	for _, tp := range topics {
		for id := range 4 {
			parts = append(parts, kafka.Partition{Topic: tp, ID: id})
		}
	}
	cases := []struct {
		name    string
		members []kafka.GroupMember
		min     int // partitions every member gets at least
	}{
		{"more members than a topic's partitions", members(8, topics...), 1},
		{"fewer members", members(3, topics...), 4},
		{"one member", members(1, topics...), 12},
		{"a member of one topic only", append(members(2, topics...), kafka.GroupMember{ID: "z", Topics: []string{"c"}}), 1},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got := spreadBalancer{}.AssignGroups(c.members, parts)
			seen := map[string]string{}
			for _, m := range c.members {
				n := 0
				for tp, ids := range got[m.ID] {
					for _, id := range ids {
						p := fmt.Sprint(tp, "/", id)
						if prev, dup := seen[p]; dup {
							t.Fatalf("%v assigned to %s and %s", p, prev, m.ID)
						}
						seen[p] = m.ID
						n++
						if !slices.Contains(m.Topics, tp) {
							t.Fatalf("%s got %s, of a topic it does not consume", m.ID, p)
						}
					}
				}
				if n < c.min {
					t.Errorf("%s got %d partitions, want at least %d: %v", m.ID, n, c.min, got)
				}
			}
			if len(seen) != len(parts) {
				t.Fatalf("%d of %d partitions assigned", len(seen), len(parts))
			}
		})
	}
}

func members(n int, topics ...string) []kafka.GroupMember {
	out := make([]kafka.GroupMember, n)
	for i := range out {
		out[i] = kafka.GroupMember{ID: fmt.Sprintf("m%02d", i), Topics: topics}
	}
	return out
}
