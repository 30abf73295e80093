package sim

import (
	"fmt"
	"slices"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// tokenClaim is one BlockStored event of a run request that carried
// token_ids: the full hashes of its blocks (the record's headers), its
// block size and its tokens, checked against the request's prompt tokens
// once every record was read (a KV event may be read before its task).
type tokenClaim struct {
	engine, request string
	hashes          []string
	blockSize       int
	tokens          []uint32
}

// taskTokens records the token ids a save task carries, the longest list
// of its request; l.mu must be held.
func (l *ledger) taskTokens(t *kvcore.SaveTask) {
	k := t.EngineID + "/" + t.RequestID
	if len(t.TokenIDs) > len(l.tokens[k]) {
		l.tokens[k] = t.TokenIDs
	}
}

// eventTokens records the events of a BlockStored record that carry
// token_ids; l.mu must be held. rec.Hashes are the events' blocks in
// order.
func (l *ledger) eventTokens(rec contract.KVEventRecord) {
	at := 0
	for _, e := range rec.Batch.Events {
		n := len(e.BlockHashes)
		if at+n > len(rec.Hashes) {
			return // no full hashes for the rest: nothing to check them by
		}
		if len(e.TokenIDs) > 0 {
			l.tokenEvents++
			l.claims = append(l.claims, tokenClaim{engine: rec.EngineID, request: rec.RequestID,
				hashes: rec.Hashes[at : at+n], blockSize: e.BlockSize, tokens: e.TokenIDs})
		}
		at += n
	}
}

// tokenDifferences checks every recorded event's token_ids: exactly its
// blocks' prompt tokens, block by block (a block keyed by the hash at
// chain index i holds tokens [(i+1)·hash_block_size − block_size,
// (i+1)·hash_block_size)), from the tokens the request's save tasks
// carried. The first maxListed problems are listed; l.mu must be held.
func (l *ledger) tokenDifferences() []LedgerDifference {
	var out []LedgerDifference
	for _, c := range l.claims {
		if p := l.claimProblem(c); p != "" && len(out) < maxListed {
			out = append(out, LedgerDifference{EngineID: c.engine, RequestID: c.request, Problem: p})
		}
	}
	return out
}

// claimProblem says what is wrong with one event's token_ids ("": nothing).
func (l *ledger) claimProblem(c tokenClaim) string {
	hbs, bs := l.model.HashBlockSize, c.blockSize
	if bs <= 0 || len(c.tokens) != len(c.hashes)*bs {
		return fmt.Sprintf("BlockStored event of %d blocks of %d tokens carries %d token ids", len(c.hashes), bs, len(c.tokens))
	}
	prompt := l.tokens[c.engine+"/"+c.request]
	for i, h := range c.hashes {
		idx, ok := l.hashIndex[h]
		end := (idx + 1) * hbs
		if !ok || end < bs || end > len(prompt) {
			return fmt.Sprintf("BlockStored event carries token ids for block %s, which no save task's tokens cover", h)
		}
		if !slices.Equal(c.tokens[i*bs:(i+1)*bs], prompt[end-bs:end]) {
			return fmt.Sprintf("BlockStored event's token ids of block %s are not the prompt's tokens [%d,%d)", h, end-bs, end)
		}
	}
	return ""
}
