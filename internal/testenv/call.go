package testenv

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"testing"
)

// Call sends one request without a body, with token as its bearer token
// unless empty, on a connection of its own (so that a service restarted on
// the same address is never asked over a stale one), and returns the
// status and the body; a failed request fails t.
func Call(t testing.TB, method, url, token string) (int, []byte) {
	t.Helper()
	req, err := http.NewRequestWithContext(context.Background(), method, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Close = true
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("%s %s: read body: %v", method, url, err)
	}
	return resp.StatusCode, body
}

// CallJSON is Call that decodes the JSON (or problem) answer into out
// unless out is nil, and returns the status; an undecodable answer fails
// t.
func CallJSON(t testing.TB, method, url, token string, out any) int {
	t.Helper()
	status, body := Call(t, method, url, token)
	if out != nil {
		if err := json.Unmarshal(body, out); err != nil {
			t.Fatalf("%s %s: %d %s: %v", method, url, status, body, err)
		}
	}
	return status
}
