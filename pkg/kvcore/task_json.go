package kvcore

import (
	"encoding/json"
	"strconv"
	"unicode/utf8"
)

// A save task is most of the scheduler's outgoing bytes: its block table,
// hash chain and prompt token ids. encoding/json writes it by reflection,
// the token ids one reflected element at a time, and the table through
// BlockTable.MarshalJSON, whose output it then validates and compacts a
// second time. AppendJSON writes the same bytes in one pass; the tests
// hold it to encoding/json's output byte for byte.

// MarshalJSONFast returns t's JSON, exactly as encoding/json.Marshal
// writes it, in a buffer sized for it.
func (t *SaveTask) MarshalJSONFast() []byte {
	n := 256 + len(t.TaskID) + len(t.EngineID) + len(t.RequestID) + len(t.Model) + len(t.Tenant) + len(t.LoraName) +
		tableSizeHint(t.BlockTable) + 11*len(t.TokenIDs) + groupsSizeHint(t.Groups)
	for _, h := range t.BlockHashes {
		n += len(h) + 3
	}
	return t.AppendJSON(make([]byte, 0, n))
}

// tableSizeHint is about the JSON size of a table of ids below 10^7.
func tableSizeHint(t BlockTable) int {
	n := 2
	for _, g := range t {
		n += 3 + 8*len(g)
	}
	return n
}

// groupsSizeHint is about the JSON size of groups of chunks below 10^7
// tokens.
func groupsSizeHint(groups []GroupChunks) int {
	n := 2
	for _, g := range groups {
		n += 24 + 32*len(g.Chunks)
	}
	return n
}

// AppendJSON appends t's JSON, exactly as encoding/json.Marshal writes it,
// to buf.
func (t *SaveTask) AppendJSON(buf []byte) []byte {
	buf = append(buf, `{"schema":`...)
	buf = appendJSONString(buf, t.Schema)
	buf = appendTaskHead(buf, t.TaskID, t.EngineID, t.RequestID, t.Model, t.Tenant)
	buf = appendEpochRange(buf, t.Epoch, t.Start, t.End)
	buf = append(buf, `,"block_table":`...)
	buf = t.BlockTable.AppendJSON(buf)
	buf = append(buf, `,"block_hashes":`...)
	buf = appendJSONStrings(buf, t.BlockHashes)
	if len(t.TokenIDs) > 0 {
		buf = append(buf, `,"token_ids":[`...)
		for i, v := range t.TokenIDs {
			if i > 0 {
				buf = append(buf, ',')
			}
			buf = strconv.AppendUint(buf, uint64(v), 10)
		}
		buf = append(buf, ']')
	}
	if t.LoraName != "" {
		buf = append(buf, `,"lora_name":`...)
		buf = appendJSONString(buf, t.LoraName)
	}
	buf = append(buf, `,"groups":`...)
	buf = appendGroupChunks(buf, t.Groups)
	return append(buf, '}')
}

// AppendJSON appends t's JSON, exactly as encoding/json.Marshal writes it,
// to buf.
func (t *LoadTask) AppendJSON(buf []byte) []byte {
	buf = append(buf, `{"schema":`...)
	buf = appendJSONString(buf, t.Schema)
	buf = appendTaskHead(buf, t.TaskID, t.EngineID, t.RequestID, t.Model, t.Tenant)
	buf = append(buf, `,"connector":`...)
	buf = appendJSONString(buf, t.Connector)
	buf = appendEpochRange(buf, t.Epoch, t.Start, t.End)
	buf = append(buf, `,"block_table":`...)
	buf = t.BlockTable.AppendJSON(buf)
	buf = append(buf, `,"block_hashes":`...)
	buf = appendJSONStrings(buf, t.BlockHashes)
	buf = append(buf, `,"groups":`...)
	buf = appendGroupChunks(buf, t.Groups)
	if t.Remote != nil {
		buf = append(buf, `,"remote":{"engine_id":`...)
		buf = appendJSONString(buf, t.Remote.EngineID)
		buf = append(buf, `,"block_table":`...)
		buf = t.Remote.BlockTable.AppendJSON(buf)
		buf = append(buf, '}')
	}
	if len(t.Ranks) > 0 {
		buf = append(buf, `,"ranks":[`...)
		for i, r := range t.Ranks {
			if i > 0 {
				buf = append(buf, ',')
			}
			buf = append(buf, `{"tp":`...)
			buf = strconv.AppendInt(buf, int64(r.TP), 10)
			buf = append(buf, `,"pcp":`...)
			buf = strconv.AppendInt(buf, int64(r.PCP), 10)
			buf = append(buf, `,"dcp":`...)
			buf = strconv.AppendInt(buf, int64(r.DCP), 10)
			buf = append(buf, `,"pp":`...)
			buf = strconv.AppendInt(buf, int64(r.PP), 10)
			buf = append(buf, '}')
		}
		buf = append(buf, ']')
	}
	return append(buf, '}')
}

