package kvcore

import (
	"errors"
	"fmt"
)

// MaxTokenIDs bounds the prompt token ids a request keeps (its first
// MaxTokenIDs tokens, rounded down to whole hash blocks: TokenPrefix).
// Every save task carries its request's tokens from token 0, and an
// engine's admitted event the whole list, so the bound keeps both well
// below the 1 MiB Kafka message limit beside the hash chain they already
// carry: a list of 32768 token ids is about 230 KB of JSON. The blocks
// past the bound keep token_ids [] in their BlockStored events.
const MaxTokenIDs = 32768

// TokenPrefix is what a request keeps of token ids at hashBlockSize: at
// most MaxTokenIDs of them, rounded down to whole hash blocks (tokens
// itself, not a copy).
func TokenPrefix(hashBlockSize int, tokens []uint32) []uint32 {
	if hashBlockSize <= 0 || len(tokens) <= MaxTokenIDs {
		return tokens
	}
	return tokens[:MaxTokenIDs/hashBlockSize*hashBlockSize]
}

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
