package nodeagent

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"time"

	v1 "k8s.io/api/core/v1"
	apiequality "k8s.io/apimachinery/pkg/api/equality"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

const (
	// reasonNotReady explains Ready=False conditions set by the annotation.
	reasonNotReady = "ContainersNotReady"
	// containerIDScheme prefixes the container IDs the agent reports.
	containerIDScheme = "kpc://"
)

// podReady reports whether the pod should be Ready: always, unless the
// ReadyAnnotation says "false".
func podReady(pod *v1.Pod) bool {
	return pod.Annotations[ReadyAnnotation] != "false"
}

// statusTime is t as the API server stores it (whole seconds), so that
// computed and stored statuses compare equal.
func statusTime(t time.Time) metav1.Time {
	return metav1.NewTime(t.Truncate(time.Second))
}

// podStatusInput is what the agent knows about a running pod.
type podStatusInput struct {
	podIP  netip.Addr
	hostIP netip.Addr
	// started is when the agent started the pod; a StartTime already in
	// the status wins.
	started time.Time
	now     time.Time
}

// desiredPodStatus returns pod's status as the agent reports it: Running,
// its addresses, the four standard conditions and a running container
// status per container. Fields the agent does not own are kept, as are
// transition times of conditions whose status does not change.
func desiredPodStatus(pod *v1.Pod, in podStatusInput) v1.PodStatus {
	st := *pod.Status.DeepCopy()
	now := statusTime(in.now)
	ready := podReady(pod)

	st.Phase = v1.PodRunning
	st.PodIP = in.podIP.String()
	st.PodIPs = []v1.PodIP{{IP: st.PodIP}}
	st.HostIP = in.hostIP.String()
	st.HostIPs = []v1.HostIP{{IP: st.HostIP}}
	if st.StartTime == nil {
		start := statusTime(in.started)
		st.StartTime = &start
	}

	readyStatus, reason, message := v1.ConditionTrue, "", ""
	if !ready {
		readyStatus = v1.ConditionFalse
		reason = reasonNotReady
		message = fmt.Sprintf("annotation %s is %q", ReadyAnnotation, pod.Annotations[ReadyAnnotation])
	}
	for _, c := range []v1.PodCondition{
		{Type: v1.PodScheduled, Status: v1.ConditionTrue},
		{Type: v1.PodInitialized, Status: v1.ConditionTrue},
		{Type: v1.ContainersReady, Status: readyStatus, Reason: reason, Message: message},
		{Type: v1.PodReady, Status: readyStatus, Reason: reason, Message: message},
	} {
		st.Conditions = setPodCondition(st.Conditions, c, now)
	}

	statuses := make([]v1.ContainerStatus, 0, len(pod.Spec.Containers))
	for _, c := range pod.Spec.Containers {
		var cs v1.ContainerStatus
		for _, old := range st.ContainerStatuses {
			if old.Name == c.Name {
				cs = old // keep fields the agent does not own
			}
		}
		cs.Name = c.Name
		cs.Image = c.Image
		cs.ImageID = c.Image
		cs.ContainerID = containerIDScheme + uid8(pod.UID) + "-" + c.Name
		cs.Ready = ready
		cs.Started = new(true)
		cs.State = v1.ContainerState{Running: &v1.ContainerStateRunning{StartedAt: *st.StartTime}}
		statuses = append(statuses, cs)
	}
	st.ContainerStatuses = statuses
	return st
}

// setPodCondition sets the status, reason and message of c in conds
// (appending it if missing). The transition time becomes now when the
// status changes; other fields of an existing condition stay.
func setPodCondition(conds []v1.PodCondition, c v1.PodCondition, now metav1.Time) []v1.PodCondition {
	for i := range conds {
		old := &conds[i]
		if old.Type != c.Type {
			continue
		}
		if old.Status != c.Status {
			old.LastTransitionTime = now
		}
		old.Status, old.Reason, old.Message = c.Status, c.Reason, c.Message
		return conds
	}
	c.LastTransitionTime = now
	return append(conds, c)
}

// podStatusPatch returns a JSON merge patch setting status (lists are
// replaced whole) with the pod UID as a precondition.
func podStatusPatch(uid types.UID, status v1.PodStatus) ([]byte, error) {
	return json.Marshal(map[string]any{
		"metadata": map[string]any{"uid": uid},
		"status":   status,
	})
}

// syncPodStatus patches pod's status when it differs from the desired one.
// It reports whether it patched.
func (a *agent) syncPodStatus(ctx context.Context, pod *v1.Pod, rt *podRuntime) (bool, error) {
	want := desiredPodStatus(pod, podStatusInput{
		podIP:   rt.ip,
		hostIP:  a.opts.NodeIP,
		started: rt.started,
		now:     a.clock.Now(),
	})
	if apiequality.Semantic.DeepEqual(pod.Status, want) {
		return false, nil
	}
	patch, err := podStatusPatch(pod.UID, want)
	if err != nil {
		return false, fmt.Errorf("encoding status patch: %w", err)
	}
	_, err = a.client.CoreV1().Pods(pod.Namespace).Patch(ctx, pod.Name, types.MergePatchType, patch, metav1.PatchOptions{}, "status")
	if err != nil {
		return false, fmt.Errorf("patching status: %w", err)
	}
	return true, nil
}

// nodeReadyCondition is the Ready condition the agent posts: True, with
// heartbeat now and the transition time of an existing True condition.
func nodeReadyCondition(node *v1.Node, now time.Time) v1.NodeCondition {
	t := statusTime(now)
	c := v1.NodeCondition{
		Type:               v1.NodeReady,
		Status:             v1.ConditionTrue,
		Reason:             "KubeletReady",
		Message:            "kpc node agent is posting ready status",
		LastHeartbeatTime:  t,
		LastTransitionTime: t,
	}
	for _, old := range node.Status.Conditions {
		if old.Type == v1.NodeReady && old.Status == v1.ConditionTrue {
			c.LastTransitionTime = old.LastTransitionTime
		}
	}
	return c
}

// updateNodeStatus posts a fresh Ready condition (a strategic merge patch,
// so other conditions stay).
func (a *agent) updateNodeStatus(ctx context.Context) error {
	nodes := a.client.CoreV1().Nodes()
	node, err := nodes.Get(ctx, a.opts.NodeName, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("getting node %s: %w", a.opts.NodeName, err)
	}
	patch, err := json.Marshal(map[string]any{
		"status": map[string]any{"conditions": []v1.NodeCondition{nodeReadyCondition(node, a.clock.Now())}},
	})
	if err != nil {
		return fmt.Errorf("encoding node status patch: %w", err)
	}
	if _, err := nodes.Patch(ctx, a.opts.NodeName, types.StrategicMergePatchType, patch, metav1.PatchOptions{}, "status"); err != nil {
		return fmt.Errorf("patching status of node %s: %w", a.opts.NodeName, err)
	}
	return nil
}
