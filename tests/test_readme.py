"""README.md as a new user reads it: what normtune is first, `patch` within 20 lines, the two commands within 40
(the test command exactly what CI runs), every link to a file that exists, and every term of the results in the
glossary."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
LINES = README.splitlines()


def _commands() -> list[str]:
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", README, re.S)]


def test_patch_comes_within_twenty_lines_and_the_two_commands_within_forty():
    first_patch = next(i for i, line in enumerate(LINES, 1) if "normtune.patch(" in line)
    assert first_patch <= 20, f"the first use of patch is on line {first_patch}"
    head = "\n".join(LINES[:40])
    main, test = _commands()[:2]
    assert main in head and test in head, "both commands must appear within the first 40 lines"
    assert "normtune report --gpu h100" in main and test == "bash tests/run.sh"


def test_ci_runs_exactly_the_readme_test_command():
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith("#") and not line.startswith(("set ", "cd "))]
    assert ci == [_commands()[1]]


def test_readme_says_what_the_test_command_does_and_why_the_report_uses_h100_data():
    text = " ".join(README.split())
    assert "starts a local PostgreSQL server" in text and "stops the server again" in text
    assert "The tuning ran on an H100" in text


def test_every_relative_link_of_readme_and_docs_exists():
    broken = []
    for page in [ROOT / "README.md", ROOT / "DEVELOPERS.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_the_glossary_explains_every_term_the_readme_and_reports_use():
    glossary = (ROOT / "docs" / "glossary.md").read_text()
    defined = {m.lower() for m in re.findall(r"^\*\*([^*]+)\*\*", glossary, re.M)}
    for term in ("cold L2", "regret", "seed cases", "PDL", "programs_per_sm", "dual / columns", "fitted box",
                 "held-out shapes", "analytic default", "kernel_1 / kernel_2"):
        assert term.lower() in defined, f"docs/glossary.md does not define {term!r}"
