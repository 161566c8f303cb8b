package deploy_test

import (
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	kjson "sigs.k8s.io/json"
	"sigs.k8s.io/yaml"
)

// types maps apiVersion/kind to the Go type a manifest must decode into.
// systemSocket is where a client with no $GPUSHM_SOCKET finds the node's
// daemon (gpushm.SystemSocket; this module does not import gpushm).
const systemSocket = "/run/gpushm/gpushm.sock"

var types = map[string]func() any{
	"v1/Namespace":      func() any { return new(corev1.Namespace) },
	"v1/Service":        func() any { return new(corev1.Service) },
	"v1/Pod":            func() any { return new(corev1.Pod) },
	"apps/v1/DaemonSet": func() any { return new(appsv1.DaemonSet) },
	"monitoring.coreos.com/v1/ServiceMonitor": func() any { return new(monitoringv1.ServiceMonitor) },
}

var separator = regexp.MustCompile(`(?m)^---[ \t]*$`)

// decode reads every object of a YAML file as the API server would with
// strict field validation: duplicate or unknown fields (case-sensitive,
// so "nodeselector" is not nodeSelector) and unknown kinds are errors.
func decode(data []byte) ([]any, error) {
	var objs []any
	for i, doc := range separator.Split(string(data), -1) {
		if strings.TrimSpace(stripComments(doc)) == "" {
			continue
		}
		j, err := yaml.YAMLToJSONStrict([]byte(doc))
		if err != nil {
			return nil, fmt.Errorf("document %d: %w", i+1, err)
		}
		var tm struct {
			APIVersion string `json:"apiVersion"`
			Kind       string `json:"kind"`
		}
		if err := json.Unmarshal(j, &tm); err != nil {
			return nil, fmt.Errorf("document %d: %w", i+1, err)
		}
		newObj, ok := types[tm.APIVersion+"/"+tm.Kind]
		if !ok {
			return nil, fmt.Errorf("document %d: apiVersion %q kind %q is not one this test knows", i+1, tm.APIVersion, tm.Kind)
		}
		obj := newObj()
		strict, err := kjson.UnmarshalStrict(j, obj, kjson.DisallowDuplicateFields, kjson.DisallowUnknownFields)
		if err != nil {
			return nil, fmt.Errorf("document %d (%s): %w", i+1, tm.Kind, err)
		}
		if len(strict) > 0 {
			return nil, fmt.Errorf("document %d (%s): %v", i+1, tm.Kind, strict)
		}
		objs = append(objs, obj)
	}
	return objs, nil
}

func stripComments(doc string) string {
	var b strings.Builder
	for line := range strings.Lines(doc) {
		if !strings.HasPrefix(strings.TrimSpace(line), "#") {
			b.WriteString(line)
		}
	}
	return b.String()
}

// manifests decodes every file in kubernetes/.
func manifests(t *testing.T) map[string][]any {
	t.Helper()
	files, err := filepath.Glob("kubernetes/*.yaml")
	if err != nil || len(files) == 0 {
		t.Fatalf("no manifests in kubernetes/: %v", err)
	}
	out := map[string][]any{}
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		objs, err := decode(data)
		if err != nil {
			t.Errorf("%s: %v", f, err)
			continue
		}
		out[filepath.Base(f)] = objs
	}
	if t.Failed() {
		t.FailNow()
	}
	return out
}

// TestDecodeIsStrict: the check above fails on the mistakes it is for.
func TestDecodeIsStrict(t *testing.T) {
	good, err := os.ReadFile("kubernetes/daemonset.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := decode(good); err != nil {
		t.Fatalf("daemonset.yaml: %v", err)
	}
	tests := []struct{ name, from, to, want string }{
		{"misspelt field", "      nodeSelector:", "      nodeSelektor:", `unknown field "spec.template.spec.nodeSelektor"`},
		{"wrong case", "      nodeSelector:", "      nodeselector:", `unknown field "spec.template.spec.nodeselector"`},
		{"wrong type", "              containerPort: 9464", "              containerPort: metrics", "cannot unmarshal"},
		{"duplicate field", "  updateStrategy:", "  minReadySeconds: 1\n  minReadySeconds: 2\n  updateStrategy:", `key "minReadySeconds" already set`},
		{"unknown kind", "kind: DaemonSet", "kind: DaemonSett", `kind "DaemonSett" is not one this test knows`},
	}
	for _, tc := range tests {
		bad := strings.Replace(string(good), tc.from, tc.to, 1)
		if bad == string(good) {
			t.Fatalf("%s: %q is not in daemonset.yaml", tc.name, tc.from)
		}
		if _, err := decode([]byte(bad)); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: decode = %v, want an error mentioning %q", tc.name, err, tc.want)
		}
	}
}

