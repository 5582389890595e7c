// Package iptables is kproxy's small interface to iptables and its real
// implementation (iptables, iptables-restore and iptables-save, each run
// under a deadline), with the helpers rule rendering needs (Comment,
// SplitArgs, JoinArgs). The in-memory fake, its
// rule parser and the packet tracer live in package iptablestest, which
// production code never imports.
package iptables

import (
	"context"
	"errors"
)

// Table is an iptables table name.
type Table string

// Chain is an iptables chain name.
type Chain string

const (
	TableNAT    Table = "nat"
	TableFilter Table = "filter"
	TableMangle Table = "mangle"

	ChainPrerouting  Chain = "PREROUTING"
	ChainPostrouting Chain = "POSTROUTING"
	ChainOutput      Chain = "OUTPUT"
	ChainInput       Chain = "INPUT"
	ChainForward     Chain = "FORWARD"
)

// Protocol is the IP family an Interface manages.
type Protocol string

const (
	ProtocolIPv4 Protocol = "IPv4"
	ProtocolIPv6 Protocol = "IPv6"
)

// RulePosition says where EnsureRule puts a missing rule.
type RulePosition string

const (
	Prepend RulePosition = "-I"
	Append  RulePosition = "-A"
)

// Interface is the whole of kproxy's access to one family's iptables.
type Interface interface {
	// Protocol is the family this interface manages.
	Protocol() Protocol
	// EnsureChain creates chain if missing; reports whether it existed.
	EnsureChain(ctx context.Context, table Table, chain Chain) (bool, error)
	// ChainExists reports whether chain exists in table.
	ChainExists(ctx context.Context, table Table, chain Chain) (bool, error)
	// ListChains lists every chain name in table.
	ListChains(ctx context.Context, table Table) ([]string, error)
	// EnsureRule adds the rule (args after "-A chain") if it is not present;
	// reports whether it existed.
	EnsureRule(ctx context.Context, position RulePosition, table Table, chain Chain, args ...string) (bool, error)
	// DeleteRule deletes the rule if present; no error when absent.
	DeleteRule(ctx context.Context, table Table, chain Chain, args ...string) error
	// FlushChain empties chain; DeleteChain removes an (empty, unreferenced)
	// chain. Neither fails when the chain is absent.
	FlushChain(ctx context.Context, table Table, chain Chain) error
	DeleteChain(ctx context.Context, table Table, chain Chain) error
	// Restore feeds data (iptables-save format, possibly several tables,
	// each ending in COMMIT) to iptables-restore --noflush --counters.
	// Every table in data is applied atomically.
	Restore(ctx context.Context, data []byte) error
	// SaveInto dumps table in iptables-save format.
	SaveInto(ctx context.Context, table Table) ([]byte, error)
	// ListRules returns the rules of each of chains in table, each as its
	// arguments after "-A CHAIN" (as iptables prints them); a chain that
	// does not exist has no entry, an empty one an empty list. It is meant
	// for a few chains: iptables-nft reads only those, iptables-legacy
	// reads the whole table once (the kernel hands it over whole).
	ListRules(ctx context.Context, table Table, chains ...Chain) (map[Chain][]string, error)
	// ChainUse returns, for every chain of table (built-in ones included),
	// its use count: the number of its rules plus the number of rules of
	// the table that jump or go to it, the count nf_tables keeps for every
	// chain. A flushed chain, a deleted rule or a deleted jump lowers it.
	// iptables-nft reads it from the kernel without listing rules;
	// iptables-legacy computes it from iptables-save. A table that does not
	// exist has no chains; iptables-nft creates a built-in chain only when
	// it first gets a rule, so an empty one may have no entry.
	ChainUse(ctx context.Context, table Table) (map[string]int, error)
	// HasRandomFully reports whether MASQUERADE --random-fully is supported.
	HasRandomFully() bool
}

// FailedLine returns the 1-based line of restore input that a Restore
// error blames, when iptables-restore named one. iptables-nft-restore names
// the line of a rule the kernel refused; iptables-legacy-restore names the
// COMMIT line of the table it could not load (the kernel takes a table
// whole), and either names the line of one it could not parse.
func FailedLine(err error) (int, bool) {
	var le interface{ RestoreLine() int }
	if errors.As(err, &le) && le.RestoreLine() > 0 {
		return le.RestoreLine(), true
	}
	return 0, false
}

// Refused reports whether a Restore error is iptables-restore refusing its
// input (it named a line, or exited with status 1 or 2: the kernel or
// iptables rejected what it was given) rather than failing to run it (a
// lock it could not take, resources, a cancelled context): only a refusal
// can be avoided by leaving rules out.
func Refused(err error) bool {
	if _, ok := FailedLine(err); ok {
		return true
	}
	var ee interface{ ExitCode() int }
	if errors.As(err, &ee) {
		code := ee.ExitCode()
		return code == 1 || code == 2
	}
	return false
}
