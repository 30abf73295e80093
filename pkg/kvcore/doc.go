// Package kvcore is kvmesh's domain core: everything the four services decide
// about a request's KV cache, as pure functions and values with no I/O, no
// goroutines and no globals.
//
// It holds the model spec (KV-cache groups, block sizes, rank namespaces),
// chained block hashing, Mooncake-layout store keys, lookup planning with the
// hybrid longest-hit and full-hit rules, group-aware scoring of a prompt for
// routers (ScorePlan: the hybrid hit beside each group's own counts and the
// count of a router that folds the groups together), MultiConnector selection, the
// wire vocabulary of a request's engine steps, feedback and save reports (the
// state machine that applies them is the scheduler's
// services/scheduler/requeststate), save-task validation with stable reason codes, and chunk planning for send and
// receive. The behaviour follows vLLM's connectors as docs/architecture.md
// describes them.
package kvcore
