package proxy

import (
	"encoding/json"
	"fmt"
	"strings"

	"k8s.io/apimachinery/pkg/util/validation"
)

// AnnotationTopologyKeys is the Service annotation edge clusters use to keep
// traffic inside a group of nodes: a JSON list of node-label keys, tried in
// order; "*" means any endpoint.
const AnnotationTopologyKeys = "topologyKeys"

// TopologyKeyAny matches every endpoint.
const TopologyKeyAny = "*"

// maxTopologyKeys bounds the list, as the retired upstream field did.
const maxTopologyKeys = 16

// ParseTopologyKeys parses the value of the topologyKeys annotation. An empty
// value yields no keys and no error. A malformed value yields an error that
// names the problem; callers treat the service as having no topology keys.
func ParseTopologyKeys(value string) ([]string, error) {
	if strings.TrimSpace(value) == "" {
		return nil, nil
	}
	var keys []string
	if err := json.Unmarshal([]byte(value), &keys); err != nil {
		return nil, fmt.Errorf("annotation %s must be a JSON list of node label keys: %w", AnnotationTopologyKeys, err)
	}
	if len(keys) > maxTopologyKeys {
		return nil, fmt.Errorf("annotation %s has %d keys, at most %d are allowed", AnnotationTopologyKeys, len(keys), maxTopologyKeys)
	}
	seen := make(map[string]bool, len(keys))
	for i, k := range keys {
		switch {
		case k == TopologyKeyAny:
			if i != len(keys)-1 {
				return nil, fmt.Errorf("annotation %s: %q must be the last key", AnnotationTopologyKeys, TopologyKeyAny)
			}
		case k == "":
			return nil, fmt.Errorf("annotation %s: key %d is empty", AnnotationTopologyKeys, i)
		default:
			if errs := validation.IsQualifiedName(k); len(errs) > 0 {
				return nil, fmt.Errorf("annotation %s: key %q is not a valid label key: %s", AnnotationTopologyKeys, k, strings.Join(errs, "; "))
			}
		}
		if seen[k] {
			return nil, fmt.Errorf("annotation %s: key %q is listed twice", AnnotationTopologyKeys, k)
		}
		seen[k] = true
	}
	if len(keys) == 0 {
		return nil, nil
	}
	return keys, nil
}
