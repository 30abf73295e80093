package api

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"

	"github.com/go-chi/chi/v5"

	"github.com/kvmesh/kvmesh/pkg/adminapi"
	"github.com/kvmesh/kvmesh/pkg/database"
	"github.com/kvmesh/kvmesh/pkg/httpserver"
)

// Outbox is what the outbox routes need of the outbox relay
// (database.Relay satisfies it).
type Outbox interface {
	// FailedRows returns at most limit failed rows with ids above after.
	FailedRows(ctx context.Context, after int64, limit int) ([]database.FailedRow, error)
	// RetryFailed puts failed row id back on the relay path.
	RetryFailed(ctx context.Context, id int64) error
}

// FailedPage is one page of GET /v1/outbox/failed: the failed rows in id
// order.
type FailedPage = adminapi.Page[database.FailedRow]

// RetryAnswer is the answer of POST /v1/outbox/{id}/retry.
type RetryAnswer = adminapi.RetryAnswer

// outboxCursor is the position of a page of failed rows.
type outboxCursor struct {
	After int64 `json:"after"`
}

func (a *API) listFailed(w http.ResponseWriter, r *http.Request) {
	limit, ok := httpserver.PageLimit(w, r)
	if !ok {
		return
	}
	var c outboxCursor
	present, ok := httpserver.PageCursor(w, r, &c)
	if !ok {
		return
	}
	if present && c.After < 1 {
		v := r.URL.Query().Get(httpserver.ParamCursor)
		httpserver.BadParameter(w, r, httpserver.ParamCursor, fmt.Sprintf("cursor %q is %s", v, httpserver.ErrBadCursor))
		return
	}
	rows, err := a.outbox.FailedRows(r.Context(), c.After, limit+1) // one more tells whether a next page exists
	if err != nil {
		a.internal(w, r, err)
		return
	}
	page := FailedPage{Items: rows}
	if page.Items == nil {
		page.Items = []database.FailedRow{}
	}
	if len(rows) > limit {
		page.Items = rows[:limit]
		page.NextCursor = httpserver.EncodeCursor(outboxCursor{After: rows[limit-1].ID})
	}
	a.write(w, page)
}

func (a *API) retryFailed(w http.ResponseWriter, r *http.Request) {
	id, err := strconv.ParseInt(chi.URLParam(r, "id"), 10, 64)
	if err != nil || id < 1 {
		httpserver.BadParameter(w, r, "id", "id is not a positive integer")
		return
	}
	err = a.outbox.RetryFailed(r.Context(), id)
	switch {
	case errors.Is(err, database.ErrOutboxRowNotFound):
		httpserver.WriteProblem(w, r, http.StatusNotFound, "", fmt.Sprintf("no outbox row %d", id), nil)
	case errors.Is(err, database.ErrOutboxRowNotFailed):
		httpserver.WriteProblem(w, r, http.StatusConflict, "", fmt.Sprintf("outbox row %d is not failed (pending or sent)", id), nil)
	case err != nil:
		a.internal(w, r, err)
	default:
		a.log.InfoContext(r.Context(), "failed outbox row put back on the relay path", "id", id)
		a.write(w, RetryAnswer{ID: id, Status: "pending"})
	}
}