func one[T any](t *testing.T, all map[string][]any, file string) T {
	t.Helper()
	for _, o := range all[file] {
		if v, ok := o.(T); ok {
			return v
		}
	}
	var zero T
	t.Fatalf("%s has no %T", file, zero)
	return zero
}

// TestManifests decodes every manifest strictly and checks what the API
// server would not: that the parts name each other consistently, and that
// the daemon is set up as docs/kubernetes.md says.
func TestManifests(t *testing.T) {
	all := manifests(t)
	for _, f := range []string{"namespace.yaml", "daemonset.yaml", "daemonset-fuse.yaml", "daemonset-peers.yaml", "service.yaml", "servicemonitor.yaml", "example-workload.yaml"} {
		if len(all[f]) == 0 {
			t.Errorf("kubernetes/%s: missing or empty", f)
		}
	}
	plain := one[*appsv1.DaemonSet](t, all, "daemonset.yaml")
	fuse := one[*appsv1.DaemonSet](t, all, "daemonset-fuse.yaml")
	peers := one[*appsv1.DaemonSet](t, all, "daemonset-peers.yaml")
	for name, ds := range map[string]*appsv1.DaemonSet{"daemonset.yaml": plain, "daemonset-fuse.yaml": fuse, "daemonset-peers.yaml": peers} {
		t.Run(name, func(t *testing.T) { checkDaemonSet(t, ds) })
	}
	for name, ds := range map[string]*appsv1.DaemonSet{"daemonset-fuse.yaml": fuse, "daemonset-peers.yaml": peers} {
		if plain.Name != ds.Name || plain.Namespace != ds.Namespace {
			t.Errorf("%s's DaemonSet must replace the plain one: same name and namespace", name)
		}
	}
	// The plain daemon runs non-root, with nothing extra.
	c := plain.Spec.Template.Spec.Containers[0]
	if sc := c.SecurityContext; sc == nil || sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot || sc.RunAsUser == nil || *sc.RunAsUser != 65532 ||
		sc.Privileged != nil && *sc.Privileged || sc.Capabilities == nil || !slices.Contains(sc.Capabilities.Drop, "ALL") {
		t.Errorf("daemonset.yaml: the daemon should run as uid 65532 with no capabilities: %+v", sc)
	}
	// The FUSE daemon mounts the view, with propagation to the node.
	fc := fuse.Spec.Template.Spec.Containers[0]
	view := argValue(fc.Args, "--mount")
	propagated := false
	for _, m := range fc.VolumeMounts {
		if m.MountPath == view && m.MountPropagation != nil && *m.MountPropagation == corev1.MountPropagationBidirectional {
			propagated = true
		}
	}
	if view == "" || !propagated {
		t.Errorf("daemonset-fuse.yaml: --mount %q needs a volume mounted there with Bidirectional propagation", view)
	}

	svc := one[*corev1.Service](t, all, "service.yaml")
	if !matches(svc.Spec.Selector, plain.Spec.Template.Labels) {
		t.Errorf("service.yaml: selector %v does not select the daemon's pods %v", svc.Spec.Selector, plain.Spec.Template.Labels)
	}
	if len(svc.Spec.Ports) != 1 || svc.Spec.Ports[0].TargetPort.StrVal != "metrics" {
		t.Errorf("service.yaml: want one port targeting the daemon's metrics port: %+v", svc.Spec.Ports)
	}
	sm := one[*monitoringv1.ServiceMonitor](t, all, "servicemonitor.yaml")
	if ps := one[*corev1.Service](t, all, "daemonset-peers.yaml"); matches(sm.Spec.Selector.MatchLabels, ps.Labels) {
		t.Errorf("servicemonitor.yaml: selector %v selects the peers' Service %v, which has no metrics port", sm.Spec.Selector.MatchLabels, ps.Labels)
	}
	if !matches(sm.Spec.Selector.MatchLabels, svc.Labels) {
		t.Errorf("servicemonitor.yaml: selector %v does not select the Service %v", sm.Spec.Selector.MatchLabels, svc.Labels)
	}
	if len(sm.Spec.Endpoints) != 1 || sm.Spec.Endpoints[0].Port != svc.Spec.Ports[0].Name {
		t.Errorf("servicemonitor.yaml: endpoints %+v, want the Service's port %q", sm.Spec.Endpoints, svc.Spec.Ports[0].Name)
	}

	pod := one[*corev1.Pod](t, all, "example-workload.yaml")
	checkPod(t, "example-workload.yaml", &pod.Spec)
	socket := argValue(plain.Spec.Template.Spec.Containers[0].Args, "--socket")
	for _, c := range append(slices.Clone(pod.Spec.InitContainers), pod.Spec.Containers...) {
		if mountedHostPath(&pod.Spec, c, path.Dir(socket)) != path.Dir(socket) {
			t.Errorf("example-workload.yaml: container %s must mount the node's %s at the same path", c.Name, path.Dir(socket))
		}
		// A client with no $GPUSHM_SOCKET looks in the system socket after
		// its own (gpushm.SocketCandidates).
		if got := env(c, "GPUSHM_SOCKET"); got != "" && got != socket || got == "" && socket != systemSocket {
			t.Errorf("example-workload.yaml: container %s has GPUSHM_SOCKET=%q; the daemon serves %s, and a client finds only %s by itself", c.Name, got, socket, systemSocket)
		}
		// A client talks to a daemon of another uid than its own or
		// root's only when GPUSHM_DAEMON_UID names it: the plain
		// daemon's (above).
		if daemon := fmt.Sprint(65532); env(c, "GPUSHM_DAEMON_UID") != daemon {
			t.Errorf("example-workload.yaml: container %s has GPUSHM_DAEMON_UID=%q; the daemon runs as uid %s", c.Name, env(c, "GPUSHM_DAEMON_UID"), daemon)
		}
	}
}

