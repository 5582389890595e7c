package procbench

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"
)

// clockTick is the unit of /proc/<pid>/stat's CPU times (USER_HZ, 100 on
// every Linux architecture the benchmark runs on).
const clockTick = 10 * time.Millisecond

// Usage is a process's resource use read from /proc.
type Usage struct {
	// CPU is the process's own CPU time: the run time of its threads
	// (/proc/<pid>/task/*/schedstat, nanoseconds), or utime+stime (10 ms
	// ticks) where schedstat is missing. Threads that ended are not
	// counted; the Go runtime keeps its threads.
	CPU time.Duration
	// Switches is how many times its threads were put on a CPU (the third
	// field of the same schedstat files): the context switches into
	// kproxy, each a thread woken (0 where schedstat is missing).
	Switches int64
	// ChildCPU is the user and system time of its children: those it
	// waited for (cutime+cstime: iptables-restore, nft -f) and those
	// still running (utime+stime of each: the long-lived nft -i session
	// of nftables mode, which getrusage would count only once it ends).
	ChildCPU time.Duration
	// HWM is the peak resident set size (VmHWM); RSS the current one.
	HWM, RSS int64
}

// readUsage reads pid's Usage.
func readUsage(pid int) (Usage, error) {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return Usage{}, err
	}
	u, err := parseStatCPU(stat)
	if err != nil {
		return Usage{}, fmt.Errorf("/proc/%d/stat: %w", pid, err)
	}
	if run, switches, ok := threadsRunTime(pid); ok {
		u.CPU, u.Switches = run, switches
	}
	u.ChildCPU += liveChildrenCPU(pid)
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return Usage{}, err
	}
	if u.HWM, u.RSS, err = parseStatusMemory(status); err != nil {
		return Usage{}, fmt.Errorf("/proc/%d/status: %w", pid, err)
	}
	return u, nil
}

// liveChildrenCPU is the CPU time (utime+stime) of pid's running children,
// from /proc/<pid>/task/*/children. A child that ends between two reads
// moves from here to its parent's cutime+cstime once it is waited for.
func liveChildrenCPU(pid int) time.Duration {
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		return 0
	}
	var total time.Duration
	for _, t := range tasks {
		data, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/children", pid, t.Name()))
		if err != nil {
			continue
		}
		for _, c := range strings.Fields(string(data)) {
			cpid, err := strconv.Atoi(c)
			if err != nil {
				continue
			}
			if run, _, ok := threadsRunTime(cpid); ok {
				total += run
				continue
			}
			stat, err := os.ReadFile("/proc/" + c + "/stat")
			if err != nil {
				continue
			}
			if cu, err := parseStatCPU(stat); err == nil {
				total += cu.CPU
			}
		}
	}
	return total
}

// threadsRunTime sums the run time of pid's threads (the first field of
// /proc/<pid>/task/<tid>/schedstat, in nanoseconds) and the times they
// were put on a CPU (the third); ok is false when they cannot be read.
func threadsRunTime(pid int) (run time.Duration, switches int64, ok bool) {
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		return 0, 0, false
	}
	for _, t := range tasks {
		data, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/schedstat", pid, t.Name()))
		if err != nil {
			continue // the thread ended
		}
		ns, n, err := parseSchedstat(data)
		if err != nil {
			return 0, 0, false
		}
		run += ns
		switches += n
	}
	return run, switches, true
}

// parseSchedstat reads a schedstat file: run time (ns), time waiting to
// run (ns), times run.
func parseSchedstat(data []byte) (time.Duration, int64, error) {
	f := strings.Fields(string(data))
	if len(f) < 3 {
		return 0, 0, fmt.Errorf("malformed schedstat %q", data)
	}
	ns, err := strconv.ParseInt(f[0], 10, 64)
	if err != nil {
		return 0, 0, err
	}
	n, err := strconv.ParseInt(f[2], 10, 64)
	if err != nil {
		return 0, 0, err
	}
	return time.Duration(ns), n, nil
}

// parseStatCPU reads utime, stime, cutime and cstime (fields 14 to 17) of
// /proc/<pid>/stat. The command name (field 2) may hold spaces and
// parentheses, so fields are counted after its last ')'.
func parseStatCPU(data []byte) (Usage, error) {
	i := bytes.LastIndexByte(data, ')')
	if i < 0 {
		return Usage{}, errors.New("malformed stat: no ')'")
	}
	f := strings.Fields(string(data[i+1:]))
	// f[0] is field 3; fields 14..17 are f[11..14].
	if len(f) < 15 {
		return Usage{}, fmt.Errorf("malformed stat: %d fields after the name", len(f))
	}
	var ticks [4]int64
	for k := range ticks {
		v, err := strconv.ParseInt(f[11+k], 10, 64)
		if err != nil {
			return Usage{}, fmt.Errorf("malformed stat field %d %q: %w", 14+k, f[11+k], err)
		}
		ticks[k] = v
	}
	return Usage{
		CPU:      time.Duration(ticks[0]+ticks[1]) * clockTick,
		ChildCPU: time.Duration(ticks[2]+ticks[3]) * clockTick,
	}, nil
}

// parseStatusMemory reads VmHWM and VmRSS (bytes) of /proc/<pid>/status.
func parseStatusMemory(data []byte) (hwm, rss int64, err error) {
	found := 0
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		key, val, ok := strings.Cut(sc.Text(), ":")
		if !ok || (key != "VmHWM" && key != "VmRSS") {
			continue
		}
		f := strings.Fields(val)
		if len(f) != 2 || f[1] != "kB" {
			return 0, 0, fmt.Errorf("malformed %s line %q", key, sc.Text())
		}
		kb, err := strconv.ParseInt(f[0], 10, 64)
		if err != nil {
			return 0, 0, fmt.Errorf("malformed %s: %w", key, err)
		}
		if key == "VmHWM" {
			hwm = kb * 1024
		} else {
			rss = kb * 1024
		}
		found++
	}
	if err := sc.Err(); err != nil {
		return 0, 0, err
	}
	if found != 2 {
		return 0, 0, errors.New("no VmHWM or VmRSS (a kernel thread, or the process exited)")
	}
	return hwm, rss, nil
}
