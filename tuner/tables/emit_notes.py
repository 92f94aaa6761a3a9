"""What `normtune emit` says about a table it fitted: one line per config dropped for losing to the analytic
default, and per rule whose incumbent stayed over a new winner (for the command's output)."""

from __future__ import annotations

from normtune.kernels.config import BackwardConfig


def dropped_summary(table: dict) -> list[str]:
    """One line per config dropped for losing to the analytic default (for the command's output)."""
    lines = []
    for key, fam in sorted(table["families"].items()):
        for d in fam.get("dropped", []):
            losses = ", ".join(f"{shape} {v['us']} vs {v['default_us']} µs"
                               for shape, v in d["slower_than_default"].items())
            lines.append(f"{key} {'+'.join(d['fitted_on'])}: dropped `{BackwardConfig.from_dict(d['config'])}` "
                         f"(slower than the analytic default beyond the spread on {losses})")
    return lines


def kept_summary(table: dict) -> list[str]:
    """One line per rule whose incumbent config stayed over a new winner that did not beat it beyond the spread."""
    return [f"{key} {'+'.join(r['fitted_on'])}: kept the incumbent `{BackwardConfig.from_dict(r['config'])}` "
            f"(the new winner `{BackwardConfig.from_dict(r['kept_over'])}` is not faster beyond the spread)"
            for key, fam in sorted(table["families"].items()) for r in fam["rules"] if "kept_over" in r]
