package api

import (
	"github.com/kvmesh/kvmesh/pkg/adminapi"
	"github.com/kvmesh/kvmesh/services/scheduler/requeststate"
)

// toAPITracker is a tracker's API form (nil for nil): the edge between the
// state machine's Tracker and the admin API's answer.
func toAPITracker(t *requeststate.Tracker) *adminapi.Tracker {
	if t == nil {
		return nil
	}
	return &adminapi.Tracker{
		EngineID:       t.EngineID,
		RequestID:      t.RequestID,
		Model:          t.Model,
		Tenant:         t.Tenant,
		Connector:      t.Connector,
		Remote:         t.Remote,
		Consumer:       t.Consumer,
		State:          string(t.State),
		Error:          t.Error,
		TokenLen:       t.TokenLen,
		PrefillEnd:     t.PrefillEnd,
		PromptTokens:   t.PromptTokens,
		TailSaved:      t.TailSaved,
		Table:          t.Table,
		NumSavedTokens: t.NumSavedTokens,
		SaveSpans:      apiSlice(t.SaveSpans, func(s requeststate.SaveSpan) adminapi.SaveSpan { return adminapi.SaveSpan(s) }),
		Unsaved:        apiSlice(t.Unsaved, func(s requeststate.SaveSpan) adminapi.SaveSpan { return adminapi.SaveSpan(s) }),
		SaveJobs:       t.SaveJobs,
		Hashes:         t.Hashes,
		TokenIDs:       t.TokenIDs,
		LoraName:       t.LoraName,
		Load:           adminapi.TrackerLoad(t.Load),
		Seq:            t.Seq,
		Epoch:          t.Epoch,
		PendingSaves:   t.PendingSaves,
		PendingLoads:   t.PendingLoads,
		StaleSaves:     t.StaleSaves,
		StaleLoads:     t.StaleLoads,
		LoadWaits:      apiSlice(t.LoadWaits, func(w requeststate.LoadWait) adminapi.LoadWait { return adminapi.LoadWait(w) }),
		Reports:        t.Reports,
	}
}

// toAPIHeld is a held allocation's API form (nil for nil).
func toAPIHeld(h *requeststate.Held) *adminapi.Held {
	if h == nil {
		return nil
	}
	return &adminapi.Held{Alloc: h.Alloc, Events: h.Events}
}

// apiSlice converts each element of in with f (nil for nil).
func apiSlice[A, B any](in []A, f func(A) B) []B {
	if in == nil {
		return nil
	}
	out := make([]B, len(in))
	for i, v := range in {
		out[i] = f(v)
	}
	return out
}
