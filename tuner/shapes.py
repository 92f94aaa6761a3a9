"""Shape presets and the `--shapes` parser: `seed`, `llm`, `few`, `span`, a file, or an explicit `4096x8192,...`
list."""

from __future__ import annotations

import os

from normtune.kernels.config import MAX_M, MAX_N

from .tables.heldout import HELDOUT_SHAPES

# The 15 seed shapes (docs/seed-shapes.md): three problem sizes (M·N = 2^25, 2^24, 2^23 elements) x five hidden sizes.
SEED = (
    (32768, 1024), (16384, 2048), (8192, 4096), (4096, 8192), (2048, 16384),
    (16384, 1024), (8192, 2048), (4096, 4096), (2048, 8192), (1024, 16384),
    (8192, 1024), (4096, 2048), (2048, 4096), (1024, 8192), (512, 16384),
)

# Real model hidden sizes (Qwen2.5-1.5B 1536, Phi-2 2560, Qwen2-7B 3584, Llama-2-13B 5120, Llama-3-70B 8192,
# DeepSeek-V3 7168, Llama-3-405B 16384, …) at realistic token counts per micro-batch (one 4096-token sequence,
# and 4 of them).
LLM_HIDDEN = (1536, 2048, 2560, 3072, 3584, 4096, 5120, 6144, 7168, 8192, 12288, 16384)
LLM_TOKENS = (4096, 16384)
# Decode-like and small-batch problems (M of the order of the SM count or less: the grid cannot fill the GPU)
# and very wide rows (32768, 65536), at shapes the held-out set does not use.
LLM_FEW_ROWS = ((64, 4096), (256, 4096), (512, 4096), (128, 8192), (256, 8192), (512, 8192), (64, 16384),
                (256, 16384), (512, 16384))
LLM_WIDE = ((256, 32768), (1024, 32768), (4096, 32768), (256, 65536), (512, 65536), (1024, 65536))
LLM = tuple((m, n) for n in LLM_HIDDEN for m in LLM_TOKENS) + LLM_FEW_ROWS + LLM_WIDE
# The `few` set: FEW_ROWS rows at every model width of LLM_HIDDEN that `llm` has only tall. A table's rules are
# bucketed by width, so a width fitted only on thousands of rows gives its few-row calls the tall rows' config
# (few-row calls there want another strategy); `tune` fits these by default.
FEW_ROWS = 256
FEW = tuple((FEW_ROWS, n) for n in LLM_HIDDEN if (FEW_ROWS, n) not in LLM)

# Shapes never used to fit a table (odd M, N not powers of two, very few rows, very wide, very tall and narrow):
# one list, `heldout.HELDOUT_SHAPES`; `normtune emit` leaves them out whichever run measured them.
HELDOUT = HELDOUT_SHAPES

# The `span` set: the narrow (128 to 1024 columns) and few-row (64 to 512 rows) regions the seed and llm sets leave
# out, and very many rows, so that a table fitted on all three covers the shapes users run. A lattice over
# SPAN_WIDTHS log-spaced widths (multiples of 64 from 1024 columns, of 8 below) by SPAN_ROWS log-spaced row counts,
# every SPAN_EVERY-th point on each diagonal, within SPAN_MAX_ELEMENTS; never a shape of the held-out set. The
# widths fall one in every power-of-two range of columns (129-256, 257-512, …): a table's rules serve widths up to
# the power of two their own rounds up to, and a range with no fitted width of its own is served by a neighbour's
# rules, whose tiles pad another row length. A lattice point on a held-out shape moves one row step outward (fewer
# rows in the lower half of the row range, more in the upper), so the corners stay covered: a table's box ends at
# its fitted shapes, and a shape beyond them gets the analytic default.
SPAN_WIDTHS, SPAN_ROWS = (128, 65536, 11), (64, 524288, 13)  # (first, last, count)
SPAN_EVERY = 4
SPAN_MAX_ELEMENTS = 2 ** 28


