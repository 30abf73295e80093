package bus

import (
	"cmp"
	"slices"

	"github.com/segmentio/kafka-go"
)

// spreadBalancer is a group balancer that deals every partition of every
// topic out in turn over all members, so that a group with more members
// than one topic has partitions still keeps each member busy. kafka-go's
// own balancers (range, round robin) assign topic by topic, each starting
// at the first member: with 8 members over three 4-partition topics (two
// replicas of 4 consumers each) they give all 12 partitions to the same 4
// members and leave the other 4 idle.
type spreadBalancer struct{}

// spreadProtocol is the balancer's protocol name; every member of a group
// must offer it (kafka-go's range balancer is offered after it, so a group
// mixing older members falls back to range).
const spreadProtocol = "kvmesh-spread"

// ProtocolName implements kafka.GroupBalancer.
func (spreadBalancer) ProtocolName() string { return spreadProtocol }

// UserData implements kafka.GroupBalancer.
func (spreadBalancer) UserData() ([]byte, error) { return nil, nil }

// AssignGroups implements kafka.GroupBalancer: partitions in (topic, id)
// order, each to the next member, in member id order, that subscribes to
// its topic.
func (spreadBalancer) AssignGroups(members []kafka.GroupMember, partitions []kafka.Partition) kafka.GroupMemberAssignments {
	ms := slices.Clone(members)
	slices.SortFunc(ms, func(a, b kafka.GroupMember) int { return cmp.Compare(a.ID, b.ID) })
	ps := slices.Clone(partitions)
	slices.SortFunc(ps, func(a, b kafka.Partition) int {
		return cmp.Or(cmp.Compare(a.Topic, b.Topic), cmp.Compare(a.ID, b.ID))
	})
	out := kafka.GroupMemberAssignments{}
	for _, m := range ms {
		out[m.ID] = map[string][]int{}
	}
	next := 0
	for _, p := range ps {
		for range ms {
			m := ms[next%len(ms)]
			next++
			if slices.Contains(m.Topics, p.Topic) {
				out[m.ID][p.Topic] = append(out[m.ID][p.Topic], p.ID)
				break
			}
		}
	}
	return out
}
