package cluster

import (
	"bytes"
	"encoding/csv"
	"fmt"
	"strings"

	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// identity is one user of the API server's static token file.
type identity struct {
	Token  string
	User   string
	UID    string
	Groups []string
}

// The local cluster's users. kproxy runs as upstream kube-proxy's user, so
// the default RBAC (system:node-proxier) is all it gets, as in a real
// cluster. The node agent is a test fixture: besides its node identity it
// is a cluster admin.
const (
	adminUser  = "kpc-admin"
	kproxyUser = "system:kube-proxy"
)

func agentUser(node string) string { return "system:node:" + node }

// tokenFile renders ids in the format of kube-apiserver --token-auth-file:
// token,user,uid,"group1,group2".
func tokenFile(ids []identity) ([]byte, error) {
	var buf bytes.Buffer
	w := csv.NewWriter(&buf)
	for _, id := range ids {
		rec := []string{id.Token, id.User, id.UID}
		if len(id.Groups) > 0 {
			rec = append(rec, strings.Join(id.Groups, ","))
		}
		if err := w.Write(rec); err != nil {
			return nil, fmt.Errorf("writing the token of %s: %w", id.User, err)
		}
	}
	w.Flush()
	if err := w.Error(); err != nil {
		return nil, fmt.Errorf("writing the token file: %w", err)
	}
	return buf.Bytes(), nil
}

// kubeconfigFor renders a kubeconfig reaching server (https URL) with the
// CA and a bearer token.
func kubeconfigFor(server string, caPEM []byte, user, token string) ([]byte, error) {
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["kpc"] = &clientcmdapi.Cluster{Server: server, CertificateAuthorityData: caPEM}
	cfg.AuthInfos[user] = &clientcmdapi.AuthInfo{Token: token}
	cfg.Contexts["kpc"] = &clientcmdapi.Context{Cluster: "kpc", AuthInfo: user}
	cfg.CurrentContext = "kpc"
	out, err := clientcmd.Write(*cfg)
	if err != nil {
		return nil, fmt.Errorf("rendering the kubeconfig of %s: %w", user, err)
	}
	return out, nil
}

// apiServerURL is the API server's URL at host (an IP).
func apiServerURL(host string) string {
	return fmt.Sprintf("https://%s:%d", host, APIServerPort)
}
