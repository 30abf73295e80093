package kvcore

import (
	"errors"
	"fmt"
)

// ErrBadTokenIDs reports a token list that does not fit its request: not
// whole hash blocks, or longer than its hash chain or its prompt covers.
var ErrBadTokenIDs = errors.New("token ids do not fit the hash chain")

// CheckTokenIDs checks a token list of n tokens against a hash chain of
// hashes hashes at hashBlockSize: a request's token ids (the engine's
// prompt tokens, RequestEvent.TokenIDs, SaveTask.TokenIDs) are the tokens
// of complete hash blocks only, so n is a multiple of hashBlockSize and at
// most hashes*hashBlockSize. An empty list always fits.
func CheckTokenIDs(hashBlockSize, n, hashes int) error {
	switch {
	case n == 0:
		return nil
	case hashBlockSize <= 0:
		return fmt.Errorf("%d token ids with hash block size %d: %w", n, hashBlockSize, ErrBadTokenIDs)
	case n%hashBlockSize != 0:
		return fmt.Errorf("%d token ids are not whole hash blocks of %d tokens: %w", n, hashBlockSize, ErrBadTokenIDs)
	case n > hashes*hashBlockSize:
		return fmt.Errorf("%d token ids, the %d block hashes cover %d: %w", n, hashes, hashes*hashBlockSize, ErrBadTokenIDs)
	}
	return nil
}

// OnAdmitTokens records the prompt's token ids and LoRA adapter the engine
// admitted the request with (RequestEvent.TokenIDs, LoraName), which every
// save task carries for the KV events routers index. Like the hash chain,
// the token list only grows: the tokens already held are never rewritten,
// so the ledger stores them once; a longer list appends its new tokens.
// An empty lora keeps the adapter recorded before.
func (t *Tracker) OnAdmitTokens(tokens []uint32, lora string) {
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
func (t *Tracker) taskTokens(m *Model, hashes int) []uint32 {
	n := min(len(t.TokenIDs), hashes*m.HashBlockSize)
	if n <= 0 {
		return nil
	}
	return append([]uint32(nil), t.TokenIDs[:n]...)
}
