"""`normtune where`: which heuristic table and which backward config one problem gets on a GPU, and why (read-only;
a GPU key needs no device)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Optional

import typer

from .common import (CLIError, Device, Residual, ResidualDtype, WeightDtype, device_info, parse_dtype, refuse,
                     run_checked, with_residual)


def _problem(shape: str | None, norm: str, dtype: str, weight_dtype: str | None, bias: bool | None,
             zero_centered: bool, save: str):
    if shape is None:  # before any import of torch: a missing option is said at once
        raise CLIError("--shape: give the problem's rows x width, e.g. --shape 4096x8192")
    from normtune.kernels.config import NORMS, SAVE_MODES, ConfigError, Problem
    from normtune.tuner.shapes import parse_shape

    try:
        M, N = parse_shape(shape)
    except ValueError as err:
        raise CLIError(f"--shape: {err}") from None
    if norm not in NORMS:
        raise CLIError(f"--norm {norm!r}: use one of {', '.join(NORMS)}")
    if save not in SAVE_MODES:
        raise CLIError(f"--save {save!r}: use one of {', '.join(SAVE_MODES)}")
    if bias and norm == "rms_norm":
        raise CLIError("--bias: rms_norm has no bias; drop --bias or pass --norm layer_norm")
    dt = parse_dtype(dtype)
    wdt = parse_dtype(weight_dtype, "--weight-dtype") if weight_dtype else None
    try:
        return Problem(norm, M, N, dt, wdt, True, (norm == "layer_norm") if bias is None else bias, zero_centered,
                       save)
    except ConfigError as err:
        raise CLIError(f"--weight-dtype {weight_dtype}: {err}") from None


def _device(gpu: str, device: int):
    """(the device name the chain is walked for, its compute capability, how to say it, its limits: the device's,
    a known GPU key's stand-in, or None for the reference device's)."""
    from normtune.kernels.limits import STAND_INS

    name = gpu.strip()
    if name.lower() == "auto":
        from normtune.tuner.gpu_info import NoGPUError

        try:
            info = device_info("auto", False, device)
        except NoGPUError:
            raise CLIError("--gpu auto: no CUDA GPU is visible here; name the GPU whose tables to consult, e.g. "
                           "--gpu h100") from None
        import torch

        from normtune.kernels.device import device_limits

        cc = tuple(int(x) for x in info.compute_capability.split(".")) if info.compute_capability else None
        return (info.name, cc, f"{info.name} (device {device}, compute capability {info.compute_capability})",
                device_limits(torch.device("cuda", device)))
    if name.lower() == "cpu":
        return None, None, "no GPU (CPU tensors and the Triton interpreter)", None
    if name.lower() == "interpret" or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9 ._()-]*", name):
        raise CLIError(f"--gpu {gpu!r}: name a GPU key such as h100, a device name such as 'NVIDIA H100 PCIe', "
                       "auto (this machine's GPU) or cpu")
    from normtune.kernels.device import gpu_key

    return name, None, f"{name} (no device consulted: the tables of its GPU family)", STAND_INS.get(gpu_key(name))


def where(
    shape: Annotated[Optional[str], typer.Option("--shape", help="The problem's rows x width, e.g. 4096x8192 "
                                                                 "(rows: the product of the leading dims)")] = None,
    gpu: Annotated[str, typer.Option("--gpu", help="A GPU key (h100, h200, …) or a device name as CUDA reports it: "
                                                   "the tables consulted, no device needed; auto: this machine's "
                                                   "GPU; cpu: no GPU")] = "auto",
    norm: Annotated[str, typer.Option("--norm", help="layer_norm or rms_norm")] = "rms_norm",
    dtype: Annotated[str, typer.Option("--dtype", help="Activation dtype: bf16, fp16 or fp32")] = "bf16",
    weight_dtype: WeightDtype = None,
    bias: Annotated[Optional[bool], typer.Option("--bias/--no-bias", help="LayerNorm bias [default: bias]")] = None,
    zero_centered: Annotated[bool, typer.Option("--zero-centered", help="Zero-centered weights (w = 1 + w')")]
    = False,
    save: Annotated[str, typer.Option(help="What the forward saves: input | output")] = "input",
    residual: Residual = False,
    residual_dtype: ResidualDtype = None,
    config_file: Annotated[Optional[Path], typer.Option(
        "--config-file", help="Consult this table file first, as $NORMTUNE_CONFIG would name it")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the explanation as JSON")] = False,
    device: Device = 0,
):
    """Which table and which backward config a problem gets, and why: the lookup chain walked ($NORMTUNE_CONFIG,
    the user table, the shipped table of the GPU family, the analytic defaults), the rule that answered (or why
    none did) and the config, as JSON. Reads files only."""
    problem = run_checked(_problem, shape, norm, dtype, weight_dtype, bias, zero_centered, save)
    problem = run_checked(with_residual, [problem], residual, residual_dtype)[0]
    from normtune.kernels.select.select import explain  # imports torch: after the options are checked

    if config_file is not None and not config_file.is_file():
        run_checked(refuse, f"--config-file {config_file}: no such file; give a table emitted by `normtune emit`")
    device_name, capability, said, limits = run_checked(_device, gpu, device)
    why = run_checked(explain, problem, device_name, capability,
                      config_file=str(config_file) if config_file is not None else None, limits=limits)
    limits_said = _limits_line(limits)
    if as_json:
        typer.echo(json.dumps({"gpu": said, "limits": limits_said, **why.to_dict()}, indent=1, ensure_ascii=False))
        return
    lines = [f"problem  {problem.key}", f"gpu      {said}", f"limits   {limits_said}", "chain"]
    for i, step in enumerate(why.steps, 1):
        lines.append(f"  {i}. {step.detail}" + ("   <- used" if step.taken else ""))
    lines += [f"table    {why.table.label if why.table else 'none'}", f"rule     {why.reason}",
              f"config   {why.config.to_json()}"]
    lines += [f"fallback {line}" for line in why.fallbacks]
    typer.echo("\n".join(lines))


def _limits_line(limits) -> str:
    """What sizes the default and which features run: the device's limits in one line."""
    from normtune.kernels.limits import REFERENCE

    lim = limits or REFERENCE
    features = ", ".join(f"{name} {'yes' if on else 'no'}" for name, on in lim.features().items())
    source = "" if limits else " (the reference device's: no device or stand-in for this GPU)"
    return (f"{lim.name}: {lim.arch}, {lim.sm_count} {'CUs' if lim.vendor == 'amd' else 'SMs'}, {lim.shared_per_block // 1024} KB shared per program, "
            f"{lim.warp_size}-thread warps; {features}{source}")
