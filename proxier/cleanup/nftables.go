package cleanup

import (
	"context"
	"errors"
	"fmt"
	"os/exec"

	"k8s.io/klog/v2"
	"sigs.k8s.io/knftables"
)

// NFTablesTable is the name of the one nftables table nftables mode owns in
// each family: "ip kproxy" and "ip6 kproxy". It is never kube-proxy's
// "kube-proxy", so that the two coexist and clean up independently.
const NFTablesTable = "kproxy"

// NFTablesFamily is the nftables family of kproxy's table for an IP
// family.
func NFTablesFamily(ipv6 bool) knftables.Family {
	if ipv6 {
		return knftables.IPv6Family
	}
	return knftables.IPv4Family
}

// OpenNFTables returns an nftables interface for cleanup, bound to no
// table (RemoveNFTablesTable names kproxy's tables itself). Without the nft
// command nothing of nftables mode can exist (nftables mode needs it): it
// returns nil and no error, and logs it at V(2). Any other failure (nft
// unusable) is an error.
func OpenNFTables(ctx context.Context) (knftables.Interface, error) {
	nft, err := knftables.New("", "")
	if errors.Is(err, exec.ErrNotFound) {
		klog.FromContext(ctx).V(2).Info("No nft command; not looking for kproxy's nftables tables", "err", err)
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("nftables is not usable: %w", err)
	}
	return nft, nil
}

// RemoveNFTablesTable deletes kproxy's nftables table of a family (ip or
// ip6 "kproxy") with everything in it, in one transaction; any other table
// stays. nft must be bound to no table (OpenNFTables, knftables.NewFake("",
// "")). An absent table is not an error, so running it again changes
// nothing.
func RemoveNFTablesTable(ctx context.Context, nft knftables.Interface, ipv6 bool) error {
	table := &knftables.Table{Family: NFTablesFamily(ipv6), Name: NFTablesTable}
	// Adding the table first makes the deletion succeed when it is absent
	// (nft's "destroy" is too recent to rely on).
	tx := nft.NewTransaction()
	tx.Add(table)
	tx.Delete(table)
	if err := nft.Run(ctx, tx); err != nil {
		return fmt.Errorf("deleting nftables table %s %s: %w", table.Family, table.Name, err)
	}
	klog.FromContext(ctx).V(2).Info("Deleted kproxy's nftables table, if any", "family", table.Family, "table", table.Name)
	return nil
}
