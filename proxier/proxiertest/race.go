//go:build race

package proxiertest

// raceEnabled: built with -race, which slows the fakes down several times.
const raceEnabled = true
