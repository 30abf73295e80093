package main

import (
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/kvmesh/kvmesh/internal/sim"
)

// progressBar shows a simulation's progress on stderr: a bar redrawn in
// place on a terminal, a log line every few seconds otherwise.
type progressBar struct {
	mu    sync.Mutex
	w     io.Writer
	mode  string // bar, log or off
	every time.Duration
	start time.Time
	drawn bool
}

func newProgressBar(w io.Writer, mode string) *progressBar {
	if mode == "auto" {
		mode = "log"
		if isTerminal(w) {
			mode = "bar"
		}
	}
	every := 5 * time.Second
	if mode == "bar" {
		every = 200 * time.Millisecond
	}
	return &progressBar{w: w, mode: mode, every: every, start: time.Now()}
}

// isTerminal reports whether w is a character device (a terminal).
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

func (b *progressBar) update(p sim.Progress) {
	b.mu.Lock()
	defer b.mu.Unlock()
	elapsed := time.Since(b.start).Truncate(100 * time.Millisecond)
	line := fmt.Sprintf("%d/%d requests  %d failed  hit %.1f%%  %d preemptions  %d mismatches  %s",
		p.Done, p.Requests, p.Failed, 100*p.HitRate, p.Preemptions, p.Mismatches, elapsed)
	if p.DeadRanks > 0 {
		line += fmt.Sprintf("  %d DEAD RANKS", p.DeadRanks)
	}
	switch b.mode {
	case "bar":
		const width = 30
		fill := 0
		if p.Requests > 0 {
			fill = width * p.Done / p.Requests
		}
		fmt.Fprintf(b.w, "\r[%s%s] %s\033[K", strings.Repeat("#", fill), strings.Repeat(".", width-fill), line)
		b.drawn = true
	case "log":
		fmt.Fprintf(b.w, "sim: %s\n", line)
	}
}

// done ends the bar's line.
func (b *progressBar) done() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.drawn {
		fmt.Fprintln(b.w)
		b.drawn = false
	}
}
