package nodeagent

import (
	"errors"
	"net/netip"
	"slices"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	apiequality "k8s.io/apimachinery/pkg/api/equality"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

func TestIPAllocator(t *testing.T) {
	type op struct {
		kind string // allocate, reserve, release
		uid  types.UID
		ip   string // reserve: the address; allocate: the expected one
		err  bool
	}
	tests := []struct {
		name string
		cidr string
		ops  []op
	}{
		{
			name: "allocates from .2 upwards",
			cidr: "10.244.1.0/24",
			ops: []op{
				{kind: "allocate", uid: "a", ip: "10.244.1.2"},
				{kind: "allocate", uid: "b", ip: "10.244.1.3"},
				{kind: "allocate", uid: "c", ip: "10.244.1.4"},
			},
		},
		{
			name: "same pod gets the same address",
			cidr: "10.244.1.0/24",
			ops: []op{
				{kind: "allocate", uid: "a", ip: "10.244.1.2"},
				{kind: "allocate", uid: "a", ip: "10.244.1.2"},
				{kind: "allocate", uid: "b", ip: "10.244.1.3"},
			},
		},
		{
			name: "released address is reused only after the rest of the range",
			cidr: "10.244.1.0/29", // .2 to .6
			ops: []op{
				{kind: "allocate", uid: "a", ip: "10.244.1.2"},
				{kind: "allocate", uid: "b", ip: "10.244.1.3"},
				{kind: "release", uid: "a"},
				{kind: "allocate", uid: "c", ip: "10.244.1.4"},
				{kind: "allocate", uid: "d", ip: "10.244.1.5"},
				{kind: "allocate", uid: "e", ip: "10.244.1.6"},
				{kind: "allocate", uid: "f", ip: "10.244.1.2"},
				{kind: "allocate", uid: "g", err: true},
			},
		},
		{
			name: "reserved addresses are skipped",
			cidr: "10.244.2.0/24",
			ops: []op{
				{kind: "reserve", uid: "old1", ip: "10.244.2.2"},
				{kind: "reserve", uid: "old2", ip: "10.244.2.4"},
				{kind: "allocate", uid: "a", ip: "10.244.2.3"},
				{kind: "allocate", uid: "b", ip: "10.244.2.5"},
			},
		},
		{
			name: "reserve conflicts",
			cidr: "10.244.2.0/24",
			ops: []op{
				{kind: "reserve", uid: "a", ip: "10.244.2.7"},
				{kind: "reserve", uid: "a", ip: "10.244.2.7"},
				{kind: "reserve", uid: "b", ip: "10.244.2.7", err: true},
				{kind: "reserve", uid: "a", ip: "10.244.2.8", err: true},
				{kind: "reserve", uid: "c", ip: "10.244.2.1", err: true},
				{kind: "reserve", uid: "c", ip: "10.244.2.255", err: true},
				{kind: "reserve", uid: "c", ip: "10.244.3.9", err: true},
				{kind: "release", uid: "a"},
				{kind: "reserve", uid: "b", ip: "10.244.2.7"},
			},
		},
		{
			name: "smallest range has one address",
			cidr: "10.244.9.4/30",
			ops: []op{
				{kind: "allocate", uid: "a", ip: "10.244.9.6"},
				{kind: "allocate", uid: "b", err: true},
			},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			a, err := newIPAllocator(netip.MustParsePrefix(tc.cidr))
			if err != nil {
				t.Fatal(err)
			}
			for i, o := range tc.ops {
				switch o.kind {
				case "allocate":
					got, err := a.allocate(o.uid)
					if o.err {
						if !errors.Is(err, errRangeFull) {
							t.Fatalf("op %d: allocate(%s) = %v, %v; want errRangeFull", i, o.uid, got, err)
						}
						continue
					}
					if err != nil || got.String() != o.ip {
						t.Fatalf("op %d: allocate(%s) = %v, %v; want %s", i, o.uid, got, err, o.ip)
					}
				case "reserve":
					err := a.reserve(o.uid, netip.MustParseAddr(o.ip))
					if (err != nil) != o.err {
						t.Fatalf("op %d: reserve(%s, %s) = %v; want error %v", i, o.uid, o.ip, err, o.err)
					}
				case "release":
					a.release(o.uid)
				}
			}
		})
	}
}

func TestNewIPAllocatorRejects(t *testing.T) {
	for _, cidr := range []string{"10.244.1.0/31", "10.244.1.0/32", "fd00::/64"} {
		t.Run(cidr, func(t *testing.T) {
			if _, err := newIPAllocator(netip.MustParsePrefix(cidr)); err == nil {
				t.Errorf("newIPAllocator(%s) succeeded", cidr)
			}
		})
	}
}

