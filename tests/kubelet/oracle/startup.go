package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"

	jsonpatch "gopkg.in/evanphx/json-patch.v4"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/component-base/featuregate"
	"k8s.io/klog/v2"
	kubeletconfigv1beta1 "k8s.io/kubelet/config/v1beta1"
	"k8s.io/kubernetes/pkg/features"
	kubeletconfig "k8s.io/kubernetes/pkg/kubelet/apis/config"
	kubeletconfigconversion "k8s.io/kubernetes/pkg/kubelet/apis/config/v1beta1"
	kubeletvalidation "k8s.io/kubernetes/pkg/kubelet/apis/config/validation"
	"k8s.io/kubernetes/pkg/kubelet/cm/cpumanager"
	"k8s.io/kubernetes/pkg/kubelet/cm/cpumanager/topology"
	"k8s.io/kubernetes/pkg/kubelet/cm/memorymanager"
	"k8s.io/kubernetes/pkg/kubelet/cm/topologymanager"
	"k8s.io/kubernetes/pkg/kubelet/eviction"
	evictionapi "k8s.io/kubernetes/pkg/kubelet/eviction/api"
	"k8s.io/kubernetes/pkg/kubelet/kubeletconfig/configfiles"
	utilfs "k8s.io/kubernetes/pkg/util/filesystem"
	"k8s.io/utils/cpuset"
)

