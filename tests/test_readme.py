"""The README and the docs it links stay true: every command they show still parses (``--help``
runs), every config they name exists and loads, every relative link leads somewhere."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import REPO

from qarl_jax.config import Config, load_config
from qarl_jax.sft import SftConfig

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TEXT = "\n".join(p.read_text() for p in PAGES)
MODULES = sorted(set(re.findall(r"python3? -m (qarl_jax[\w.]*)", TEXT)))
SCRIPTS = sorted(set(re.findall(r"python3? (benchmarks/\w+\.py)", TEXT)))
CONFIGS = sorted(set(re.findall(r"configs/[\w.{},]+\.yaml", TEXT)))
# (the page, a relative link target on it)
LINKS = sorted({(p, t) for p in PAGES for t in re.findall(r"\]\(((?!https?://)[^)#\s]+)", p.read_text())})


def _expand(pattern: str) -> list[str]:
    """``configs/qwen3_8b_{v5p64,8gpu}.yaml`` -> both names."""
    m = re.search(r"\{([^}]*)\}", pattern)
    if not m:
        return [pattern]
    return [
        x for alt in m.group(1).split(",") for x in _expand(pattern[: m.start()] + alt + pattern[m.end() :])
    ]


def test_the_pages_show_commands_configs_and_links():
    assert "qarl_jax.main" in MODULES and "qarl_jax.serve" in MODULES and len(MODULES) >= 5, MODULES
    assert SCRIPTS and CONFIGS and LINKS


def test_every_command_parses():
    """``--help`` of every module and script the README runs, all started at once (each spends its
    seconds importing JAX), none may fail or print a traceback."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    commands = [[sys.executable, "-m", m, "--help"] for m in MODULES] + [
        [sys.executable, s, "--help"] for s in SCRIPTS
    ]
    procs = [
        (c, subprocess.Popen(c, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        for c in commands
    ]
    for command, proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0 and "usage" in out.lower(), f"{' '.join(command[1:])}: {err[-2000:]}"


@pytest.mark.parametrize("pattern", CONFIGS)
def test_every_config_named_loads(pattern):
    for name in _expand(pattern):
        assert (REPO / name).is_file(), f"the docs name {name}, which does not exist"
        load_config(REPO / name, cls=SftConfig if name.startswith("configs/sft_") else Config)


def test_every_relative_link_exists():
    missing = [f"{page.name}: {target}" for page, target in LINKS if not (page.parent / target).exists()]
    assert not missing, f"links to missing files: {missing}"
