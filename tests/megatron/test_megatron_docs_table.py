"""docs/megatron.md's table of Megatron features under a heterogeneous plan names a test on every row: each exists."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEADING = "## Megatron features and options with a heterogeneous plan"


def rows() -> list[str]:
    text = (ROOT / "docs" / "megatron.md").read_text()
    section = text[text.index(HEADING):]
    section = section[:section.index("\n## ", 1)]
    return [ln for ln in section.splitlines() if ln.startswith("| ") and not ln.startswith("| Feature")]


def test_every_row_names_a_test_that_exists():
    found = rows()
    assert len(found) >= 15
    for row in found:
        names = re.findall(r"`([\w/]+\.py)(?:::(\w+))?`", row.rsplit("|", 2)[-2])
        assert names, row
        for path, function in names:
            file = ROOT / path if "/" in path else ROOT / "tests" / "megatron" / path
            assert file.exists(), row
            if function:
                tree = ast.parse(file.read_text())
                assert function in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}, row
