package testenv

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"testing"
)

// CallJSON sends one request without a body, with token as its bearer
// token unless empty, decodes the JSON (or problem) answer into out unless
// out is nil, and returns the status; a failed request or an undecodable
// answer fails t.
func CallJSON(t testing.TB, method, url, token string, out any) int {
	t.Helper()
	req, err := http.NewRequestWithContext(context.Background(), method, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	if out != nil {
		if err := json.Unmarshal(body, out); err != nil {
			t.Fatalf("%s %s: %d %s: %v", method, url, resp.StatusCode, body, err)
		}
	}
	return resp.StatusCode
}
