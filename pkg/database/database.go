// Package database is kvmesh's PostgreSQL foundation: a pgx connection pool
// with sane defaults, schema migrations (golang-migrate behind an advisory
// lock, safe under concurrent starts), and a transactional outbox (Enqueue plus Relay) that
// publishes messages written in a service's transaction to the bus.
package database

import "errors"

// Sentinel errors returned (wrapped) by this package.
var (
	// ErrBadMigrationName reports a *.sql file whose name is not NNNN_name.(up|down).sql.
	ErrBadMigrationName = errors.New("malformed migration file name")
	// ErrMigrationSequence reports duplicate, missing or out-of-sequence migration versions.
	ErrMigrationSequence = errors.New("bad migration sequence")
	// ErrUnknownMigration reports an applied version with no migration file to revert it.
	ErrUnknownMigration = errors.New("applied migration has no file")
	// ErrInvalidSteps reports a non-positive step count for MigrateDown.
	ErrInvalidSteps = errors.New("steps must be positive")
	// ErrDirtyMigration reports a schema version a failed migration left dirty.
	ErrDirtyMigration = errors.New("migration failed and left the schema version dirty")
	// ErrNotMigrated reports a database that lacks migrations the binary expects.
	ErrNotMigrated = errors.New("database is not migrated")
	// ErrEmptyTopic reports an outbox message without a topic.
	ErrEmptyTopic = errors.New("message has no topic")
	// ErrOutboxRowNotFound reports an outbox id with no row.
	ErrOutboxRowNotFound = errors.New("no such outbox row")
	// ErrOutboxRowNotFailed reports a retry of an outbox row that is not failed.
	ErrOutboxRowNotFailed = errors.New("outbox row is not failed")
)
