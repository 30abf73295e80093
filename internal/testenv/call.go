package testenv

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
)

// Call sends one request without a body, with token as its bearer token
// unless empty, on a connection of its own (so that a service restarted on
// the same address is never asked over a stale one), and returns the
// status and the body; a failed request fails t.
func Call(t testing.TB, method, url, token string) (int, []byte) {
	t.Helper()
	return CallBody(t, method, url, token, "")
}

// CallBody is Call with a JSON body (none when empty).
func CallBody(t testing.TB, method, url, token, body string) (int, []byte) {
	t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequestWithContext(context.Background(), method, url, rd)
	if err != nil {
		t.Fatal(err)
	}
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
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
	answer, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("%s %s: read body: %v", method, url, err)
	}
	return resp.StatusCode, answer
}

// CallJSON is Call that decodes the JSON (or problem) answer into out
// unless out is nil, and returns the status; an undecodable answer fails
// t.
func CallJSON(t testing.TB, method, url, token string, out any) int {
	t.Helper()
	return CallJSONBody(t, method, url, token, "", out)
}

// CallJSONBody is CallJSON with a JSON body (none when empty).
func CallJSONBody(t testing.TB, method, url, token, body string, out any) int {
	t.Helper()
	status, resp := CallBody(t, method, url, token, body)
	if out != nil {
		if err := json.Unmarshal(resp, out); err != nil {
			t.Fatalf("%s %s: %d %s: %v", method, url, status, resp, err)
		}
	}
	return status
}
