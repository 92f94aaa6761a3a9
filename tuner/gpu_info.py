"""The GPU being measured and the machine around it: its name, key (h100, h200, …), properties, limits and the
software versions and command line a run records (provenance)."""

from __future__ import annotations

import functools
import os
import platform
import re
import socket
import subprocess
import sys
import warnings
from dataclasses import asdict, dataclass
from importlib import metadata

import torch

from normtune.kernels import device as kernel_device
from normtune.kernels.device import gpu_key  # noqa: F401 - re-exported: the tuner's GPU keys are the runtime's
from normtune.kernels.device import vendor_of
from normtune.kernels.limits import STAND_INS, DeviceLimits, recorded

INTERPRET_KEY = "interpret"

# The tuner's dtype names (kernels.config.DTYPES) as torch dtypes.
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class NoGPUError(RuntimeError):
    """No CUDA device where one is needed."""


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    key: str
    compute_capability: str | None
    sm_count: int
    l2_bytes: int
    memory_bytes: int
    driver: str | None
    cuda: str | None
    torch: str
    triton: str
    normtune: str
    git_revision: str | None
    host: str
    python: str
    interpret: bool

    def to_dict(self) -> dict:
        return asdict(self)


def _package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=None)
def git_revision() -> str | None:
    """The checkout's revision (with '-dirty' when it has uncommitted changes), or None outside git.
    $NORMTUNE_GIT_REVISION overrides it (a copy of the tree without .git, e.g. on a remote GPU host)."""
    if os.environ.get("NORMTUNE_GIT_REVISION"):
        return os.environ["NORMTUNE_GIT_REVISION"]
    return read_revision(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# Git commands that only read: no optional locks (`git status` would otherwise take .git/index.lock to refresh the
# index, and a git command the user runs at that moment fails), no external diff driver, no pager.
_GIT_READ_ONLY = {"GIT_OPTIONAL_LOCKS": "0", "GIT_PAGER": "cat"}


def read_revision(root: str) -> str | None:
    """HEAD of the git checkout at `root`, '-dirty' when a tracked file differs from it; None outside git. Reads
    only: `git rev-parse` and `git diff --quiet`, never `git status`, and no lock is taken."""
    env = {**os.environ, **_GIT_READ_ONLY}
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5,
                             env=env)
        if rev.returncode != 0:
            return None
        diff = subprocess.run(["git", "diff", "--no-ext-diff", "--quiet", "HEAD", "--"], cwd=root,
                              capture_output=True, timeout=5, env=env)
        return rev.stdout.strip() + ("-dirty" if diff.returncode != 0 else "")
    except (OSError, subprocess.SubprocessError):
        return None


@functools.lru_cache(maxsize=None)
def module_driver_version(text: str) -> str | None:
    """The driver version in the text of /proc/driver/nvidia/version (proprietary or open kernel module)."""
    found = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+(?:\.\d+)+)", text)
    return found.group(1) if found else None


def _driver_version() -> str | None:
    """The NVIDIA driver's version: from the kernel module's /proc entry where Linux has it (instant), else
    nvidia-smi (which takes seconds on a host whose GPUs are not held initialized)."""
    try:
        with open("/proc/driver/nvidia/version") as fh:
            found = module_driver_version(fh.read())
        if found:
            return found
    except OSError:
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def detect(device: int | str | torch.device | None = None, *, interpret: bool = False) -> DeviceInfo:
    """Describe the device that will be measured. `interpret=True` describes the CPU interpreter stand-in."""
    import triton

    from normtune.kernels.device import INTERPRET_SM_COUNT

    common = dict(torch=torch.__version__, triton=triton.__version__, normtune=_package_version("normtune") or "0+unknown",
                  git_revision=git_revision(), host=socket.gethostname(), python=platform.python_version())
    if interpret:
        return DeviceInfo(name="cpu (triton interpreter)", key=INTERPRET_KEY, compute_capability=None,
                          sm_count=INTERPRET_SM_COUNT, l2_bytes=4 * 2**20, memory_bytes=0, driver=None, cuda=None,
                          interpret=True, **common)
    if not torch.cuda.is_available():
        raise NoGPUError("a CUDA GPU is needed and none is visible: run on a GPU host, or pass --interpret to "
                         "run the same pipeline on CPU through the Triton interpreter")
    dev = torch.device("cuda", device if isinstance(device, int) else torch.cuda.current_device()) \
        if not isinstance(device, (str, torch.device)) else torch.device(device)
    props = torch.cuda.get_device_properties(dev)
    l2 = int(getattr(props, "L2_cache_size", 0) or 50 * 2**20)
    return DeviceInfo(name=props.name, key=gpu_key(props.name), compute_capability=f"{props.major}.{props.minor}",
                      sm_count=props.multi_processor_count, l2_bytes=l2, memory_bytes=int(props.total_memory),
                      driver=_driver_version(), cuda=torch.version.cuda, interpret=False, **common)


