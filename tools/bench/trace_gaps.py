"""Where the GPU waited for the host: idle gaps of a torch.profiler chrome trace, attributed to host work.

    python tools/bench/trace_gaps.py TRACE.json[.gz] [--top 25]

Reads a trace exported by ``torch.profiler`` (``prof.export_chrome_trace``) with CPU and CUDA
activity. GPU activity = kernels, memcpys and memsets on any stream, merged into busy intervals;
an *idle gap* is time between the first host event and the last GPU event when no GPU work runs.
Each gap is sampled every ``--sample_us`` microseconds; a sample is charged to the innermost host
event running at that instant (over all host threads, the one that started last: during backward
that is the autograd engine's thread, not the main thread blocked in ``run_backward``), and to the
innermost ``record_function`` range (``user_annotation``) around it: the *phase*.

Prints one JSON line: wall / busy / idle seconds, the number of gaps, the idle seconds by host
operation and by phase (largest first), and ``host_syncs``: the runtime calls that wait for the device
(:data:`SYNC_CALLS`: stream syncs, the allocator's cudaFree, blocking copies) as "call @ phase" ->
[count, seconds]. A sync leaves the GPU idle after it while the host catches up, time charged to the
host ops that run then. A host-bound step shows idle time spread over the ops
that launch kernels; a device sync shows as idle time under ``cudaStreamSynchronize`` / ``aten::item``
followed by host work.
"""
from __future__ import annotations

import argparse
import bisect
import gzip
import json
import os
import sys
from collections import defaultdict

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/: common.py
from common import emit  # noqa: E402

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
#: runtime calls that block the host until the device has finished earlier work (cudaFree: the caching
#: allocator freeing its cache to allocate again; cudaMemcpy: a copy from pageable memory or to the host)
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaFree", "cudaFreeHost",
              "cudaMemcpy", "cuMemFree", "cuMemFree_v2")
HOST_CATS = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver", "python_function")


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _busy(events: list[dict]) -> list[tuple[float, float]]:
    iv = sorted((e["ts"], e["ts"] + e.get("dur", 0.0)) for e in events if e.get("cat") in GPU_CATS and e.get("ph") == "X")
    out: list[list[float]] = []
    for a, b in iv:
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


class _Thread:
    """One host thread's complete events, sorted by start; innermost event covering a time."""

    def __init__(self, evs: list[dict]):
        evs.sort(key=lambda e: (e["ts"], -e.get("dur", 0.0)))
        self.ev = evs
        self.starts = [e["ts"] for e in evs]
        self.parent = []  # index of the enclosing event (events of one thread nest)
        stack: list[int] = []
        for i, e in enumerate(evs):
            while stack and evs[stack[-1]]["ts"] + evs[stack[-1]].get("dur", 0.0) < e["ts"]:
                stack.pop()
            self.parent.append(stack[-1] if stack else -1)
            stack.append(i)

    def innermost(self, t: float, cat=None):
        """The innermost event (of category ``cat``) running at ``t``: among the events started by
        then, the latest-started one still running; every event running at ``t`` encloses the
        last one started, so only its chain of enclosing events is searched."""
        i = bisect.bisect_right(self.starts, t) - 1
        while i >= 0:
            e = self.ev[i]
            if e["ts"] + e.get("dur", 0.0) >= t and (cat is None or e.get("cat") == cat):
                return e
            i = self.parent[i]
        return None


def gaps_report(events: list[dict], sample_us: float = 5.0, top: int = 25, min_gap_us: float = 2.0) -> dict:
    """Idle gaps of the GPU timeline ``events`` and the host work they are charged to (module doc)."""
    busy = _busy(events)
    host = [e for e in events if e.get("ph") == "X" and e.get("cat") in HOST_CATS]
    if not busy or not host:
        raise ValueError("the trace needs GPU activity (kernels) and host events: profile with CPU and CUDA")
    by_tid: dict = defaultdict(list)
    for e in host:
        by_tid[(e.get("pid"), e.get("tid"))].append(e)
    threads = [_Thread(v) for v in by_tid.values()]
    t0 = min(e["ts"] for e in host)
    t1 = busy[-1][1]
    gaps, prev = [], t0
    for a, b in busy:
        if a - prev >= min_gap_us:
            gaps.append((prev, a))
        prev = max(prev, b)
    by_op: dict = defaultdict(float)
    by_phase: dict = defaultdict(float)
    for a, b in gaps:
        t = a + sample_us / 2
        while t < b:
            best = None
            for th in threads:
                e = th.innermost(t)
                if e is not None and (best is None or e["ts"] > best[0]["ts"]):
                    best = (e, th)
            w = min(sample_us, b - t + sample_us / 2) / 1e6
            if best is None:
                by_op["(no host event)"] += w
                by_phase["(none)"] += w
            else:
                e, th = best
                by_op[e["name"]] += w
                ann = th.innermost(t, cat="user_annotation")
                if ann is None:  # the phase may be on another thread (backward runs in autograd's)
                    for other in threads:
                        ann = other.innermost(t, cat="user_annotation")
                        if ann is not None:
                            break
                by_phase[ann["name"] if ann is not None else "(none)"] += w
            t += sample_us
    syncs: dict = defaultdict(lambda: [0, 0.0])  # "call @ phase" -> [count, seconds]
    for th in threads:
        for e in th.ev:
            if e.get("cat") in ("cuda_runtime", "cuda_driver") and e["name"] in SYNC_CALLS:
                ann = th.innermost(e["ts"], cat="user_annotation")
                rec = syncs[f"{e['name']} @ {ann['name'] if ann is not None else '(none)'}"]
                rec[0] += 1
                rec[1] += e.get("dur", 0.0) / 1e6
    busy_s = sum(b - a for a, b in busy) / 1e6
    idle_s = sum(b - a for a, b in gaps) / 1e6

    def ranked(d):
        return {k[:80]: round(v, 6) for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:top]}

    return {"wall_s": round((t1 - t0) / 1e6, 6), "busy_s": round(busy_s, 6), "idle_s": round(idle_s, 6),
            "gaps": len(gaps), "gaps_over_1ms": sum(1 for a, b in gaps if b - a > 1000),
            "idle_by_op": ranked(by_op), "idle_by_phase": ranked(by_phase),
            "host_syncs": {k: [n, round(sec, 6)] for k, (n, sec) in sorted(syncs.items(), key=lambda kv: -kv[1][0])}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--sample_us", type=float, default=5.0)
    a = p.parse_args(argv)
    emit(gaps_report(load(a.trace), a.sample_us, a.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
