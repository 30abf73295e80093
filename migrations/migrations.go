// Package migrations holds kvmesh's PostgreSQL schema as numbered SQL files,
// embedded into the binary so every service can bring its database up to date
// at start (see database.Migrate).
//
// Files are named NNNN_name.up.sql and NNNN_name.down.sql, numbered from 0001
// without gaps. Each up file runs in one transaction together with the record
// of its version in schema_migrations, so it must not contain statements that
// cannot run inside a transaction (such as CREATE INDEX CONCURRENTLY).
package migrations

import "embed"

// FS holds every *.sql migration file at its root.
//
//go:embed *.sql
var FS embed.FS