def check_gpu_key(requested: str, info: DeviceInfo) -> str:
    """`--gpu` must name the detected device ('auto' takes it). Returns the key to label results with."""
    requested = requested.strip().lower()
    if requested == "auto":
        return info.key
    if info.interpret:
        return requested  # interpreter runs are labelled as such by DeviceInfo.interpret, whatever --gpu says
    if requested != info.key:
        raise ValueError(f"--gpu {requested} does not match the detected device: requested {requested!r}, "
                         f"detected {info.key!r} ({info.name}). Pass --gpu {info.key} or --gpu auto")
    return requested


def measured_limits(device: torch.device) -> DeviceLimits | None:
    """The limits of the GPU measured on, read as the runtime reads them (`kernels.device.device_limits`): what
    sizes the analytic default the runtime runs there, and so the "default" a command times. None on CPU (the
    interpreter), where the runtime sizes it for the reference device."""
    return kernel_device.device_limits(device) if device.type == "cuda" else None


def run_limits(info: DeviceInfo) -> DeviceLimits | None:
    """The limits of the GPU a stored run measured on, for the commands that read stored runs away from it
    (emit, report): see `stored_limits`."""
    return stored_limits(info.key, info.name, info.compute_capability, info.sm_count, info.interpret)


@functools.lru_cache(maxsize=None)
def stored_limits(key: str, name: str | None, compute_capability: str | None, sm_count: int | None,
                  interpret: bool = False) -> DeviceLimits | None:
    """The limits of a GPU known only by what was recorded of it (a run's device, a table's "gpu"): its stand-in
    or what its compute capability gives (`kernels.limits.recorded`); None for the interpreter (the reference
    device's). Warns, once, where neither describes the GPU and its limits are assumed."""
    if interpret:
        return None
    try:
        cc = tuple(int(x) for x in compute_capability.split(".")[:2]) if compute_capability else None
    except ValueError:
        cc = None
    limits, note = recorded(key if key in STAND_INS else gpu_key(name or key), name, sm_count, cc,
                            vendor_of(name or key))
    if note:
        warnings.warn(f"normtune: {note}; the analytic default named for it may differ from the one it runs "
                      "there", stacklevel=3)
    return limits


def peer_versions() -> dict[str, str | None]:
    """The installed versions of the peer libraries `bench` times (None: not installed)."""
    return {name: _package_version(dist)
            for name, dist in (("liger_kernel", "liger-kernel"), ("quack", "quack-kernels"))}


def tool_versions() -> dict[str, str | None]:
    """The installed versions of the tuner's own libraries (recorded with a bench run; never peers)."""
    return {name: _package_version(name) for name in ("optuna", "sqlalchemy")}


def command_line(argv: list[str] | None = None) -> str:
    """The command that made a run, for its provenance, without the machine's paths: the program by its name,
    paths under the working folder relative to it, and paths under the home folder as ~/…"""
    argv = list(sys.argv if argv is None else argv)
    if not argv:
        return ""
    cwd, home = os.getcwd().rstrip(os.sep) + os.sep, os.path.expanduser("~").rstrip(os.sep) + os.sep
    args = [a.replace(cwd, "") for a in argv[1:]]
    if home != os.sep:
        args = [a.replace(home, "~" + os.sep) for a in args]
    return " ".join([os.path.basename(argv[0])] + args)
