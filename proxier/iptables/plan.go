package iptables

import (
	"bytes"
	"context"
	"fmt"
	"sort"
	"time"

	ipt "github.com/kproxy/kproxy/pkg/iptables"
)

// restorePlan collects the chains one sync writes and deletes, and turns
// them into iptables-restore input.
//
// Service chains (nat) may be split over several restores: iptables-nft's
// --noflush restore time grows with the square of the chains in one batch.
// The shared chains (dispatch trees, POSTROUTING...) and every deletion go in
// the last restore, so a dispatch rule never points at a service chain that
// is not complete, and a chain is deleted only once nothing jumps to it.
type restorePlan struct {
	// services holds each service port's chains as one group: a group is
	// never split over two restores, since its chains jump to each other.
	services [][]plannedChain
	global   map[ipt.Table][]plannedChain
	deletes  map[ipt.Table][]string
}

type plannedChain struct {
	name  string
	rules []string
}

func newRestorePlan() *restorePlan {
	return &restorePlan{global: map[ipt.Table][]plannedChain{}, deletes: map[ipt.Table][]string{}}
}

// serviceChains adds one service port's chains (already in a stable order).
func (p *restorePlan) serviceChains(chains []plannedChain) {
	if len(chains) > 0 {
		p.services = append(p.services, chains)
	}
}

func (p *restorePlan) globalChain(table ipt.Table, name string, rules []string) {
	p.global[table] = append(p.global[table], plannedChain{name, rules})
}

func (p *restorePlan) deleteChain(table ipt.Table, name string) {
	p.deletes[table] = append(p.deletes[table], name)
}

func (p *restorePlan) empty() bool {
	return len(p.services) == 0 && len(p.global) == 0 && len(p.deletes) == 0
}

// writeTable appends one table section to buf.
func writeTable(buf *bytes.Buffer, table ipt.Table, chains []plannedChain, deletes []string, stats *SyncStats) {
	if len(chains) == 0 && len(deletes) == 0 {
		return
	}
	fmt.Fprintf(buf, "*%s\n", table)
	for _, c := range chains {
		fmt.Fprintf(buf, ":%s - [0:0]\n", c.name)
	}
	for _, d := range deletes {
		fmt.Fprintf(buf, ":%s - [0:0]\n", d)
	}
	for _, c := range chains {
		for _, r := range c.rules {
			buf.WriteString("-A ")
			buf.WriteString(c.name)
			buf.WriteByte(' ')
			buf.WriteString(r)
			buf.WriteByte('\n')
		}
		stats.RulesWritten += len(c.rules)
		if stats.RulesWrittenByTable == nil {
			stats.RulesWrittenByTable = map[ipt.Table]int{}
		}
		stats.RulesWrittenByTable[table] += len(c.rules)
	}
	for _, d := range deletes {
		fmt.Fprintf(buf, "-X %s\n", d)
	}
	buf.WriteString("COMMIT\n")
	stats.ChainsWritten += len(chains)
	stats.ChainsDeleted += len(deletes)
}

// apply runs the plan: service chains in batches of at most batchChains,
// then one last restore with the shared chains and the deletions.
func (p *restorePlan) apply(ctx context.Context, iface ipt.Interface, batchChains int) (SyncStats, error) {
	var stats SyncStats
	if p.empty() {
		return stats, nil
	}
	tables := []ipt.Table{ipt.TableNAT, ipt.TableFilter}
	for _, t := range tables {
		sort.Slice(p.global[t], func(i, j int) bool { return p.global[t][i].name < p.global[t][j].name })
		sort.Strings(p.deletes[t])
	}
	total := 0
	for _, g := range p.services {
		total += len(g)
	}
	// Whole service groups go into batches of about batchChains chains
	// while more than one batch remains; the rest joins the last restore.
	var batch []plannedChain
	for _, g := range p.services {
		if total <= batchChains {
			batch = append(batch, g...)
			continue
		}
		batch = append(batch, g...)
		total -= len(g)
		if len(batch) >= batchChains {
			var buf bytes.Buffer
			writeTable(&buf, ipt.TableNAT, batch, nil, &stats)
			if err := restore(ctx, iface, buf.Bytes(), &stats); err != nil {
				return stats, err
			}
			batch = nil
		}
	}
	var buf bytes.Buffer
	writeTable(&buf, ipt.TableNAT, append(batch, p.global[ipt.TableNAT]...), p.deletes[ipt.TableNAT], &stats)
	writeTable(&buf, ipt.TableFilter, p.global[ipt.TableFilter], p.deletes[ipt.TableFilter], &stats)
	if err := restore(ctx, iface, buf.Bytes(), &stats); err != nil {
		return stats, err
	}
	return stats, nil
}

func restore(ctx context.Context, iface ipt.Interface, data []byte, stats *SyncStats) error {
	if len(data) == 0 {
		return nil
	}
	stats.Restores++
	stats.Bytes += len(data)
	start := time.Now()
	err := iface.Restore(ctx, data)
	stats.RestoreTime += time.Since(start)
	if err != nil {
		return fmt.Errorf("iptables-restore (%d bytes): %w", len(data), err)
	}
	return nil
}