func TestGracePeriod(t *testing.T) {
	tests := []struct {
		name        string
		deletion    *int64
		termination *int64
		limit       time.Duration
		want        time.Duration
	}{
		{name: "API default", limit: time.Minute, want: 30 * time.Second},
		{name: "default capped", limit: 10 * time.Second, want: 10 * time.Second},
		{name: "spec termination grace", termination: new(int64(5)), limit: time.Minute, want: 5 * time.Second},
		{name: "deletion grace wins", deletion: new(int64(3)), termination: new(int64(5)), limit: time.Minute, want: 3 * time.Second},
		{name: "long grace capped", deletion: new(int64(600)), limit: 30 * time.Second, want: 30 * time.Second},
		{name: "zero", deletion: new(int64(0)), limit: 30 * time.Second, want: 0},
		{name: "negative is zero", deletion: new(int64(-4)), limit: 30 * time.Second, want: 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			pod := &v1.Pod{
				ObjectMeta: metav1.ObjectMeta{DeletionGracePeriodSeconds: tc.deletion},
				Spec:       v1.PodSpec{TerminationGracePeriodSeconds: tc.termination},
			}
			if got := gracePeriod(pod, tc.limit); got != tc.want {
				t.Errorf("gracePeriod = %v, want %v", got, tc.want)
			}
		})
	}
}

func TestPodPorts(t *testing.T) {
	pod := &v1.Pod{Spec: v1.PodSpec{Containers: []v1.Container{
		{Name: "a", Ports: []v1.ContainerPort{
			{Name: "echo", ContainerPort: 8080},
			{Name: "http-web", ContainerPort: 8081, Protocol: v1.ProtocolTCP},
			{Name: "dns", ContainerPort: 53, Protocol: v1.ProtocolUDP},
			{Name: "dns-tcp", ContainerPort: 53, Protocol: v1.ProtocolTCP},
			{Name: "sctp", ContainerPort: 9999, Protocol: v1.ProtocolSCTP},
		}},
		{Name: "b", Ports: []v1.ContainerPort{
			{Name: "again", ContainerPort: 8080},
			{Name: "httpalt", ContainerPort: 9090, Protocol: v1.ProtocolUDP},
		}},
	}}}
	want := []portSpec{
		{Name: "echo", Protocol: v1.ProtocolTCP, Port: 8080},
		{Name: "http-web", Protocol: v1.ProtocolTCP, Port: 8081},
		{Name: "dns", Protocol: v1.ProtocolUDP, Port: 53},
		{Name: "dns-tcp", Protocol: v1.ProtocolTCP, Port: 53},
		{Name: "httpalt", Protocol: v1.ProtocolUDP, Port: 9090},
	}
	got := podPorts(pod)
	if !slices.Equal(got, want) {
		t.Fatalf("podPorts =\n%v\nwant\n%v", got, want)
	}
	var http []string
	for _, p := range got {
		if p.http() {
			http = append(http, p.Name)
		}
	}
	if !slices.Equal(http, []string{"http-web"}) {
		t.Errorf("HTTP ports = %v, want [http-web] (a UDP port named http* is plain UDP)", http)
	}
}

