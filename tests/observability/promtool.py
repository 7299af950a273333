"""PromQL checks with Debian's promtool: old releases have no PromQL-only checker, so each
expression becomes a recording rule and `promtool check rules` parses it."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

# a series selector's name before its label matchers, and any Ray-exported name (bare ones too)
SELECTOR_NAME = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{")
RAY_NAME = re.compile(r"\bray_[a-zA-Z0-9_:]*")


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not found: `apt-get install -y prometheus` (Debian) provides it")
    return path


def check_expressions(expressions: list[str], work_dir: Path) -> subprocess.CompletedProcess:
    rules = [{"record": f"faser:check_{i}", "expr": e} for i, e in enumerate(expressions)]
    path = work_dir / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "check", "rules": rules}]}))
    return subprocess.run(
        [promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )


def metric_names(expr: str) -> set[str]:
    return set(SELECTOR_NAME.findall(expr)) | set(RAY_NAME.findall(expr))
