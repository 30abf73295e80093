package sim

import (
	"fmt"
	"math"
	"math/rand/v2"
	"strconv"
	"strings"
	"time"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// Range is an inclusive integer range [Min, Max], drawn uniformly.
type Range struct {
	// Min is the smallest value drawn.
	Min int `json:"min"`
	// Max is the largest value drawn.
	Max int `json:"max"`
}

// ParseRange reads "N" (Min = Max = N) or "MIN-MAX".
func ParseRange(s string) (Range, error) {
	lo, hi, found := strings.Cut(strings.TrimSpace(s), "-")
	a, err := strconv.Atoi(lo)
	if err != nil {
		return Range{}, fmt.Errorf("range %q: %w", s, ErrWorkload)
	}
	b := a
	if found {
		if b, err = strconv.Atoi(hi); err != nil {
			return Range{}, fmt.Errorf("range %q: %w", s, ErrWorkload)
		}
	}
	r := Range{Min: a, Max: b}
	return r, r.validate("range")
}

// String writes the range as ParseRange reads it.
func (r Range) String() string {
	if r.Min == r.Max {
		return strconv.Itoa(r.Min)
	}
	return strconv.Itoa(r.Min) + "-" + strconv.Itoa(r.Max)
}

func (r Range) validate(name string) error {
	if r.Min < 0 || r.Max < r.Min {
		return fmt.Errorf("%s %s: want 0 ≤ min ≤ max: %w", name, r, ErrWorkload)
	}
	return nil
}

func (r Range) draw(rng *rand.Rand) int { return r.Min + rng.IntN(r.Max-r.Min+1) }

// Workload describes the multi-turn chats the simulator plays: every
// conversation opens with one of a few shared system prompts, and each turn's
// prompt is the whole conversation so far plus a new user message, so turns
// share their prefix with earlier turns and conversations share system
// prompts.
type Workload struct {
	// Requests is the total number of requests (turns over all conversations).
	Requests int `json:"requests"`
	// Turns is the number of turns per conversation.
	Turns Range `json:"turns"`
	// SystemPrompts is the number of distinct system prompts.
	SystemPrompts int `json:"system_prompts"`
	// SystemTokens is the length of a system prompt.
	SystemTokens Range `json:"system_tokens"`
	// UserTokens is the length of one user message.
	UserTokens Range `json:"user_tokens"`
	// OutputTokens is the length of one reply.
	OutputTokens Range `json:"output_tokens"`
	// Rate is the number of conversations started per second (Poisson
	// arrivals); 0 starts them all at once.
	Rate float64 `json:"rate"`
	// ThinkTime is the pause between a reply and the conversation's next turn.
	ThinkTime time.Duration `json:"think_time"`
	// Seed makes the workload reproducible.
	Seed uint64 `json:"seed"`
	// Vocab is the token-id range [0, Vocab).
	Vocab int `json:"vocab"`
	// Tenants is the number of tenants the conversations belong to,
	// assigned round robin (conversation i to TenantName(TenantPrefix,
	// i mod Tenants)); 0 or 1 plays no tenant at all, as before. Every
	// request of a conversation names its tenant in its lookup and its
	// admitted event, so tenants share no store keys, even for identical
	// prompts.
	Tenants int `json:"tenants,omitempty"`
	// TenantPrefix names the tenants (TenantName); empty is
	// DefaultTenantPrefix. Two runs of one workload with different prefixes
	// play the same prompts as different tenants.
	TenantPrefix string `json:"tenant_prefix,omitempty"`
}

// DefaultTenantPrefix is the tenant prefix of a workload that sets none.
const DefaultTenantPrefix = "tenant-"

// TenantName is the name of tenant i under prefix (DefaultTenantPrefix when
// empty): the prefix and i in decimal, e.g. "tenant-0".
func TenantName(prefix string, i int) string {
	if prefix == "" {
		prefix = DefaultTenantPrefix
	}
	return prefix + strconv.Itoa(i)
}

// tenantOf is the tenant of conversation conv: none with fewer than two
// tenants.
func (w Workload) tenantOf(conv int) string {
	if w.Tenants < 2 {
		return ""
	}
	return TenantName(w.TenantPrefix, conv%w.Tenants)
}

// Validate reports a workload that cannot be generated.
func (w Workload) Validate() error {
	switch {
	case w.Requests < 1:
		return fmt.Errorf("requests %d: want at least 1: %w", w.Requests, ErrWorkload)
	case w.Turns.Min < 1:
		return fmt.Errorf("turns %s: want at least 1: %w", w.Turns, ErrWorkload)
	case w.SystemPrompts < 1:
		return fmt.Errorf("system prompts %d: want at least 1: %w", w.SystemPrompts, ErrWorkload)
	case w.UserTokens.Min < 1 || w.OutputTokens.Min < 1:
		return fmt.Errorf("user and output tokens must be at least 1: %w", ErrWorkload)
	case w.Rate < 0 || math.IsInf(w.Rate, 0) || math.IsNaN(w.Rate):
		return fmt.Errorf("rate %v: %w", w.Rate, ErrWorkload)
	case w.ThinkTime < 0:
		return fmt.Errorf("think time %v: %w", w.ThinkTime, ErrWorkload)
	case w.Vocab < 2:
		return fmt.Errorf("vocab %d: %w", w.Vocab, ErrWorkload)
	case w.Tenants < 0:
		return fmt.Errorf("tenants %d: want 0 or more: %w", w.Tenants, ErrWorkload)
	}
	if w.Tenants >= 2 {
		if err := kvcore.ValidateTenant(TenantName(w.TenantPrefix, w.Tenants-1)); err != nil {
			return fmt.Errorf("tenant prefix %q: %w: %w", w.TenantPrefix, err, ErrWorkload)
		}
	}
	for name, r := range map[string]Range{"turns": w.Turns, "system tokens": w.SystemTokens, "user tokens": w.UserTokens, "output tokens": w.OutputTokens} {
		if err := r.validate(name); err != nil {
			return err
		}
	}
	return nil
}

// Conversation is one generated chat.
type Conversation struct {
	// Index numbers the conversation from 0.
	Index int
	// Start is when the first turn arrives, from the start of the run.
	Start time.Duration
	// System is the system prompt's tokens (shared with other conversations).
	System []uint32
	// Turns are the user messages and the replies the engine will generate.
	Turns []Turn
	// Tenant is the conversation's tenant (Workload.Tenants); empty for
	// none.
	Tenant string
}

// Turn is one user message and the reply to it.
type Turn struct {
	// User is the user message's tokens.
	User []uint32
	// Output is the reply the engine generates, token by token.
	Output []uint32
}

// Prompt is the prompt of turn t: the system prompt, every earlier turn
// with its reply, and turn t's user message.
func (c *Conversation) Prompt(t int) []uint32 {
	out := append([]uint32(nil), c.System...)
	for j := range t {
		out = append(out, c.Turns[j].User...)
		out = append(out, c.Turns[j].Output...)
	}
	return append(out, c.Turns[t].User...)
}

// Generate builds the conversations of w, reproducibly from w.Seed.
func Generate(w Workload) ([]*Conversation, error) {
	if err := w.Validate(); err != nil {
		return nil, err
	}
	rng := rand.New(rand.NewPCG(w.Seed, 0x6b766d657368)) // "kvmesh"
	systems := make([][]uint32, w.SystemPrompts)
	for i := range systems {
		systems[i] = tokens(rng, w.SystemTokens.draw(rng), w.Vocab)
	}
	var convs []*Conversation
	var at time.Duration
	for left := w.Requests; left > 0; {
		c := &Conversation{Index: len(convs), Start: at, System: systems[rng.IntN(len(systems))], Tenant: w.tenantOf(len(convs))}
		n := min(w.Turns.draw(rng), left)
		for range n {
			c.Turns = append(c.Turns, Turn{
				User:   tokens(rng, w.UserTokens.draw(rng), w.Vocab),
				Output: tokens(rng, w.OutputTokens.draw(rng), w.Vocab),
			})
		}
		left -= n
		convs = append(convs, c)
		if w.Rate > 0 {
			at += time.Duration(rng.ExpFloat64() / w.Rate * float64(time.Second))
		}
	}
	return convs, nil
}

func tokens(rng *rand.Rand, n, vocab int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(rng.IntN(vocab))
	}
	return out
}
