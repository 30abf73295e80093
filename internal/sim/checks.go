package sim

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strings"
)

// pageLimit is the page size the checks ask the admin APIs for.
const pageLimit = 1000

// maxPages bounds how many pages a check reads.
const maxPages = 100

// TrackerCheck is the scheduler's view of the run's requests after the run:
// every tracker must be done with no task outstanding.
type TrackerCheck struct {
	// Checked counts the run's trackers the scheduler lists.
	Checked int `json:"checked"`
	// NotDone lists trackers in another state or with tasks outstanding.
	NotDone []string `json:"not_done"`
	// Missing counts run requests the scheduler does not list.
	Missing int `json:"missing"`
	// Error says why the check could not run.
	Error string `json:"error,omitempty"`
	// OK is set when every request's tracker is done.
	OK bool `json:"ok"`
}

// DLQCheck is the sender's dead-letter queue for the run's requests.
type DLQCheck struct {
	// Entries counts dead letters of the run's requests.
	Entries int `json:"entries"`
	// Reasons counts them by reason.
	Reasons map[string]int `json:"reasons"`
	// Unlisted lists requests whose results report dead-lettered keys but
	// that have no entry in GET /v1/dlq.
	Unlisted []string `json:"unlisted"`
	// Error says why the check could not run.
	Error string `json:"error,omitempty"`
	// OK is set when every dead-lettered save is visible in the DLQ.
	OK bool `json:"ok"`
}

// trackerSummary is one item of the scheduler's GET /v1/requests.
type trackerSummary struct {
	EngineID     string `json:"engine_id"`
	RequestID    string `json:"request_id"`
	State        string `json:"state"`
	Error        string `json:"error"`
	TasksPending int    `json:"tasks_outstanding"`
}

// checkTrackers lists the scheduler's trackers of each engine (from any of
// its replicas) and checks those of the run.
func checkTrackers(ctx context.Context, hc *http.Client, reps *replicas, engines []string, prefix string, want int) TrackerCheck {
	c := TrackerCheck{NotDone: []string{}}
	for _, e := range engines {
		err := pages(ctx, hc, reps, "/v1/requests", url.Values{"engine_id": {e}}, func(items []trackerSummary) {
			for _, s := range items {
				if !strings.HasPrefix(s.RequestID, prefix) {
					continue
				}
				c.Checked++
				if s.State != "done" || s.TasksPending != 0 {
					c.NotDone = append(c.NotDone, fmt.Sprintf("%s/%s: %s, %d tasks outstanding %s", s.EngineID, s.RequestID, s.State, s.TasksPending, s.Error))
				}
			}
		})
		if err != nil {
			c.Error = err.Error()
			return c
		}
	}
	c.Missing = max(0, want-c.Checked)
	c.OK = len(c.NotDone) == 0 && c.Missing == 0
	return c
}

// deadLetter is one item of the sender's GET /v1/dlq.
type deadLetter struct {
	Reason    string `json:"reason"`
	RequestID string `json:"request_id"`
	EngineID  string `json:"engine_id"`
	Group     *int   `json:"group"`
}

// checkDLQ lists the sender's dead letters of each engine (from any of its
// replicas) and checks that every request whose save results report
// dead-lettered keys has one.
func checkDLQ(ctx context.Context, hc *http.Client, reps *replicas, engines []string, prefix string, deadLettered []string) DLQCheck {
	c := DLQCheck{Reasons: map[string]int{}, Unlisted: []string{}}
	listed := map[string]bool{}
	for _, e := range engines {
		err := pages(ctx, hc, reps, "/v1/dlq", url.Values{"engine_id": {e}}, func(items []deadLetter) {
			for _, d := range items {
				if strings.HasPrefix(d.RequestID, prefix) {
					c.Entries++
					c.Reasons[d.Reason]++
					listed[d.EngineID+"/"+d.RequestID] = true
				}
			}
		})
		if err != nil {
			c.Error = err.Error()
			return c
		}
	}
	for _, k := range deadLettered {
		if !listed[k] {
			c.Unlisted = append(c.Unlisted, k)
		}
	}
	slices.Sort(c.Unlisted)
	c.OK = len(c.Unlisted) == 0
	return c
}

// pages reads every page of a paginated admin list ({items, next_cursor})
// at path; each page comes from whichever replica answers (the cursor is
// the shared database's).
func pages[T any](ctx context.Context, hc *http.Client, reps *replicas, path string, q url.Values, use func([]T)) error {
	q.Set("limit", fmt.Sprint(pageLimit))
	for range maxPages {
		var page struct {
			Items      []T    `json:"items"`
			NextCursor string `json:"next_cursor"`
		}
		err := reps.do(ctx, replicaDown, func(base string) error {
			page.Items, page.NextCursor = nil, ""
			return getJSON(ctx, hc, base+path+"?"+q.Encode(), &page)
		})
		if err != nil {
			return err
		}
		use(page.Items)
		if page.NextCursor == "" {
			return nil
		}
		q.Set("cursor", page.NextCursor)
	}
	return fmt.Errorf("%s: more than %d pages: %w", path, maxPages, ErrHTTP)
}
