package kvcore

// Chunk is one block of one group: the tokens [Start, End) it covers.
type Chunk struct {
	// Start is the first token of the chunk.
	Start int `json:"start"`
	// End is one past the last token of the chunk.
	End int `json:"end"`
}

// HashIndex is the index, in the request's hash chain, of the chunk's last
// hash-block; the chunk's store key uses that hash.
func (c Chunk) HashIndex(hashBlockSize int) int { return c.End/hashBlockSize - 1 }

// BlockIndex is the position of the chunk in its group's block table.
func (c Chunk) BlockIndex(blockSize int) int { return c.Start / blockSize }

// Chunks returns the whole blocks of size bs inside the token range
// [start, end): from start rounded up to end rounded down.
func Chunks(start, end, bs int) []Chunk {
	if bs <= 0 || start < 0 {
		return nil
	}
	first := (start + bs - 1) / bs * bs
	last := end / bs * bs
	var out []Chunk
	for s := first; s+bs <= last; s += bs {
		out = append(out, Chunk{Start: s, End: s + bs})
	}
	return out
}

// Reaches reports whether a group needs chunk c to resume computation at
// token h: every chunk before h for full attention and MLA; for a sliding
// window, the chunks ending within the last Window tokens before h; for
// Mamba, only the chunk that ends exactly at h (the state at h).
func (g Group) Reaches(c Chunk, h int) bool {
	if c.End > h {
		return false
	}
	switch g.Kind {
	case KindSlidingWindow:
		return c.End > h-g.Window
	case KindMamba:
		return c.End == h
	default:
		return true
	}
}

// SaveChunks returns the chunks of group g that a save of tokens
// [saved, end) stores: those of the range that a later request resuming at
// end needs (see Group.Reaches). end is expected to be aligned to the
// scheduler block size.
func (m *Model) SaveChunks(g, saved, end int) []Chunk {
	grp := m.Groups[g]
	var out []Chunk
	for _, c := range Chunks(saved, end, grp.BlockSize) {
		if grp.Reaches(c, end) {
			out = append(out, c)
		}
	}
	return out
}
