// Command oracle answers what one kubelet release would do at start-up with a KubeletConfiguration,
// its --config-dir drop-ins and a machine: it runs that release's own code (k8s.io/kubernetes at the
// version its go.mod pins) through the steps cmd/kubelet/app takes before the node comes up.
//
// Input: JSON lines on stdin, one case each: {"id", "config" (the main file's text), "dropins"
// ([[name, text], ...]), "sysfs" (a fixture sysfs root), "cgroup" (1 or 2)}. Output: one JSON line per
// case, {"id", "accept", "reason"}, in input order. Many cases run in one process; the feature gates
// are copied fresh for every case.
//
// -gates prints the feature gates this kubelet knows ({name: {default, locked, prerelease, depends}}) and
// -version the k8s.io/kubernetes module version the binary was built from.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime/debug"
	"sort"

	utilfeature "k8s.io/apiserver/pkg/util/feature"
	"k8s.io/component-base/featuregate"
	logsapi "k8s.io/component-base/logs/api/v1"
	"k8s.io/klog/v2"
	_ "k8s.io/kubernetes/pkg/features" // registers the kubelet's gates with utilfeature
)

type testCase struct {
	ID      string      `json:"id"`
	Config  string      `json:"config"`
	Dropins [][2]string `json:"dropins"`
	Sysfs   string      `json:"sysfs"`
	Cgroup  int         `json:"cgroup"`
}

type verdict struct {
	ID     string `json:"id"`
	Accept bool   `json:"accept"`
	Reason string `json:"reason"`
}

func moduleVersion() string {
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return "unknown"
	}
	for _, dep := range info.Deps {
		if dep.Path == "k8s.io/kubernetes" {
			return dep.Version
		}
	}
	return "unknown"
}

type gateInfo struct {
	Default    bool     `json:"default"`
	Locked     bool     `json:"locked"`
	PreRelease string   `json:"prerelease"`
	Depends    []string `json:"depends,omitempty"`
}

func dumpGates() error {
	out := map[string]gateInfo{}
	deps := utilfeature.DefaultMutableFeatureGate.Dependencies()
	for name, spec := range utilfeature.DefaultMutableFeatureGate.GetAll() {
		info := gateInfo{Default: spec.Default, Locked: spec.LockToDefault, PreRelease: string(spec.PreRelease)}
		for _, d := range deps[name] {
			info.Depends = append(info.Depends, string(d))
		}
		sort.Strings(info.Depends)
		out[string(name)] = info
	}
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", " ")
	return enc.Encode(out)
}

// NewKubeletCommand registers the logging gates beside the ones pkg/features registers at init.
func init() {
	if err := logsapi.AddFeatureGates(utilfeature.DefaultMutableFeatureGate); err != nil {
		panic(err)
	}
}

func main() {
	gates := flag.Bool("gates", false, "print the feature gates this kubelet knows")
	version := flag.Bool("version", false, "print the k8s.io/kubernetes version")
	flag.Parse()
	switch {
	case *version:
		fmt.Println(moduleVersion())
		return
	case *gates:
		if err := dumpGates(); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		return
	}
	// The managers log at info level; only the verdicts go to stdout.
	var logFlags flag.FlagSet
	klog.InitFlags(&logFlags)
	_ = logFlags.Set("logtostderr", "false")
	_ = logFlags.Set("stderrthreshold", "FATAL")
	klog.SetOutput(io.Discard)
	pristine := utilfeature.DefaultMutableFeatureGate.DeepCopy()
	in := bufio.NewScanner(os.Stdin)
	in.Buffer(make([]byte, 1<<20), 64<<20)
	out := bufio.NewWriter(os.Stdout)
	defer out.Flush()
	enc := json.NewEncoder(out)
	for in.Scan() {
		var c testCase
		if err := json.Unmarshal(in.Bytes(), &c); err != nil {
			fmt.Fprintf(os.Stderr, "oracle: a line of input is not a case: %v\n", err)
			os.Exit(2)
		}
		gate := pristine.DeepCopy()
		// The managers read the process-wide gate, as they do inside kubelet.
		utilfeature.DefaultMutableFeatureGate = gate
		utilfeature.DefaultFeatureGate = gate
		v := verdict{ID: c.ID, Accept: true}
		if err := judge(context.Background(), c, gate); err != nil {
			var fault *faultError
			if errors.As(err, &fault) {
				// The oracle could not set the case up: no answer is better than a wrong one.
				out.Flush()
				fmt.Fprintf(os.Stderr, "oracle: case %s: %v\n", c.ID, err)
				os.Exit(2)
			}
			v.Accept, v.Reason = false, err.Error()
		}
		if err := enc.Encode(v); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
	}
	if err := in.Err(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
}

// judge writes the case's files where kubelet would read them and runs the start-up steps. A panic
// is a refusal: kubelet panics while defaulting a file that names a gate it does not have.
func judge(ctx context.Context, c testCase, gate featuregate.MutableVersionedFeatureGate) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("panic: %v", p)
		}
	}()
	dir, err := os.MkdirTemp("", "lowtail-oracle-")
	if err != nil {
		return oracleFault("%w", err)
	}
	defer os.RemoveAll(dir)
	main := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(main, []byte(c.Config), 0o600); err != nil {
		return oracleFault("%w", err)
	}
	dropinDir := ""
	if len(c.Dropins) > 0 {
		dropinDir = filepath.Join(dir, "config.d")
		if err := os.Mkdir(dropinDir, 0o700); err != nil {
			return oracleFault("%w", err)
		}
		names := make([]string, 0, len(c.Dropins))
		for _, d := range c.Dropins {
			if err := os.WriteFile(filepath.Join(dropinDir, filepath.Base(d[0])), []byte(d[1]), 0o600); err != nil {
				return oracleFault("%w", err)
			}
			names = append(names, d[0])
		}
		sort.Strings(names)
	}
	stateDir := filepath.Join(dir, "root")
	if err := os.Mkdir(stateDir, 0o700); err != nil {
		return oracleFault("%w", err)
	}
	return startUp(ctx, main, dropinDir, c.Sysfs, c.Cgroup, stateDir, gate)
}

// faultError is the oracle's own failure (a file it cannot write, a machine it cannot read), never
// a verdict.
type faultError struct{ err error }

func (f *faultError) Error() string { return f.err.Error() }

func oracleFault(format string, args ...any) error {
	return &faultError{fmt.Errorf(format, args...)}
}