// appendTaskHead appends the identifying fields both task kinds share.
func appendTaskHead(buf []byte, taskID, engineID, requestID, model, tenant string) []byte {
	buf = append(buf, `,"task_id":`...)
	buf = appendJSONString(buf, taskID)
	buf = append(buf, `,"engine_id":`...)
	buf = appendJSONString(buf, engineID)
	buf = append(buf, `,"request_id":`...)
	buf = appendJSONString(buf, requestID)
	buf = append(buf, `,"model":`...)
	buf = appendJSONString(buf, model)
	if tenant != "" {
		buf = append(buf, `,"tenant":`...)
		buf = appendJSONString(buf, tenant)
	}
	return buf
}

// appendEpochRange appends epoch (omitted when 0), start and end.
func appendEpochRange(buf []byte, epoch, start, end int) []byte {
	if epoch != 0 {
		buf = append(buf, `,"epoch":`...)
		buf = strconv.AppendInt(buf, int64(epoch), 10)
	}
	buf = append(buf, `,"start":`...)
	buf = strconv.AppendInt(buf, int64(start), 10)
	buf = append(buf, `,"end":`...)
	return strconv.AppendInt(buf, int64(end), 10)
}

// appendGroupChunks appends groups as encoding/json writes []GroupChunks.
func appendGroupChunks(buf []byte, groups []GroupChunks) []byte {
	if groups == nil {
		return append(buf, "null"...)
	}
	buf = append(buf, '[')
	for i, g := range groups {
		if i > 0 {
			buf = append(buf, ',')
		}
		buf = append(buf, `{"group":`...)
		buf = strconv.AppendInt(buf, int64(g.Group), 10)
		buf = append(buf, `,"chunks":`...)
		if g.Chunks == nil {
			buf = append(buf, "null"...)
		} else {
			buf = append(buf, '[')
			for j, c := range g.Chunks {
				if j > 0 {
					buf = append(buf, ',')
				}
				buf = append(buf, `{"start":`...)
				buf = strconv.AppendInt(buf, int64(c.Start), 10)
				buf = append(buf, `,"end":`...)
				buf = strconv.AppendInt(buf, int64(c.End), 10)
				buf = append(buf, '}')
			}
			buf = append(buf, ']')
		}
		buf = append(buf, '}')
	}
	return append(buf, ']')
}

// appendJSONStrings appends ss as encoding/json writes []string.
func appendJSONStrings(buf []byte, ss []string) []byte {
	if ss == nil {
		return append(buf, "null"...)
	}
	buf = append(buf, '[')
	for i, s := range ss {
		if i > 0 {
			buf = append(buf, ',')
		}
		buf = appendJSONString(buf, s)
	}
	return append(buf, ']')
}

// appendJSONString appends s quoted as encoding/json writes it: a string
// of printable ASCII needing no escape (hex hashes, ids) directly, any
// other through encoding/json itself (its HTML escaping, its replacement
// of invalid UTF-8).
func appendJSONString(buf []byte, s string) []byte {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 || c >= utf8.RuneSelf || c == '"' || c == '\\' || c == '<' || c == '>' || c == '&' {
			b, _ := json.Marshal(s) // a string always encodes
			return append(buf, b...)
		}
	}
	buf = append(buf, '"')
	buf = append(buf, s...)
	return append(buf, '"')
}