// startUp follows cmd/kubelet/app (NewKubeletCommand's RunE, then run()) and cm.NewContainerManager
// up to the resource managers, with this release's functions wherever they are exported. Steps
// that are unexported upstream (the drop-in merge, parseResourceList, hardEvictionReservation,
// the reserved-CPU override) are restated here from the same release and marked so.
func startUp(ctx context.Context, mainFile, dropinDir, sysfs string, cgroup int, stateDir string,
	gate featuregate.MutableVersionedFeatureGate) error {
	logger := klog.Background()
	loader, err := configfiles.NewFsLoader(&utilfs.DefaultFs{}, mainFile)
	if err != nil {
		return err
	}
	kc, err := loader.Load(ctx)
	if err != nil {
		return fmt.Errorf("failed to load kubelet config file: %w", err)
	}
	// loadConfigFile: kubelet's Linux eviction defaults when the file sets no evictionHard.
	if kc.EvictionHard == nil {
		kc.EvictionHard = eviction.DefaultEvictionHard
	} else if kc.MergeDefaultEvictionSettings {
		for k, v := range eviction.DefaultEvictionHard {
			if _, ok := kc.EvictionHard[k]; !ok {
				kc.EvictionHard[k] = v
			}
		}
	}
	if dropinDir != "" {
		if err := mergeDropins(kc, dropinDir); err != nil {
			return fmt.Errorf("failed to merge kubelet configs: %w", err)
		}
	}
	if err := gate.SetFromMap(kc.FeatureGates); err != nil {
		return fmt.Errorf("failed to set feature gates from initial flags-based config: %w", err)
	}
	// validateKubeletOSConfiguration reads the cgroup mode of the host it runs on; the case names the
	// host's mode, so its two cgroup v1 rules are applied here from the case and kept out of the call.
	if cgroup == 1 && kc.FailCgroupV1 {
		return fmt.Errorf("failed to validate kubelet configuration: kubelet is configured to not run on a host using cgroup v1. cgroup v1 support is unsupported and will be removed in a future release")
	}
	if cgroup == 1 && kc.SingleProcessOOMKill != nil && !*kc.SingleProcessOOMKill {
		return fmt.Errorf("failed to validate kubelet configuration: invalid configuration: singleProcessOOMKill must not be explicitly set to false when using cgroup v1")
	}
	checked := *kc
	checked.FailCgroupV1 = false
	checked.SingleProcessOOMKill = nil
	if err := kubeletvalidation.ValidateKubeletConfiguration(&checked, gate); err != nil {
		return fmt.Errorf("failed to validate kubelet configuration, error: %w", err)
	}

	doc, err := readMachine(sysfs)
	if err != nil {
		return oracleFault("machine %s: %w", sysfs, err)
	}
	machine, err := machineFor(topology.Discover, doc)
	if err != nil {
		return oracleFault("machine %s: %w", sysfs, err)
	}
	reservedCPUs := cpuset.New()
	if kc.ReservedSystemCPUs != "" {
		topo, err := topology.Discover(logger, machine)
		if err != nil {
			return fmt.Errorf("unable to discover CPU topology info: %s", err)
		}
		reservedCPUs, err = cpuset.Parse(kc.ReservedSystemCPUs)
		if err != nil {
			return fmt.Errorf("unable to parse reserved-cpus list: %s", err)
		}
		if all := topo.CPUDetails.CPUs(); !reservedCPUs.IsSubsetOf(all) {
			return fmt.Errorf("reserved-cpus: %s is not a subset of online-cpus: %s", kc.ReservedSystemCPUs, all.String())
		}
	}
	if reservedCPUs.Size() > 0 {
		delete(kc.KubeReserved, "cpu")
		if kc.SystemReserved == nil {
			kc.SystemReserved = map[string]string{}
		}
		kc.SystemReserved["cpu"] = strconv.Itoa(reservedCPUs.Size())
	}
	kubeReserved, err := parseResourceList(kc.KubeReserved)
	if err != nil {
		return fmt.Errorf("--kube-reserved value failed to parse: %w", err)
	}
	systemReserved, err := parseResourceList(kc.SystemReserved)
	if err != nil {
		return fmt.Errorf("--system-reserved value failed to parse: %w", err)
	}
	// --experimental-allocatable-ignore-eviction is a flag (off), not a field of the file.
	thresholds, err := eviction.ParseThresholdConfig([]string{}, kc.EvictionHard, nil, nil, nil)
	if err != nil {
		return err
	}
	var topologyOptions map[string]string
	if gate.Enabled(features.TopologyManagerPolicyOptions) {
		topologyOptions = kc.TopologyManagerPolicyOptions
	} else if kc.TopologyManagerPolicyOptions != nil {
		return fmt.Errorf("topology manager policy options %v require feature gates %q enabled",
			kc.TopologyManagerPolicyOptions, features.TopologyManagerPolicyOptions)
	}

	tm, err := newTopologyManager(logger, machine.Topology, kc.TopologyManagerPolicy, kc.TopologyManagerScope, topologyOptions)
	if err != nil {
		return err
	}
	reservation := allocatableReservation(machine.NumCores, machine.MemoryCapacity, kubeReserved, systemReserved, thresholds)
	if _, err := cpumanager.NewManager(logger, kc.CPUManagerPolicy, kc.CPUManagerPolicyOptions,
		kc.CPUManagerReconcilePeriod.Duration, machine, reservedCPUs, reservation, stateDir, tm); err != nil {
		return fmt.Errorf("failed to initialize cpu manager: %w", err)
	}
	if _, err := memorymanager.NewManager(logger, kc.MemoryManagerPolicy, machine, reservation,
		kc.ReservedMemory, stateDir, tm); err != nil {
		return fmt.Errorf("failed to initialize memory manager: %w", err)
	}
	return nil
}

// mergeDropins restates cmd/kubelet/app mergeKubeletConfigurations (unexported): internal -> v1beta1
// JSON, each *.conf file under the directory (lexical walk) decoded strictly and JSON-merge-patched
// over it, then defaulted and converted back.
func mergeDropins(kc *kubeletconfig.KubeletConfiguration, dir string) error {
	versioned := &kubeletconfigv1beta1.KubeletConfiguration{}
	if err := kubeletconfigconversion.Convert_config_KubeletConfiguration_To_v1beta1_KubeletConfiguration(kc, versioned, nil); err != nil {
		return err
	}
	base, err := json.Marshal(versioned)
	if err != nil {
		return err
	}
	err = filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || filepath.Ext(d.Name()) != ".conf" {
			return err
		}
		loader, err := configfiles.NewFsLoader(&utilfs.DefaultFs{}, path)
		if err != nil {
			return err
		}
		patch, gvk, err := loader.LoadIntoJSON()
		if err != nil {
			return fmt.Errorf("failed to load kubelet dropin file, path: %s, error: %w", path, err)
		}
		if gvk == nil || gvk.Empty() {
			return fmt.Errorf("failed to load kubelet dropin file, path: %s, no apiVersion/kind", path)
		}
		if *gvk != kubeletconfigv1beta1.SchemeGroupVersion.WithKind("KubeletConfiguration") {
			return fmt.Errorf("failed to load kubelet dropin file, path: %s, unknown apiVersion/kind: %v", path, gvk.String())
		}
		merged, err := jsonpatch.MergePatch(base, patch)
		if err != nil {
			return fmt.Errorf("failed to merge drop-in and current config: %w", err)
		}
		base = merged
		return nil
	})
	if err != nil {
		return fmt.Errorf("failed to walk through kubelet dropin directory %q: %w", dir, err)
	}
	versioned = &kubeletconfigv1beta1.KubeletConfiguration{}
	if err := json.Unmarshal(base, versioned); err != nil {
		return fmt.Errorf("failed to unmarshal merged JSON into kubelet configuration: %w", err)
	}
	kubeletconfigconversion.SetDefaults_KubeletConfiguration(versioned)
	return kubeletconfigconversion.Convert_v1beta1_KubeletConfiguration_To_config_KubeletConfiguration(versioned, kc, nil)
}

