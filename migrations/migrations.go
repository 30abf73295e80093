// Package migrations holds kvmesh's PostgreSQL schema as numbered SQL files,
// embedded into the binary so every service can bring its database up to date
// at start (see database.Migrate).
//
// Files are named NNNN_name.up.sql and NNNN_name.down.sql (golang-migrate's
// naming), numbered from 0001 without gaps. golang-migrate sends each file as
// one statement batch, which Postgres runs as one implicit transaction, so a
// file must not contain BEGIN/COMMIT or statements that cannot run inside a
// transaction (such as CREATE INDEX CONCURRENTLY). A file that fails leaves
// its version dirty in schema_version; `kvmesh migrate -force N` records the
// repaired version.
package migrations

import "embed"

// FS holds every *.sql migration file at its root.
//
//go:embed *.sql
var FS embed.FS
