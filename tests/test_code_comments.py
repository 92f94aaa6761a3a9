"""Comments describe the code: no comment or docstring of `kernels/`, `tuner/`, `commands/` or `cli.py` carries a measurement (a time, a bandwidth, a
percentage, a speedup), a GPU's name or a run id. Such facts belong in docs/ (perf-notes, history, glossary), where
they can be dated and sourced; a comment says what the code does and why, in terms of the code."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "tuner", "commands")
MODULES = ("cli.py",)

FIGURE = re.compile(
    r"\d\s*(?:µs|us|ms|ns)\b"                  # a time
    r"|\d\s*[GMT]B/s\b"                        # a bandwidth
    r"|\d\s*%"                                 # a percentage
    r"|\d(?:\.\d+)?x(?![\w.])|\d(?:\.\d+)?\s*×(?!\s*\d)"  # a speedup (1.24x; not a shape: 4x8192, 4 x 2048)
    r"|\b(?:H100|H200|H800|A100|A10G?|B100|B200|GB200|GH200|L4|L40S?|V100|T4|MI\d{3}X?|RTX ?\d{4})\b"  # a GPU
    r"|\bruns? (?:id )?#?\d+")                 # a run id


def _texts(path: Path):
    """(line, text) of every comment and docstring of a module."""
    source = path.read_text()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield node.body[0].lineno, doc


def _quoted_removed(text: str) -> str:
    """The text without what it quotes ('NVIDIA ...' as an example of a device name the code parses)."""
    return re.sub(r"'[^'\n]*'|\"[^\"\n]*\"", "''", text)


def test_no_comment_or_docstring_carries_a_measurement_a_gpu_or_a_run():
    found = []
    paths = [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))] + [ROOT / m for m in MODULES]
    for path in paths:
        for line, text in _texts(path):
            for m in FIGURE.finditer(_quoted_removed(text)):
                found.append(f"{path.relative_to(ROOT)}:{line}: {m.group(0)!r}")
    assert not found, "move these to docs/perf-notes.md (or history/glossary):\n" + "\n".join(found)


def test_the_scan_finds_what_it_looks_for():
    """The pattern catches each kind and leaves shapes, quoted names and plain numbers alone."""
    hits = ["ran at 137.4 µs", "3 ms", "2.4 TB/s", "within 1 %", "1.24x faster", "4-10× slower", "on an H200",
            "H100 RMSNorm", "run 271", "runs 12, 13"]
    misses = ["a 4x8192 tile", "2048x32768 rows", "4 x 2048", "M × 4096", "'NVIDIA H100 80GB HBM3' → ''", "8 warps", "block_col = 64"]
    assert all(FIGURE.search(_quoted_removed(t)) for t in hits), [t for t in hits if not FIGURE.search(t)]
    assert not any(FIGURE.search(_quoted_removed(t)) for t in misses), [t for t in misses if FIGURE.search(
        _quoted_removed(t))]