func TestDesiredPodStatus(t *testing.T) {
	t0 := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	t1 := t0.Add(time.Minute + 300*time.Millisecond)
	at := func(t time.Time) metav1.Time { return metav1.NewTime(t) }
	basePod := func(annotations map[string]string, status v1.PodStatus) *v1.Pod {
		return &v1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: "p", UID: "0123456789ab", Annotations: annotations},
			Spec: v1.PodSpec{Containers: []v1.Container{
				{Name: "c1", Image: "echo:1"},
				{Name: "c2", Image: "echo:2"},
			}},
			Status: status,
		}
	}
	scheduled := v1.PodCondition{Type: v1.PodScheduled, Status: v1.ConditionTrue, LastTransitionTime: at(t0.Add(-time.Hour))}
	tests := []struct {
		name      string
		pod       *v1.Pod
		wantReady v1.ConditionStatus
		// wantTransition is the Ready condition's expected transition time.
		wantTransition time.Time
		wantStart      time.Time
	}{
		{
			name:           "new pod is ready",
			pod:            basePod(nil, v1.PodStatus{Phase: v1.PodPending, Conditions: []v1.PodCondition{scheduled}}),
			wantReady:      v1.ConditionTrue,
			wantTransition: t1.Truncate(time.Second),
			wantStart:      t0,
		},
		{
			name:           "annotation false makes it not ready",
			pod:            basePod(map[string]string{ReadyAnnotation: "false"}, v1.PodStatus{}),
			wantReady:      v1.ConditionFalse,
			wantTransition: t1.Truncate(time.Second),
			wantStart:      t0,
		},
		{
			name:           "other annotation values mean ready",
			pod:            basePod(map[string]string{ReadyAnnotation: "true"}, v1.PodStatus{}),
			wantReady:      v1.ConditionTrue,
			wantTransition: t1.Truncate(time.Second),
			wantStart:      t0,
		},
		{
			name: "unchanged readiness keeps the transition time and start time",
			pod: basePod(nil, v1.PodStatus{
				StartTime: new(at(t0.Add(-time.Hour))),
				Conditions: []v1.PodCondition{scheduled,
					{Type: v1.PodReady, Status: v1.ConditionTrue, LastTransitionTime: at(t0.Add(-30 * time.Minute))}},
			}),
			wantReady:      v1.ConditionTrue,
			wantTransition: t0.Add(-30 * time.Minute),
			wantStart:      t0.Add(-time.Hour),
		},
		{
			name: "readiness flip moves the transition time",
			pod: basePod(map[string]string{ReadyAnnotation: "false"}, v1.PodStatus{
				StartTime: new(at(t0)),
				Conditions: []v1.PodCondition{scheduled,
					{Type: v1.PodReady, Status: v1.ConditionTrue, LastTransitionTime: at(t0)}},
			}),
			wantReady:      v1.ConditionFalse,
			wantTransition: t1.Truncate(time.Second),
			wantStart:      t0,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			in := podStatusInput{
				podIP:   netip.MustParseAddr("10.244.1.7"),
				hostIP:  netip.MustParseAddr("10.254.0.11"),
				started: t0,
				now:     t1,
			}
			got := desiredPodStatus(tc.pod, in)
			if got.Phase != v1.PodRunning {
				t.Errorf("phase = %s, want Running", got.Phase)
			}
			if got.PodIP != "10.244.1.7" || len(got.PodIPs) != 1 || got.PodIPs[0].IP != "10.244.1.7" {
				t.Errorf("podIP/podIPs = %s/%v", got.PodIP, got.PodIPs)
			}
			if got.HostIP != "10.254.0.11" || len(got.HostIPs) != 1 || got.HostIPs[0].IP != "10.254.0.11" {
				t.Errorf("hostIP/hostIPs = %s/%v", got.HostIP, got.HostIPs)
			}
			if got.StartTime == nil || !got.StartTime.Time.Equal(tc.wantStart) {
				t.Errorf("startTime = %v, want %v", got.StartTime, tc.wantStart)
			}
			conds := map[v1.PodConditionType]v1.PodCondition{}
			for _, c := range got.Conditions {
				if _, dup := conds[c.Type]; dup {
					t.Errorf("duplicate condition %s", c.Type)
				}
				conds[c.Type] = c
			}
			want := map[v1.PodConditionType]v1.ConditionStatus{
				v1.PodScheduled:    v1.ConditionTrue,
				v1.PodInitialized:  v1.ConditionTrue,
				v1.ContainersReady: tc.wantReady,
				v1.PodReady:        tc.wantReady,
			}
			for typ, status := range want {
				if c, ok := conds[typ]; !ok || c.Status != status {
					t.Errorf("condition %s = %+v, want status %s", typ, c, status)
				}
			}
			if len(conds) != len(want) {
				t.Errorf("conditions = %v, want exactly %v", got.Conditions, want)
			}
			if ready := conds[v1.PodReady]; !ready.LastTransitionTime.Time.Equal(tc.wantTransition) {
				t.Errorf("Ready transition = %v, want %v", ready.LastTransitionTime, tc.wantTransition)
			}
			if s := conds[v1.PodScheduled]; !s.LastTransitionTime.Equal(&scheduled.LastTransitionTime) && tc.pod.Status.Conditions != nil {
				t.Errorf("PodScheduled transition changed to %v", s.LastTransitionTime)
			}
			if len(got.ContainerStatuses) != 2 {
				t.Fatalf("container statuses = %v, want 2", got.ContainerStatuses)
			}
			for i, cs := range got.ContainerStatuses {
				c := tc.pod.Spec.Containers[i]
				if cs.Name != c.Name || cs.Image != c.Image || cs.Ready != (tc.wantReady == v1.ConditionTrue) ||
					cs.Started == nil || !*cs.Started || cs.State.Running == nil ||
					!cs.State.Running.StartedAt.Time.Equal(tc.wantStart) || cs.ContainerID != "kpc://01234567-"+c.Name {
					t.Errorf("container status %d = %+v", i, cs)
				}
			}
			// A second computation over the result changes nothing: the
			// agent does not patch a pod whose status is current.
			again := tc.pod.DeepCopy()
			again.Status = got
			in.now = t1.Add(time.Hour)
			if next := desiredPodStatus(again, in); !apiequality.Semantic.DeepEqual(next, got) {
				t.Errorf("status not stable:\nfirst  %+v\nsecond %+v", got, next)
			}
		})
	}
}

