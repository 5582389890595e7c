package proxier

// StaleConntrackNotes is the number of stale conntrack notes the engine
// holds for its next successful sync; for tests.
func (e *Engine) StaleConntrackNotes() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.staleConntrack.len()
}
