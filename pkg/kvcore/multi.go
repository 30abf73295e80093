package kvcore

// ChildAnswer is one child connector's answer to a MultiConnector lookup.
type ChildAnswer struct {
	// Name is the child's name in the connector chain, e.g. "pd" or "store".
	Name string `json:"name"`
	// Tokens is the number of external tokens the child can supply.
	Tokens int `json:"tokens"`
	// Pending is set when the child's lookup has not finished yet ("not yet").
	Pending bool `json:"pending,omitempty"`
	// Spec is the LoadSpec the child kept, if any.
	Spec *LoadSpec `json:"load_spec,omitempty"`
	// Failed is set when the child could not check its source (a store
	// outage). The child fails open: it answers 0 tokens and is never
	// "not yet", whatever else it reported, and the chain goes on, as
	// vLLM's store child does (MooncakeStoreWorker.lookup and
	// LookupKeyClient.lookup answer MooncakeLookupResult(0) when the
	// existence check or the lookup call raises).
	Failed bool `json:"failed,omitempty"`
}

// NoChild is the Chosen index of a Selection that chose no child.
const NoChild = -1

// Selection is a MultiConnector's answer to a lookup.
type Selection struct {
	// Pending is set when any child answered "not yet": the whole answer is
	// then "not yet" and Chosen is NoChild.
	Pending bool `json:"pending,omitempty"`
	// Chosen is the index of the first child with a positive count, or NoChild.
	Chosen int `json:"chosen"`
	// Tokens is the chosen child's count (0 when none is chosen).
	Tokens int `json:"tokens"`
}

// Name returns the chosen child's name, or "" when none is chosen.
func (s Selection) Name(children []ChildAnswer) string {
	if s.Chosen < 0 || s.Chosen >= len(children) {
		return ""
	}
	return children[s.Chosen].Name
}

// SelectChild combines the answers of every child of a connector chain, in
// chain order, as vLLM's MultiConnector.get_num_new_matched_tokens does
// (vllm/backends/distributed/kv_transfer/kv_connector/v1/multi_connector.py):
// the caller asks every child (no short-circuit); if any child is pending
// the answer is "not yet"; otherwise the first child with a positive count
// is chosen and its count is the answer. A failed child (Failed) counts as
// 0 and is never pending: a store outage fails open, so a later child's hit
// still wins and, with no other hit, the answer is 0 external tokens.
func SelectChild(children []ChildAnswer) Selection {
	for _, c := range children {
		if c.Pending && !c.Failed {
			return Selection{Pending: true, Chosen: NoChild}
		}
	}
	for i, c := range children {
		if c.Tokens > 0 && !c.Failed {
			return Selection{Chosen: i, Tokens: c.Tokens}
		}
	}
	return Selection{Chosen: NoChild}
}

// AllocationCounts gives the external-token count each child receives after
// allocation, aligned with children: the chosen child gets externalTokens,
// every other child 0 (so a losing child's LoadSpec ends with
// can_load = false). chosen may be NoChild, in which case every child gets 0.
func AllocationCounts(chosen int, children []ChildAnswer, externalTokens int) []int {
	out := make([]int, len(children))
	if chosen >= 0 && chosen < len(children) {
		out[chosen] = externalTokens
	}
	return out
}

// FinishGate tracks a finished request across the children of a connector
// chain that save asynchronously: the request is finished-sending only after
// every one of them has reported. The zero value has nothing to wait for.
// It is a plain value, safe to persist as JSON.
type FinishGate struct {
	// Waiting lists the children that have not reported yet.
	Waiting []string `json:"waiting"`
}

// NewFinishGate starts a gate for the children that will save
// asynchronously (those whose request_finished asked to delay the free).
// Duplicate names are kept once.
func NewFinishGate(asyncChildren []string) FinishGate {
	var g FinishGate
	for _, c := range asyncChildren {
		if !g.waitingFor(c) {
			g.Waiting = append(g.Waiting, c)
		}
	}
	return g
}

// Done reports whether no child is left to report. A gate created with no
// asynchronous children is done at once: the request's blocks are freed now.
func (g *FinishGate) Done() bool { return len(g.Waiting) == 0 }

// Report records that child has finished sending. It returns true exactly
// once: when the last waited-for child reports. Repeated or unknown reports
// change nothing and return false.
func (g *FinishGate) Report(child string) bool {
	for i, c := range g.Waiting {
		if c == child {
			g.Waiting = append(g.Waiting[:i], g.Waiting[i+1:]...)
			return len(g.Waiting) == 0
		}
	}
	return false
}

// waitingFor reports whether child has yet to report.
func (g *FinishGate) waitingFor(child string) bool {
	for _, c := range g.Waiting {
		if c == child {
			return true
		}
	}
	return false
}