// TestPeersManifest: daemonset-peers.yaml is daemonset.yaml with peers
// (docs/peers.md, "Kubernetes"): a headless Service over every daemon's
// pod, ready or not; one port for --listen-peers, the container, the
// Service and --peer-service, whose name is the Service's; --node the
// pod's node; the secret a copy in memory that the daemon's uid owns,
// made from the Secret by an init container (the daemon refuses the
// Secret volume's files, symbolic links owned by root); and nothing else
// changed.
func TestPeersManifest(t *testing.T) {
	all := manifests(t)
	plain := one[*appsv1.DaemonSet](t, all, "daemonset.yaml")
	ds := one[*appsv1.DaemonSet](t, all, "daemonset-peers.yaml")
	svc := one[*corev1.Service](t, all, "daemonset-peers.yaml")
	spec := &ds.Spec.Template.Spec
	c := spec.Containers[0]

	if svc.Spec.ClusterIP != corev1.ClusterIPNone || !svc.Spec.PublishNotReadyAddresses ||
		!matches(svc.Spec.Selector, ds.Spec.Template.Labels) || svc.Namespace != ds.Namespace {
		t.Errorf("the peers' Service must be headless (clusterIP: None), publish pods not ready, and select the daemon's pods in its namespace: %+v", svc.Spec)
	}
	_, listen, _ := strings.Cut(argValue(c.Args, "--listen-peers"), ":")
	var named int32
	for _, p := range c.Ports {
		if p.Name == "peers" {
			named = p.ContainerPort
		}
	}
	if listen == "" || strconv.Itoa(int(named)) != listen || len(svc.Spec.Ports) != 1 ||
		svc.Spec.Ports[0].TargetPort.StrVal != "peers" || strconv.Itoa(int(svc.Spec.Ports[0].Port)) != listen {
		t.Errorf("--listen-peers %q, port named peers %d, Service ports %+v: want one port throughout", argValue(c.Args, "--listen-peers"), named, svc.Spec.Ports)
	}
	// A headless Service's addresses are the pods': the port is theirs.
	host, port, err := net.SplitHostPort(argValue(c.Args, "--peer-service"))
	name := svc.Name + "." + svc.Namespace + ".svc"
	if err != nil || port != listen || host != name && !strings.HasPrefix(host, name+".") {
		t.Errorf("--peer-service %q: want %s:%s", argValue(c.Args, "--peer-service"), name, listen)
	}
	var nodeName string
	for _, e := range c.Env {
		if e.Name == "NODE_NAME" && e.ValueFrom != nil && e.ValueFrom.FieldRef != nil {
			nodeName = e.ValueFrom.FieldRef.FieldPath
		}
	}
	if argValue(c.Args, "--node") != "$(NODE_NAME)" || nodeName != "spec.nodeName" {
		t.Errorf("--node %q, NODE_NAME from %q: want the pod's spec.nodeName", argValue(c.Args, "--node"), nodeName)
	}

	// The secret: a file in a tmpfs emptyDir, written by an init container
	// from the Secret, which the daemon does not mount.
	file := argValue(c.Args, "--peer-secret")
	key := mountedVolume(spec, c, path.Dir(file))
	if key == nil || key.EmptyDir == nil || key.EmptyDir.Medium != corev1.StorageMediumMemory {
		t.Fatalf("--peer-secret %q: want a file in an emptyDir of medium Memory, not the Secret's volume (symbolic links, root's): %+v", file, key)
	}
	var copier *corev1.Container
	var secret *corev1.Volume
	for _, ic := range spec.InitContainers {
		if v := mountedVolume(spec, ic, path.Dir(file)); v != nil && v.Name == key.Name {
			copier = &ic
			for _, m := range ic.VolumeMounts {
				if v := volumeNamed(spec, m.Name); v != nil && v.Secret != nil {
					secret = v
				}
			}
		}
	}
	uid := fmt.Sprint(*c.SecurityContext.RunAsUser)
	if copier == nil || secret == nil {
		t.Fatalf("no init container writes %s from a Secret", file)
	}
	cmd := strings.Join(copier.Command, " ")
	if !strings.Contains(cmd, " "+file) || !strings.Contains(cmd, "chown "+uid+":") || !strings.Contains(cmd, "chmod 0400 "+file) {
		t.Errorf("init container %s: %q: want it to copy the secret to %s, mode 0400, owned by the daemon's uid %s", copier.Name, cmd, file, uid)
	}
	if secret.Secret.SecretName != "gpushm-peer-secret" || secret.Secret.DefaultMode == nil || *secret.Secret.DefaultMode&0o077 != 0 {
		t.Errorf("Secret volume %+v: want gpushm-peer-secret, readable by its owner alone", secret.Secret)
	}
	for _, m := range c.VolumeMounts {
		if m.Name == secret.Name {
			t.Errorf("the daemon mounts the Secret's volume at %s: it is the init container's", m.MountPath)
		}
	}

	// Root, to start the pull helpers as a user of their own, with no
	// capability but the two that takes.
	if sc := c.SecurityContext; sc == nil || sc.RunAsUser == nil || *sc.RunAsUser != 0 || sc.Capabilities == nil ||
		!slices.Contains(sc.Capabilities.Drop, "ALL") || !slices.Equal(sc.Capabilities.Add, []corev1.Capability{"SETUID", "SETGID"}) ||
		sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
		t.Errorf("daemonset-peers.yaml: the daemon should run as root with SETUID and SETGID alone: %+v", sc)
	}

	// Nothing else: without the peers' parts, it is daemonset.yaml, but
	// for the user the daemon runs as, and so owns the socket's
	// directory as.
	bare := ds.DeepCopy()
	bs := &bare.Spec.Template.Spec
	bc := &bs.Containers[0]
	bc.SecurityContext = plain.Spec.Template.Spec.Containers[0].SecurityContext.DeepCopy()
	for i := range bs.InitContainers {
		for j := range bs.InitContainers[i].Command {
			bs.InitContainers[i].Command[j] = strings.ReplaceAll(bs.InitContainers[i].Command[j], "chown 0:0 /run/gpushm ", "chown 65532:65532 /run/gpushm ")
		}
	}
	bc.Args = slices.DeleteFunc(bc.Args, func(a string) bool {
		f, _, _ := strings.Cut(a, "=")
		return slices.Contains([]string{"--listen-peers", "--peer-service", "--peer-secret", "--node"}, f)
	})
	bc.Env = slices.DeleteFunc(bc.Env, func(e corev1.EnvVar) bool { return e.Name == "NODE_NAME" })
	bc.Ports = slices.DeleteFunc(bc.Ports, func(p corev1.ContainerPort) bool { return p.Name == "peers" })
	bc.VolumeMounts = slices.DeleteFunc(bc.VolumeMounts, func(m corev1.VolumeMount) bool { return m.Name == key.Name })
	bs.InitContainers = slices.DeleteFunc(bs.InitContainers, func(ic corev1.Container) bool { return ic.Name == copier.Name })
	bs.Volumes = slices.DeleteFunc(bs.Volumes, func(v corev1.Volume) bool { return v.Name == key.Name || v.Name == secret.Name })
	got, _ := json.Marshal(bare)
	want, _ := json.Marshal(plain)
	if string(got) != string(want) {
		i := 0
		for i < min(len(got), len(want)) && got[i] == want[i] {
			i++
		}
		t.Errorf("daemonset-peers.yaml differs from daemonset.yaml beyond the peers, at\n  %s\nwhere daemonset.yaml has\n  %s",
			got[max(0, i-80):min(len(got), i+80)], want[max(0, i-80):min(len(want), i+80)])
	}
}

