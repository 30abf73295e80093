package kvmem

import (
	"encoding/json"
	"testing"
)

// TestCUDAHandleOffset: a handle's offset into its allocation travels in
// the registration (the Python connector sends it for tensors inside a
// larger CUDA allocation) and is absent, 0, for one at its base.
func TestCUDAHandleOffset(t *testing.T) {
	var reg Registration
	body := `{"kind":"cuda_ipc","path":"/dev/shm/x","layout":{"groups":[{"blocks":2,"regions":[8,8]}]},
		"handles":[[{"device":0,"handle":"AA==","offset":4096},{"device":0,"handle":"AA=="}]]}`
	if err := json.Unmarshal([]byte(body), &reg); err != nil {
		t.Fatal(err)
	}
	if got := []int64{reg.Handles[0][0].Offset, reg.Handles[0][1].Offset}; got[0] != 4096 || got[1] != 0 {
		t.Fatalf("offsets %v, want [4096 0]", got)
	}
	out, err := json.Marshal(reg.Handles[0][1])
	if err != nil || string(out) != `{"device":0,"handle":"AA=="}` {
		t.Fatalf("a handle at its allocation's base marshals as %s (%v), want no offset", out, err)
	}
}