// parseResourceList restates cmd/kubelet/app parseResourceList (unexported).
func parseResourceList(m map[string]string) (v1.ResourceList, error) {
	if len(m) == 0 {
		return nil, nil
	}
	rl := v1.ResourceList{}
	for k, v := range m {
		switch v1.ResourceName(k) {
		case v1.ResourceCPU, v1.ResourceMemory, v1.ResourceEphemeralStorage, "pid":
			q, err := resource.ParseQuantity(v)
			if err != nil {
				return nil, fmt.Errorf("failed to parse quantity %q for %q resource: %w", v, k, err)
			}
			if q.Sign() == -1 {
				return nil, fmt.Errorf("resource quantity for %q cannot be negative: %v", k, v)
			}
			if v1.ResourceName(k) == v1.ResourceCPU {
				q.SetMilli((q.ScaledValue(resource.Micro) + 500) / 1000)
			}
			rl[v1.ResourceName(k)] = q
		default:
			return nil, fmt.Errorf("cannot reserve %q resource", k)
		}
	}
	return rl, nil
}

// allocatableReservation restates cm's GetNodeAllocatableReservation and hardEvictionReservation
// (unexported) for CPU and memory, over the capacity cadvisor reports.
func allocatableReservation(numCores int, memoryCapacity uint64, kube, system v1.ResourceList, thresholds []evictionapi.Threshold) v1.ResourceList {
	capacity := v1.ResourceList{
		v1.ResourceCPU:    *resource.NewMilliQuantity(int64(numCores*1000), resource.DecimalSI),
		v1.ResourceMemory: *resource.NewQuantity(int64(memoryCapacity), resource.BinarySI),
	}
	evicted := v1.ResourceList{}
	for _, t := range thresholds {
		if t.Operator == evictionapi.OpLessThan && t.Signal == evictionapi.SignalMemoryAvailable {
			mem := capacity[v1.ResourceMemory]
			evicted[v1.ResourceMemory] = *evictionapi.GetThresholdQuantity(t.Value, &mem)
		}
	}
	out := v1.ResourceList{}
	for k := range capacity {
		value := resource.NewQuantity(0, resource.DecimalSI)
		value.Add(system[k])
		value.Add(kube[k])
		value.Add(evicted[k])
		if !value.IsZero() {
			out[k] = *value
		}
	}
	return out
}

// nodeMemory is what each NUMA node of a fixture holds when its tree has no node meminfo.
const nodeMemory = 64 << 30

type jsonCore struct {
	ID      int   `json:"core_id"`
	Threads []int `json:"thread_ids"`
	Socket  int   `json:"socket_id"`
}

type jsonNode struct {
	ID        int        `json:"node_id"`
	Memory    uint64     `json:"memory"`
	Cores     []jsonCore `json:"cores"`
	Distances []uint64   `json:"distances"`
}

type jsonMachine struct {
	NumCores         int        `json:"num_cores"`
	NumPhysicalCores int        `json:"num_physical_cores"`
	NumSockets       int        `json:"num_sockets"`
	MemoryCapacity   uint64     `json:"memory_capacity"`
	Topology         []jsonNode `json:"topology"`
}

