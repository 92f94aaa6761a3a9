"""What a GPU holds and which launch features it has: `DeviceLimits`, read from the device's properties
(`device.device_limits`), with stand-ins for GPUs this code was not measured on so that tests and the offline
compile check can size configs for them.

The analytic default, config validation and the search space take their register, shared-memory, warp and SM
figures from a `DeviceLimits`; without one they use `REFERENCE`, the GPU the shipped tables were tuned on (and
what the Triton interpreter stands in for). Features that only some GPUs have are capabilities here, never assumed:
`kernels/strategies/capabilities.py` turns a config into the portable form a device runs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

VENDORS = ("nvidia", "amd")


@dataclass(frozen=True)
class DeviceLimits:
    """One GPU's resources and launch features.

    sm_count: SMs (AMD: compute units). shared_per_block: the most shared memory (AMD: LDS) one program may ask
    for; shared_per_sm: what one SM holds for all its programs. registers_per_sm: 32-bit registers of one SM's
    register file; max_registers_per_thread: the most one thread may hold (NVIDIA 255; AMD CDNA 256
    architectural VGPRs). warp_size: threads per warp (AMD: wavefront, 64 on CDNA). `num_warps` counts warps of
    this size, so a program has warp_size x num_warps threads, at most max_threads_per_block.
    """

    name: str
    vendor: str  # "nvidia" or "amd"
    arch: str  # "sm_90", "gfx942", …
    capability: tuple[int, int] | None
    sm_count: int
    shared_per_block: int
    shared_per_sm: int
    registers_per_sm: int
    max_registers_per_thread: int
    warp_size: int
    max_threads_per_block: int
    max_threads_per_sm: int
    max_blocks_per_sm: int

    @property
    def max_warps(self) -> int:
        """Most warps one program may have (NVIDIA: 32; AMD wavefronts of 64: 16)."""
        return self.max_threads_per_block // self.warp_size

    @property
    def pdl(self) -> bool:
        """Programmatic dependent launch: NVIDIA from Hopper (compute capability 9.0) on."""
        return self.vendor == "nvidia" and self.capability is not None and self.capability >= (9, 0)

    @property
    def eviction_hints(self) -> bool:
        """Loads' L1/L2 eviction priorities (`evict_first`): NVIDIA PTX. Triton's AMD backend compiles them to
        the same loads as without (a knob that changes nothing)."""
        return self.vendor == "nvidia"

    @property
    def inline_ptx(self) -> bool:
        """Inline PTX (the pipelined split's wait and its load after the wait): NVIDIA only."""
        return self.vendor == "nvidia"

    @property
    def direct_launch(self) -> bool:
        """Triton's CUDA launcher, whose C launch function `launcher.raw_launch` calls straight."""
        return self.vendor == "nvidia"

    def features(self) -> dict[str, bool]:
        return {"pdl": self.pdl, "eviction_hints": self.eviction_hints, "inline_ptx": self.inline_ptx,
                "direct_launch": self.direct_launch}

    def to_dict(self) -> dict[str, Any]:
        return dict(dataclasses.asdict(self), max_warps=self.max_warps, **self.features())


def _nvidia(name: str, cc: tuple[int, int], sms: int) -> DeviceLimits:
    """An NVIDIA GPU of compute capability `cc` (the CUDA programming guide's per-capability limits)."""
    shared_block, shared_sm, threads, blocks = _NVIDIA_BY_CAPABILITY.get(cc, _NVIDIA_BY_CAPABILITY[(8, 6)])
    return DeviceLimits(name, "nvidia", f"sm_{cc[0]}{cc[1]}", cc, sms, shared_block, shared_sm, 65536, 255, 32,
                        1024, threads, blocks)


# Compute capability -> (shared memory per block with opt-in, per SM, threads per SM, blocks per SM).
_NVIDIA_BY_CAPABILITY = {
    (8, 0): (163 * 1024, 164 * 1024, 2048, 32),
    (8, 6): (99 * 1024, 100 * 1024, 1536, 16),
    (8, 7): (163 * 1024, 164 * 1024, 2048, 16),
    (8, 9): (99 * 1024, 100 * 1024, 1536, 24),
    (9, 0): (227 * 1024, 228 * 1024, 2048, 32),
    (10, 0): (227 * 1024, 228 * 1024, 2048, 32),
    (10, 3): (227 * 1024, 228 * 1024, 2048, 32),
    (12, 0): (99 * 1024, 100 * 1024, 1536, 32),
}

# AMD CDNA: 4 SIMDs per compute unit, each with 512 32-bit VGPRs per lane of a 64-lane wavefront (architectural
# and accumulation registers together); a thread addresses at most 256 architectural VGPRs.
_CDNA_REGISTERS = 4 * 512 * 64
# gfx arch -> (LDS per block, LDS per compute unit).
_AMD_BY_ARCH = {
    "gfx90a": (64 * 1024, 64 * 1024),
    "gfx942": (64 * 1024, 64 * 1024),
    "gfx950": (160 * 1024, 160 * 1024),
}


def _amd(name: str, arch: str, cus: int) -> DeviceLimits:
    shared_block, shared_cu = _AMD_BY_ARCH.get(arch, (64 * 1024, 64 * 1024))
    return DeviceLimits(name, "amd", arch, None, cus, shared_block, shared_cu, _CDNA_REGISTERS, 256, 64, 1024,
                        2048, 32)


# Stand-ins for tests and the offline compile check (each GPU's own properties win on a real device).
H100 = _nvidia("NVIDIA H100 80GB HBM3", (9, 0), 132)
H200 = _nvidia("NVIDIA H200", (9, 0), 132)
A100 = _nvidia("NVIDIA A100-SXM4-80GB", (8, 0), 108)
B200 = _nvidia("NVIDIA B200", (10, 0), 148)
RTX4090 = _nvidia("NVIDIA GeForce RTX 4090", (8, 9), 128)
RTX5090 = _nvidia("NVIDIA GeForce RTX 5090", (12, 0), 170)
L40S = _nvidia("NVIDIA L40S", (8, 9), 142)
MI300X = _amd("AMD Instinct MI300X", "gfx942", 304)
MI355X = _amd("AMD Instinct MI355X", "gfx950", 256)
STAND_INS = {"h100": H100, "h200": H200, "a100": A100, "b200": B200, "rtx4090": RTX4090, "rtx5090": RTX5090,
             "l40s": L40S, "mi300x": MI300X, "mi355x": MI355X}

# The device the constants of `heuristics.py` describe and the shipped tables were tuned on; the limits wherever
# no device is consulted (the Triton interpreter, a GPU key without a device).
REFERENCE = H100


# ROCm's torch reports an AMD GPU's architecture as a compute capability (major, minor): gfx90a is 9.0, gfx942
# 9.4, gfx950 9.5.
_AMD_ARCH_BY_CAPABILITY = {(9, 0): "gfx90a", (9, 4): "gfx942", (9, 5): "gfx950"}


def recorded(key: str, name: str | None = None, sm_count: int | None = None,
             capability: tuple[int, int] | None = None, vendor: str | None = None) -> tuple[DeviceLimits, str | None]:
    """The limits of a GPU known only from what a stored run recorded of it (no device to read them from):
    (limits, note). Its stand-in (`STAND_INS`, by GPU key) where there is one, else what its compute capability
    (NVIDIA) or architecture (AMD, as ROCm reports it in the capability) gives; each with the recorded name and
    SM count. Where neither says, the reference device's with the vendor's warp size, and `note` says so
    (None when the limits are the GPU's own)."""
    base = STAND_INS.get(key)
    if base is not None:
        return dataclasses.replace(base, name=name or base.name, sm_count=sm_count or base.sm_count), None
    name = name or key
    cc = f"compute capability {capability[0]}.{capability[1]}" if capability else "compute capability (none recorded)"
    if vendor == "amd":
        arch = _AMD_ARCH_BY_CAPABILITY.get(capability) if capability else None
        limits = _amd(name, arch or "gfx", sm_count or REFERENCE.sm_count)
        note = None if arch else (f"{name}: architecture unknown ({cc}): sized as a CDNA GPU "
                                  f"({limits.warp_size}-lane wavefronts, "
                                  f"{limits.shared_per_block // 1024} KiB LDS per block)")
        return limits, note
    if vendor == "nvidia" and capability in _NVIDIA_BY_CAPABILITY:
        return _nvidia(name, capability, sm_count or REFERENCE.sm_count), None
    limits = dataclasses.replace(REFERENCE, name=name, sm_count=sm_count or REFERENCE.sm_count)
    return limits, (f"{name}: no stand-in and no limits known for {cc}: sized as {REFERENCE.name} "
                    f"(its registers, shared memory and {limits.warp_size}-thread warps)")


def from_properties(props: Any, hip: bool = False) -> DeviceLimits:
    """Limits from `torch.cuda.get_device_properties(i)` (CUDA or ROCm builds). A property this torch does not
    report takes the value of the GPU's compute capability (NVIDIA) or architecture (AMD)."""
    name = str(props.name)
    sms = int(props.multi_processor_count)
    if hip:
        arch = str(getattr(props, "gcnArchName", "") or "gfx").split(":")[0]
        base = _amd(name, arch, sms)
        # The register file and per-CU figures are the architecture's (ROCm's per-multiprocessor register count
        # is not the compute unit's whole file of architectural and accumulation registers).
        overrides = {"warp_size": getattr(props, "warp_size", None) or base.warp_size,
                     "shared_per_block": getattr(props, "shared_memory_per_block", None) or base.shared_per_block}
    else:
        base = _nvidia(name, (int(props.major), int(props.minor)), sms)
        overrides = {
            "shared_per_block": getattr(props, "shared_memory_per_block_optin", None),
            "shared_per_sm": getattr(props, "shared_memory_per_multiprocessor", None),
            "registers_per_sm": getattr(props, "regs_per_multiprocessor", None),
            "warp_size": getattr(props, "warp_size", None),
            "max_threads_per_sm": getattr(props, "max_threads_per_multi_processor", None),
        }
    return dataclasses.replace(base, **{k: int(v) for k, v in overrides.items() if v})
