package kvcore

import (
	"errors"
	"fmt"
)

// Sentinel errors of the domain core.
var (
	// ErrEmptyHash is returned for a zero-length block hash.
	ErrEmptyHash = errors.New("empty block hash")
	// ErrUnknownModel is returned for a model name or preset kvmesh does not know.
	ErrUnknownModel = errors.New("unknown model")
	// ErrModelNotServed is returned for a model name a mesh does not serve
	// (Models.Get); it wraps ErrUnknownModel.
	ErrModelNotServed = fmt.Errorf("model not served: %w", ErrUnknownModel)
	// ErrDuplicateModel is returned for two served models of one name.
	ErrDuplicateModel = errors.New("model served twice")
	// ErrBadKey is returned for a string that is not a well-formed store key.
	ErrBadKey = errors.New("malformed store key")
	// ErrBadKeyPrefix is returned for a key prefix or model name that would
	// make store keys ambiguous.
	ErrBadKeyPrefix = errors.New("invalid store-key prefix")
	// ErrBadTenant is returned for a tenant that cannot be a store-key
	// segment (ValidateTenant).
	ErrBadTenant = errors.New("invalid tenant")
	// ErrBadEngineVersion is returned for an engine version that cannot be
	// stated (ValidateEngineVersion).
	ErrBadEngineVersion = errors.New("invalid engine version")
	// ErrEngineVersion is returned when an engine states a version other
	// than the one its model's spec pins (Model.CheckEngineVersion).
	ErrEngineVersion = errors.New("engine version does not match the model's")
	// ErrNegativeCount is returned for a negative token count.
	ErrNegativeCount = errors.New("negative token count")
	// ErrShortHashChain is returned when a request carries fewer block hashes
	// than its token count needs.
	ErrShortHashChain = errors.New("hash chain shorter than the tokens")
	// ErrAnswerCount is returned when a store's existence answers do not match
	// the keys asked, one for one.
	ErrAnswerCount = errors.New("existence answers do not match the keys")
	// ErrChunkOutOfRange is returned when a task's chunk does not fit its block
	// table, its hash chain or its group's block size.
	ErrChunkOutOfRange = errors.New("chunk does not fit the task")
	// ErrGroupCount is returned for a block table whose group count is not
	// the model's.
	ErrGroupCount = errors.New("block table group count does not match the model")
	// ErrExternalTokens is returned when an allocation's external-token count
	// does not fit the request's LoadSpec.
	ErrExternalTokens = errors.New("external tokens do not match the load spec")
	// ErrAllocatedTwice is returned for a second allocation in one scheduling
	// attempt (without a new lookup).
	ErrAllocatedTwice = errors.New("request already allocated")
	// ErrUnknownStep is returned for a step kind the tracker does not know.
	ErrUnknownStep = errors.New("unknown step kind")
	// ErrBadStep is returned for a step that does not fit the request's state,
	// e.g. a running step for a request never scheduled.
	ErrBadStep = errors.New("step does not fit the request state")
	// ErrRequestFinished is returned for a step after the request finished.
	ErrRequestFinished = errors.New("request already finished")
	// ErrUnknownSaveStatus is returned for a save result with an unknown status.
	ErrUnknownSaveStatus = errors.New("unknown save status")
	// ErrInvalidSaveTask is returned for a save-task payload that does not
	// decode strictly or lacks its schema or identifying fields.
	ErrInvalidSaveTask = errors.New("invalid save task")
	// ErrUnplannedKey is returned when a lookup plan asks a key its score
	// plan did not plan (a bug: a score plan covers every lookup key).
	ErrUnplannedKey = errors.New("lookup key outside the score plan")
)