// mountedVolume is the pod's volume that c mounts at dir, or nil.
func mountedVolume(spec *corev1.PodSpec, c corev1.Container, dir string) *corev1.Volume {
	for _, m := range c.VolumeMounts {
		if m.MountPath == dir {
			return volumeNamed(spec, m.Name)
		}
	}
	return nil
}

func volumeNamed(spec *corev1.PodSpec, name string) *corev1.Volume {
	for i := range spec.Volumes {
		if spec.Volumes[i].Name == name {
			return &spec.Volumes[i]
		}
	}
	return nil
}

func checkDaemonSet(t *testing.T, ds *appsv1.DaemonSet) {
	spec := &ds.Spec.Template.Spec
	if ds.Spec.Selector == nil || !matches(ds.Spec.Selector.MatchLabels, ds.Spec.Template.Labels) {
		t.Errorf("selector %v does not select the pod template's labels %v", ds.Spec.Selector, ds.Spec.Template.Labels)
	}
	if ds.Spec.UpdateStrategy.Type != appsv1.OnDeleteDaemonSetStrategyType {
		t.Error("a rollout would restart every daemon and free every segment: want updateStrategy OnDelete")
	}
	if len(spec.NodeSelector) == 0 && (spec.Affinity == nil || spec.Affinity.NodeAffinity == nil) {
		t.Error("no nodeSelector or node affinity: the daemon belongs on GPU nodes only")
	}
	checkPod(t, ds.Name, spec)
	if len(spec.Containers) != 1 {
		t.Fatalf("%d containers, want the daemon alone", len(spec.Containers))
	}
	c := spec.Containers[0]
	if len(c.Args) == 0 || c.Args[0] != "daemon" {
		t.Errorf("args %v: want 'daemon' first", c.Args)
	}
	socket := argValue(c.Args, "--socket")
	if socket == "" || mountedHostPath(spec, c, path.Dir(socket)) != path.Dir(socket) {
		t.Errorf("--socket %q: its directory must be the same hostPath on the node", socket)
	}
	if c.ReadinessProbe == nil || c.ReadinessProbe.Exec == nil || !slices.Equal(c.ReadinessProbe.Exec.Command, []string{"/usr/bin/gpushm", "info"}) {
		t.Errorf("readiness probe %+v, want exec /usr/bin/gpushm info", c.ReadinessProbe)
	}
	if c.LivenessProbe != nil {
		t.Error("a liveness probe would restart the daemon, freeing every segment")
	}
	if _, ok := c.Resources.Limits[corev1.ResourceName("nvidia.com/gpu")]; ok {
		t.Error("the daemon must not take GPUs from the scheduler (NVIDIA_VISIBLE_DEVICES=all gives it every GPU)")
	}
	if env(c, "NVIDIA_VISIBLE_DEVICES") != "all" || !strings.Contains(env(c, "NVIDIA_DRIVER_CAPABILITIES"), "utility") {
		t.Error("the daemon needs every GPU (NVIDIA_VISIBLE_DEVICES=all) and NVML (NVIDIA_DRIVER_CAPABILITIES with utility)")
	}
	// Metrics: the flag, the container port and the scrape annotations agree.
	listen := argValue(c.Args, "--metrics-listen")
	_, port, _ := strings.Cut(listen, ":")
	var named int32
	for _, p := range c.Ports {
		if p.Name == "metrics" {
			named = p.ContainerPort
		}
	}
	ann := ds.Spec.Template.Annotations
	if port == "" || strconv.Itoa(int(named)) != port || ann["prometheus.io/port"] != port || ann["prometheus.io/scrape"] != "true" {
		t.Errorf("metrics: --metrics-listen %q, port named metrics %d, annotations %v: want one port throughout", listen, named, ann)
	}
}

