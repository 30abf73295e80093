package kvcore

import (
	"errors"
	"slices"
	"strings"
	"testing"
	"unicode/utf8"
)

// TestDecodeSaveTaskIsStrict: a save task decodes to what was encoded,
// and anything that is not exactly one save-task object with its ids is
// refused as an invalid save task.
func TestDecodeSaveTaskIsStrict(t *testing.T) {
	want := &SaveTask{Schema: SchemaSaveTask, TaskID: "t1", EngineID: "e1", RequestID: "r1", Model: "m", Tenant: "a",
		Epoch: 2, Start: 16, End: 48, BlockTable: BlockTable{{1, NullBlock, 3}, {4}}, BlockHashes: []string{"aa", "bb"},
		TokenIDs: []uint32{7, 8}, LoraName: "sql"}
	good := want.AppendJSON(nil)
	got, err := DecodeSaveTask(good)
	if err != nil {
		t.Fatal(err)
	}
	if again := got.AppendJSON(nil); string(again) != string(good) {
		t.Fatalf("decoded and encoded again\n%s\nwant\n%s", again, good)
	}
	if got.BlockTable[0][1] != NullBlock || !slices.Equal(got.TokenIDs, want.TokenIDs) {
		t.Fatalf("decoded %+v", got)
	}
	for _, c := range []struct{ name, in string }{
		{"unknown field", `{"schema":"kvmesh.save_task.v1","task_id":"t","engine_id":"e","request_id":"r","model":"m","junk":1}`},
		{"trailing data", string(good) + ` {}`},
		{"two objects", string(good) + string(good)},
		{"another schema", `{"schema":"kvmesh.load_task.v1","task_id":"t","engine_id":"e","request_id":"r","model":"m"}`},
		{"missing request id", `{"schema":"kvmesh.save_task.v1","task_id":"t","engine_id":"e","model":"m"}`},
		{"not an object", `[1,2]`},
		{"wrong type", `{"schema":"kvmesh.save_task.v1","task_id":"t","engine_id":"e","request_id":"r","model":"m","start":"0"}`},
		{"truncated", string(good[:len(good)-1])},
		{"empty", ``},
		{"NUL and invalid UTF-8", "{\"schema\":\x00\xff}"},
	} {
		_, err := DecodeSaveTask([]byte(c.in))
		if !errors.Is(err, ErrInvalidSaveTask) {
			t.Errorf("%s: error %v, want ErrInvalidSaveTask", c.name, err)
			continue
		}
		if msg := err.Error(); strings.ContainsRune(msg, 0) || !utf8.ValidString(msg) {
			t.Errorf("%s: error text %q holds a NUL or invalid UTF-8: it must be storable", c.name, msg)
		}
	}
}