func TestNodeReadyCondition(t *testing.T) {
	t0 := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	now := t0.Add(time.Hour + 400*time.Millisecond)
	tests := []struct {
		name           string
		conditions     []v1.NodeCondition
		wantTransition time.Time
	}{
		{name: "no condition yet", wantTransition: now.Truncate(time.Second)},
		{
			name:           "already ready keeps transition time",
			conditions:     []v1.NodeCondition{{Type: v1.NodeReady, Status: v1.ConditionTrue, LastTransitionTime: metav1.NewTime(t0)}},
			wantTransition: t0,
		},
		{
			name:           "was unknown",
			conditions:     []v1.NodeCondition{{Type: v1.NodeReady, Status: v1.ConditionUnknown, LastTransitionTime: metav1.NewTime(t0)}},
			wantTransition: now.Truncate(time.Second),
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			node := &v1.Node{Status: v1.NodeStatus{Conditions: tc.conditions}}
			c := nodeReadyCondition(node, now)
			if c.Type != v1.NodeReady || c.Status != v1.ConditionTrue {
				t.Errorf("condition = %+v, want Ready True", c)
			}
			if !c.LastHeartbeatTime.Time.Equal(now.Truncate(time.Second)) {
				t.Errorf("heartbeat = %v, want %v", c.LastHeartbeatTime, now)
			}
			if !c.LastTransitionTime.Time.Equal(tc.wantTransition) {
				t.Errorf("transition = %v, want %v", c.LastTransitionTime, tc.wantTransition)
			}
		})
	}
}

func TestSlaveMount(t *testing.T) {
	const (
		hostNetns   = "42 27 254:0 /run/netns /run/netns rw,relatime shared:1 - ext4 /dev/vda rw\n"
		nsMount     = "43 42 0:4 net:[4026532177] /run/netns/n1 rw shared:2 - nsfs nsfs rw\n"
		slaveNetns  = "65 45 254:0 /run/netns /run/netns rw,relatime master:1 - ext4 /dev/vda rw\n"
		reshared    = "70 45 254:0 /run/netns /run/netns rw,relatime shared:9 master:1 - ext4 /dev/vda rw\n"
		otherSlave  = "80 27 0:5 / /mnt rw master:3 - tmpfs tmpfs rw\n"
		rootMount   = "27 1 254:0 / / rw,relatime shared:5 - ext4 /dev/vda rw\n"
		remountHost = "90 65 254:0 /run/netns /run/netns rw,relatime shared:1 - ext4 /dev/vda rw\n"
	)
	tests := []struct {
		name      string
		mountinfo string
		want      bool
	}{
		{name: "host", mountinfo: rootMount + hostNetns + nsMount, want: false},
		{name: "no netns mount", mountinfo: rootMount + otherSlave, want: false},
		{name: "ip netns exec", mountinfo: rootMount + slaveNetns, want: true},
		{name: "ip netns exec then add", mountinfo: rootMount + slaveNetns + reshared, want: true},
		{name: "top mount decides", mountinfo: rootMount + slaveNetns + remountHost, want: false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := slaveMount([]byte(tc.mountinfo), "/run/netns"); got != tc.want {
				t.Errorf("slaveMount = %v, want %v", got, tc.want)
			}
		})
	}
}

func TestNames(t *testing.T) {
	uid := types.UID("6f1c2d3e-aaaa-bbbb-cccc-000000000000")
	if got := PodNetNSName(uid); got != "kpc-p-6f1c2d3e" {
		t.Errorf("PodNetNSName = %s", got)
	}
	if got := HostVethName(uid); got != "vp6f1c2d3e" || !isHostVeth(got) {
		t.Errorf("HostVethName = %s (isHostVeth %v)", got, isHostVeth(got))
	}
	for _, name := range []string{"lo", "vp123", "eth0", "vp123456789"} {
		if isHostVeth(name) {
			t.Errorf("isHostVeth(%s) = true", name)
		}
	}
}