// checkPod checks what every pod spec here must get right.
func checkPod(t *testing.T, name string, spec *corev1.PodSpec) {
	t.Helper()
	volumes := map[string]bool{}
	for _, v := range spec.Volumes {
		volumes[v.Name] = true
	}
	for _, c := range append(slices.Clone(spec.InitContainers), spec.Containers...) {
		if c.Image == "" {
			t.Errorf("%s: container %s has no image", name, c.Name)
		}
		if c.Resources.Requests.Cpu().IsZero() || c.Resources.Requests.Memory().IsZero() || c.Resources.Limits.Memory().IsZero() {
			t.Errorf("%s: container %s needs cpu and memory requests and a memory limit", name, c.Name)
		}
		for _, m := range c.VolumeMounts {
			if !volumes[m.Name] {
				t.Errorf("%s: container %s mounts volume %q, which the pod does not declare", name, c.Name, m.Name)
			}
			bidirectional := m.MountPropagation != nil && *m.MountPropagation == corev1.MountPropagationBidirectional
			privileged := c.SecurityContext != nil && c.SecurityContext.Privileged != nil && *c.SecurityContext.Privileged
			if bidirectional && !privileged {
				t.Errorf("%s: container %s: Bidirectional mount propagation needs a privileged container", name, c.Name)
			}
		}
	}
}

// mountedHostPath is the node path that c sees at dir, or "".
func mountedHostPath(spec *corev1.PodSpec, c corev1.Container, dir string) string {
	for _, m := range c.VolumeMounts {
		if m.MountPath != dir {
			continue
		}
		for _, v := range spec.Volumes {
			if v.Name == m.Name && v.HostPath != nil {
				return v.HostPath.Path
			}
		}
	}
	return ""
}

func argValue(args []string, flag string) string {
	for i, a := range args {
		if v, ok := strings.CutPrefix(a, flag+"="); ok {
			return v
		}
		if a == flag && i+1 < len(args) {
			return args[i+1]
		}
	}
	return ""
}

func env(c corev1.Container, name string) string {
	for _, e := range c.Env {
		if e.Name == name {
			return e.Value
		}
	}
	return ""
}

func matches(selector, labels map[string]string) bool {
	if len(selector) == 0 {
		return false
	}
	for k, v := range selector {
		if labels[k] != v {
			return false
		}
	}
	return true
}
