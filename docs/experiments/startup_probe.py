"""What a process pays to start torch and the CUDA driver, alone and beside others starting at the same moment:
the start-up a sweep's measuring process pays while its compile processes start.

    python docs/experiments/startup_probe.py [GPUS]

Each row starts one process that imports torch, reads the device's properties (the driver starts, no context),
sets the device (a context) and allocates, beside N processes that each go as far as one of those steps: import
torch, read the properties, set the device, or all of it. It prints the median seconds of each step over the
processes and the slowest process's total, then lists which of two processes (one that only read the
properties, one that set the device) hold a context (`nvidia-smi --query-compute-apps`). Needs a CUDA host.
"""

import multiprocessing as mp
import subprocess
import sys
import time


def _start(kind: str, device: int, results, t0: float) -> None:
    """One process: import torch, then as far as `kind` says (import, props, setdev, ctx); reports each step."""
    a = time.time()
    import torch

    b = time.time()
    if kind in ("props", "setdev", "ctx"):
        torch.cuda.get_device_properties(device)  # the driver starts; no context
    c = time.time()
    if kind in ("setdev", "ctx"):
        torch.cuda.set_device(device)  # a context (CUDA 12)
    d = time.time()
    if kind == "ctx":
        torch.zeros(1, device=f"cuda:{device}")
        torch.cuda.synchronize()
    e = time.time()
    results.put((kind, device, b - a, c - b, d - c, e - d, e - t0))
    time.sleep(3)  # hold what it made while the others start


def _row(label: str, others: int, kind: str, gpus: int) -> None:
    ctx = mp.get_context("spawn")
    results, t0 = ctx.Queue(), time.time()
    procs = [ctx.Process(target=_start, args=("ctx", 0, results, t0))]
    procs += [ctx.Process(target=_start, args=(kind, i % gpus, results, t0)) for i in range(others)]
    for proc in procs:
        proc.start()
    rows = [results.get() for _ in procs]
    for proc in procs:
        proc.join()

    def median(i):
        return sorted(r[i] for r in rows)[len(rows) // 2]

    print(f"{label:40s} n={len(rows)} slowest {max(r[6] for r in rows):.2f} s; median import {median(2):.2f} "
          f"props {median(3):.2f} set_device {median(4):.2f} allocation {median(5):.2f}", flush=True)


def main() -> None:
    gpus = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    print(subprocess.run("nvidia-smi -q | grep -i 'persistence mode' | head -1", shell=True, capture_output=True,
                         text=True).stdout)
    _row("alone", 0, "ctx", 1)
    _row("alone again", 0, "ctx", 1)
    for kind, what in (("import", "importing torch"), ("props", "reading props"), ("setdev", "set_device"),
                       ("ctx", "contexts")):
        _row(f"beside 16 {what}", 16, kind, 1)
    if gpus > 1:
        _row(f"beside 56 set_device on {gpus} GPUs", 56, "setdev", gpus)
    ctx = mp.get_context("spawn")
    results, t0 = ctx.Queue(), time.time()
    procs = [ctx.Process(target=_start, args=(kind, 0, results, t0)) for kind in ("props", "setdev")]
    for proc in procs:
        proc.start()
    for _ in procs:
        results.get()
    print("processes that read props / set the device:", [p.pid for p in procs])
    print(subprocess.run("nvidia-smi --query-compute-apps=pid,used_memory --format=csv", shell=True,
                         capture_output=True, text=True).stdout)
    for proc in procs:
        proc.join()


if __name__ == "__main__":
    main()
