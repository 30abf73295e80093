package requeststate

import "github.com/kvmesh/kvmesh/pkg/kvcore"

// OnAdmitTokens records the prompt's token ids and LoRA adapter the engine
// admitted the request with (RequestEvent.TokenIDs, LoraName), which every
// save task carries for the KV events routers index; of a longer list it
// keeps the first MaxTokenIDs (TokenPrefix). Like the hash chain, the
// token list only grows: the tokens already held are never rewritten, so
// the ledger stores them once; a longer list appends its new tokens. An
// empty lora keeps the adapter recorded before.
func (t *Tracker) OnAdmitTokens(m *kvcore.Model, tokens []uint32, lora string) {
	tokens = kvcore.TokenPrefix(m.HashBlockSize, tokens)
	if len(tokens) > len(t.TokenIDs) {
		t.TokenIDs = append(t.TokenIDs, tokens[len(t.TokenIDs):]...)
	}
	if lora != "" {
		t.LoraName = lora
	}
}

// taskTokens is the token list of a save task whose hash chain covers
// hashes hash blocks: the tracker's tokens of those blocks (a copy, so a
// task never aliases the tracker), nil when it holds none.
func (t *Tracker) taskTokens(m *kvcore.Model, hashes int) []uint32 {
	n := min(len(t.TokenIDs), hashes*m.HashBlockSize)
	if n <= 0 {
		return nil
	}
	return append([]uint32(nil), t.TokenIDs[:n]...)
}