def _log_spaced(first: int, last: int, count: int) -> list[float]:
    return [first * (last / first) ** (i / (count - 1)) for i in range(count)]


def snap_width(n: float) -> int:
    """A width as model widths are: a multiple of 64 from 1024 columns, of 8 below."""
    step = 64 if n >= 1024 else 8
    return int(min(MAX_N, max(step, round(n / step) * step)))


def span_shapes() -> tuple[tuple[int, int], ...]:
    """The `span` set, by width then rows (deterministic)."""
    widths = [snap_width(n) for n in _log_spaced(*SPAN_WIDTHS)]
    rows = [round(m) for m in _log_spaced(*SPAN_ROWS)]
    step = (SPAN_ROWS[1] / SPAN_ROWS[0]) ** (1 / (SPAN_ROWS[2] - 1))
    held = set(HELDOUT)
    out = []
    for i, N in enumerate(widths):
        for j, M in enumerate(rows):
            if (i + j) % SPAN_EVERY:
                continue
            if (M, N) in held:
                M = max(1, round(M / step if 2 * j < len(rows) - 1 else M * step))
            if M * N <= SPAN_MAX_ELEMENTS and M <= MAX_M and (M, N) not in held:
                out.append((M, N))
    return tuple(out)


SPAN = span_shapes()

# Tiny shapes for the interpreter (CPU): same code path, seconds instead of minutes.
TINY = ((64, 256), (37, 200), (96, 512), (8, 1000))

PRESETS = {"seed": SEED, "llm": LLM, "few": FEW, "span": SPAN, "heldout": HELDOUT, "tiny": TINY}
# What `normtune tune` fits on unless --shapes says otherwise.
TUNE_DEFAULT = ("seed", "llm", "few", "span")


def parse_shape(text: str) -> tuple[int, int]:
    """'4096x8192' → (4096, 8192)."""
    parts = text.strip().lower().replace("×", "x").split("x")
    if len(parts) != 2:
        raise ValueError(f"bad shape {text!r}: write MxN, e.g. 4096x8192")
    try:
        M, N = int(parts[0]), int(parts[1])
    except ValueError:
        raise ValueError(f"bad shape {text!r}: M and N must be integers, e.g. 4096x8192") from None
    if M < 1 or N < 1:  # a shape without rows times, fits and validates nothing
        raise ValueError(f"bad shape {text!r}: need M >= 1 and N >= 1 rows and columns")
    if N > MAX_N:
        raise ValueError(f"bad shape {text!r}: N exceeds the supported maximum {MAX_N}")
    if M > MAX_M:
        raise ValueError(f"bad shape {text!r}: M exceeds the supported maximum {MAX_M}")
    return M, N


def parse_shapes(spec: str) -> list[tuple[int, int]]:
    """A preset name (seed, llm, span, heldout, tiny), a file with one MxN per line (# comments), or 'MxN,MxN'."""
    spec = spec.strip()
    if spec in PRESETS:
        return list(PRESETS[spec])
    if os.path.isfile(spec):
        shapes = []
        with open(spec) as fh:
            for lineno, line in enumerate(fh, 1):
                line = line.split("#", 1)[0].strip()
                if not line:
                    continue
                for item in line.replace(",", " ").split():
                    try:
                        shapes.append(parse_shape(item))
                    except ValueError as err:
                        raise ValueError(f"{spec}:{lineno}: {err}") from None
        if not shapes:
            raise ValueError(f"shape file {spec} lists no shapes (one MxN per line)")
        return shapes
    if not spec:
        raise ValueError(f"no shapes given: use a preset ({', '.join(PRESETS)}), a file, or MxN,MxN")
    if "x" not in spec.lower():
        raise ValueError(f"{spec!r} is neither a preset ({', '.join(PRESETS)}), an existing file, "
                         "nor a list like 4096x8192,2048x4096")
    return [parse_shape(s) for s in spec.split(",") if s.strip()]
