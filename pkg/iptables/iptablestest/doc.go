// Package iptablestest is test support for code that drives an
// iptables.Interface: Fake, an in-memory iptables that parses and executes
// restore input with the kernel's rules; ParseRule, the parser behind it; and
// Fake.Trace, a packet tracer that walks the fake's ruleset. Production code
// must not import it, with one exception: `kproxy trace` (proxier/trace)
// restores the node's saved rules into a Fake to walk them with Trace.
//
// The Fake is held to the real implementation by a shared table of
// Interface cases in package iptables, run against both (the real one inside
// a throwaway network namespace).
package iptablestest