// machineFor decodes a machine into the MachineInfo type this release's CPU manager takes (cadvisor's
// info/v1 up to 1.36, cadvisor/lib/model from 1.37: the same JSON), named by topology.Discover's
// signature so that the oracle imports neither cadvisor module itself.
func machineFor[M any](_ func(klog.Logger, *M) (*topology.CPUTopology, error), doc []byte) (*M, error) {
	m := new(M)
	return m, json.Unmarshal(doc, m)
}

// readMachine reads a sysfs tree as cadvisor reads a real one (devices/system/node/node*/cpulist,
// devices/system/cpu/cpu*/topology/{core_id,physical_package_id}) into cadvisor's MachineInfo JSON.
func readMachine(sysfs string) ([]byte, error) {
	nodes, err := filepath.Glob(filepath.Join(sysfs, "devices/system/node/node[0-9]*"))
	if err != nil || len(nodes) == 0 {
		return nil, fmt.Errorf("no NUMA nodes under %s/devices/system/node", sysfs)
	}
	m := jsonMachine{}
	sockets := map[int]bool{}
	for _, node := range nodes {
		id, err := strconv.Atoi(strings.TrimPrefix(filepath.Base(node), "node"))
		if err != nil {
			return nil, err
		}
		text, err := os.ReadFile(filepath.Join(node, "cpulist"))
		if err != nil {
			return nil, err
		}
		cpus, err := cpuset.Parse(strings.TrimSpace(string(text)))
		if err != nil {
			return nil, err
		}
		n := jsonNode{ID: id, Memory: nodeMemory}
		cores := map[[2]int]int{} // (socket, core_id) -> index in n.Cores
		for _, cpu := range cpus.List() {
			base := filepath.Join(sysfs, fmt.Sprintf("devices/system/cpu/cpu%d/topology", cpu))
			core, err := readInt(filepath.Join(base, "core_id"))
			if err != nil {
				return nil, err
			}
			socket, err := readInt(filepath.Join(base, "physical_package_id"))
			if err != nil {
				return nil, err
			}
			sockets[socket] = true
			key := [2]int{socket, core}
			i, ok := cores[key]
			if !ok {
				i = len(n.Cores)
				cores[key] = i
				n.Cores = append(n.Cores, jsonCore{ID: core, Socket: socket})
			}
			n.Cores[i].Threads = append(n.Cores[i].Threads, cpu)
			m.NumCores++
		}
		m.NumPhysicalCores += len(n.Cores)
		m.Topology = append(m.Topology, n)
		m.MemoryCapacity += nodeMemory
	}
	m.NumSockets = len(sockets)
	// The SLIT distances cadvisor reads from node*/distance: the fixture's file when it has one, else
	// 10 to itself and 20 to every other node (what firmware reports for a two-hop-free machine).
	for i := range m.Topology {
		text, err := os.ReadFile(filepath.Join(sysfs, fmt.Sprintf("devices/system/node/node%d/distance", m.Topology[i].ID)))
		if err == nil {
			for _, f := range strings.Fields(string(text)) {
				d, err := strconv.ParseUint(f, 10, 64)
				if err != nil {
					return nil, err
				}
				m.Topology[i].Distances = append(m.Topology[i].Distances, d)
			}
			continue
		}
		for j := range m.Topology {
			d := uint64(20)
			if i == j {
				d = 10
			}
			m.Topology[i].Distances = append(m.Topology[i].Distances, d)
		}
	}
	return json.Marshal(m)
}

func readInt(path string) (int, error) {
	text, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	return strconv.Atoi(strings.TrimSpace(string(text)))
}

// newTopologyManager calls topologymanager.NewManager, which takes a logger first from 1.37 on; the
// call goes through reflect so that one source builds against every claimed release.
func newTopologyManager(logger klog.Logger, nodes any, policy, scope string, options map[string]string) (topologymanager.Manager, error) {
	f := reflect.ValueOf(topologymanager.NewManager)
	args := []reflect.Value{reflect.ValueOf(nodes), reflect.ValueOf(policy), reflect.ValueOf(scope), reflect.ValueOf(options)}
	if f.Type().NumIn() == 5 {
		args = append([]reflect.Value{reflect.ValueOf(logger)}, args...)
	}
	out := f.Call(args)
	if err, _ := out[1].Interface().(error); err != nil {
		return nil, err
	}
	return out[0].Interface().(topologymanager.Manager), nil
}
