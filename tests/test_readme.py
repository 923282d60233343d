"""The README and the docs it links stay true: every command they show still parses (``--help``
runs, in plain text), the cheap ones run as printed, the 8-device ones say how to get 8 devices, the
experiment commands train instead of reprinting committed results, every command-line module is
named, every config they name exists and loads, every relative link leads somewhere."""

from __future__ import annotations

import functools
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import tempfile

import pytest
import yaml
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
# every module a user runs with python -m: those with a __main__ block (a package: its __main__.py)
CLIS = sorted(
    ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__main__")
    for path in (REPO / "qarl_jax").rglob("*.py")
    if re.search(r'^if __name__ == "__main__":', path.read_text(), re.M)
)
FAKE_DEVICES = "XLA_FLAGS=--xla_force_host_platform_device_count="
MARKUP = ("``", ":mod:", ":func:", ":class:", ":data:", ":meth:", ":attr:")


def _commands(page_text: str) -> list[str]:
    """The commands a page shows: each line of a fenced shell block, and each inline code span
    (joined across line breaks) that runs ``python`` (after ``VAR=value`` settings, if any)."""
    fenced = re.findall(r"```(?:bash|sh|shell)\n(.*?)```", page_text, re.S)
    lines = [line for block in fenced for line in block.splitlines()]
    spans = re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", page_text, flags=re.S))
    found = (" ".join(c.split()) for c in (*lines, *spans))
    return [c for c in found if re.match(r"(\w+=\S+ )*python3? ", c)]


COMMANDS = sorted({c for p in PAGES for c in _commands(p.read_text())})


def _expand(pattern: str) -> list[str]:
    """``configs/qwen3_8b_{v5p64,8gpu}.yaml`` -> both names."""
    m = re.search(r"\{([^}]*)\}", pattern)
    if not m:
        return [pattern]
    return [
        x for alt in m.group(1).split(",") for x in _expand(pattern[: m.start()] + alt + pattern[m.end() :])
    ]


def _environ(**extra: str) -> dict[str, str]:
    """The environment of a fresh shell: none of conftest's 8 fake devices (a command that needs
    them must say so itself), the repository importable, ``extra`` on top."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")).strip()
    env.pop("XLA_FLAGS", None)
    if flags:
        env["XLA_FLAGS"] = flags
    return env | extra


def _start(command: str, cwd) -> subprocess.Popen:
    """``command`` as a shell would run it (leading ``VAR=value`` words set the environment),
    with this interpreter as ``python``."""
    words = shlex.split(command)
    settings = {}
    while "=" in words[0] and not words[0].startswith("-"):
        key, value = words.pop(0).split("=", 1)
        settings[key] = value
    assert words[0] in ("python", "python3"), command
    return subprocess.Popen(
        [sys.executable, *words[1:]],
        cwd=cwd,
        env=_environ(**settings),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_the_pages_show_commands_configs_and_links():
    assert "qarl_jax.main" in MODULES and "qarl_jax.serve" in MODULES and len(MODULES) >= 5, MODULES
    assert SCRIPTS and CONFIGS and LINKS and len(COMMANDS) >= 20, COMMANDS


def test_every_command_line_module_is_named():
    """The tools all named: every ``qarl_jax`` module with a ``__main__`` block appears in a page."""
    assert len(CLIS) >= 10, CLIS
    missing = sorted(set(CLIS) - set(MODULES))
    assert not missing, f"command-line modules the README and docs never name: {missing}"


# runs every ``--help`` in one interpreter (JAX imported once, not ~35 times), the modules first,
# then the scripts: argv[1] the [command, "module" or "script", target] list, argv[2] where the
# results go as JSON
_HELP_DRIVER = """
import contextlib, io, json, runpy, sys, traceback
todo, results_path, results = json.loads(sys.argv[1]), sys.argv[2], {}
for command, kind, target in todo:
    out, err, code = io.StringIO(), io.StringIO(), 0
    sys.argv = [target, "--help"]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            if kind == "module":
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:  # as python SCRIPT does: the script's folder first on sys.path
                sys.path.insert(0, target.rsplit("/", 1)[0])
                try:
                    runpy.run_path(target, run_name="__main__")
                finally:
                    sys.path.pop(0)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        except BaseException:
            traceback.print_exc()
            code = 1
    results[command] = [code, out.getvalue(), err.getvalue()]
with open(results_path, "w") as f:
    json.dump(results, f)
"""


@functools.cache
def _helps() -> dict[str, tuple[int, str, str]]:
    """``--help`` of every module and script the pages run and of every command-line module, in one
    fresh interpreter (each would spend its seconds importing JAX; ~35 processes at once cost
    minutes of CPU on two cores): command -> (exit code, stdout, stderr)."""
    targets = [(f"python -m {m} --help", "module", m) for m in sorted(set(MODULES) | set(CLIS))]
    targets += [(f"python {s} --help", "script", str(REPO / s)) for s in SCRIPTS]
    with tempfile.TemporaryDirectory() as tmp:
        results = pathlib.Path(tmp, "helps.json")
        args = [sys.executable, "-c", _HELP_DRIVER, json.dumps(targets), str(results)]
        done = subprocess.run(args, cwd=REPO, env=_environ(), capture_output=True, text=True, timeout=600)
        assert done.returncode == 0 and results.exists(), done.stderr[-3000:]
        return {c: (code, out, err) for c, (code, out, err) in json.loads(results.read_text()).items()}


def test_every_command_parses():
    """None may fail or print a traceback."""
    for command, (code, out, err) in _helps().items():
        assert code == 0 and "usage" in out.lower(), f"{command}: {err[-2000:]}"


def test_help_is_plain_text():
    """``--help`` of every qarl_jax command and benchmark script reads as plain text: no
    reStructuredText markup (a
    docstring shown raw), and its description does not stop mid-sentence (on a colon)."""
    bad = {}
    for command, (_, out, _) in _helps().items():
        if " -m qarl_jax" not in command and " benchmarks/" not in command:
            continue
        if found := [m for m in MARKUP if m in out]:
            bad[command] = f"shows {found}"
        description = out.split("\n\n")[1] if out.count("\n\n") else ""
        if description.rstrip().endswith(":"):
            bad[command] = f"stops mid-sentence: ...{description.rstrip()[-60:]!r}"
    assert not bad, bad


def _devices_needed(command: str) -> int:
    """The devices a command's mesh overrides name (the training mesh's product, ``data`` at least
    1, or the rollout layout's, whichever is larger)."""
    needed = 1
    for prefix in ("mesh", "rollout.mesh"):
        sizes = dict(re.findall(rf"(?<![\w.]){re.escape(prefix)}\.(data|fsdp|tensor|expert)=(\d+)", command))
        product = 1
        for size in sizes.values():
            product *= int(size)
        needed = max(needed, product)
    return needed


def test_commands_on_several_devices_show_how_to_get_them():
    """A command whose mesh needs N > 1 devices starts with the fake-devices flag for at least N
    (``memory_plan`` plans for devices it does not use, and starts itself again with fake ones)."""
    several = [c for c in COMMANDS if _devices_needed(c) > 1 and "tools.memory_plan" not in c]
    assert len(several) >= 3, several
    for command in several:
        m = re.match(rf"{FAKE_DEVICES}(\d+) ", command)
        assert m and int(m.group(1)) >= _devices_needed(command), (
            f"needs {_devices_needed(command)} devices, and does not say how to get them: {command}"
        )
    assert FAKE_DEVICES in (REPO / "docs" / "usage.md").read_text()


def _option(words: list[str], name: str, default: str) -> str:
    return words[words.index(name) + 1] if name in words else default


def test_the_experiment_commands_train():
    """``replicate`` and ``regime`` reuse whatever their ``--out`` holds, and the default ``--out``
    (results/<config name>) holds the committed runs: a command shown must name an ``--out`` with
    nothing committed in it, or it reprints the committed tables and trains nothing. One that
    reruns a committed study as it was (no overrides) runs its arms and seeds."""
    from qarl_jax.experiments.replicate import ARMS

    shown = [c for c in COMMANDS if re.search(r"-m qarl_jax\.experiments\.(replicate|regime)( |$)", c)]
    assert len(shown) >= 4, shown
    for command in shown:
        words = shlex.split(command)
        if {"--help", "--quick", "--summarize"} & set(words):
            continue
        default = "configs/replication.yaml" if "replicate" in command else "configs/replication_long.yaml"
        study = REPO / "results" / os.path.basename(_option(words, "--config", default)).removesuffix(".yaml")
        out = REPO / _option(words, "--out", str(study.relative_to(REPO)))  # an absolute --out stays so
        if REPO in out.parents:
            finished = [*out.glob("runs/*/seed*/run_summary.json"), *out.glob("sweep/*/metrics.jsonl")]
            assert not finished, f"{command}: its --out {out} holds committed results: it trains nothing"
        if "replicate" not in command or any("=" in w for w in words if not w.startswith("-")):
            continue
        committed = json.loads((study / "summary.json").read_text())["arms"]
        arms = _option(words, "--arms", ",".join(ARMS)).split(",")
        seeds = [int(s) for s in _option(words, "--seeds", "0,1,2").split(",")]
        assert sorted(arms) == sorted(committed), f"{command}: the study ran the arms {sorted(committed)}"
        for arm, record in committed.items():
            assert seeds == record["seeds"], f"{command}: the study ran {arm} on seeds {record['seeds']}"


# commands the pages show that finish in seconds, run as printed in a fresh directory (configs/ and
# results/ linked in): command -> (exit code, a check of (stdout, stderr, the directory))
CHEAP = {
    "python -m qarl_jax.main --print-config": (
        0,
        lambda out, err, cwd: yaml.safe_load(out)["rollout"]["samples_per_prompt"] == 8,
    ),
    "python -m qarl_jax.tools.memory_plan --config configs/qwen3_8b_8gpu.yaml --platform h200": (
        0,
        lambda out, err, cwd: "mesh: data=1 fsdp=8" in out and ": fits" in out,
    ),
    "python -m qarl_jax.tools.verify_checkpoint runs/default": (
        3,  # the documented code of a checkpoint error; one line, the one the docs quote
        lambda out, err, cwd: err.strip() == "checkpoint error: runs/default: no such directory" and not out,
    ),
    "python -m qarl_jax.tools.plot_runs results/default_run/seed0 results/default_run/seed1 "
    "results/default_run/seed2 --out reward.png": (
        0,
        lambda out, err, cwd: (cwd / "reward.png").stat().st_size > 10_000,
    ),
}


def test_the_quick_commands_run_as_printed(tmp_path):
    """Each command above, exactly as a page prints it, all started at once."""
    missing = [c for c in CHEAP if c not in COMMANDS]
    assert not missing, f"no page shows {missing} any more: update CHEAP"
    for name in ("configs", "results"):
        (tmp_path / name).symlink_to(REPO / name)
    procs = [(c, _start(c, tmp_path)) for c in CHEAP]
    for command, proc in procs:
        out, err = proc.communicate(timeout=300)
        code, check = CHEAP[command]
        assert proc.returncode == code and check(out, err, tmp_path), (
            f"{command}: exit {proc.returncode}\nstdout: {out[-1500:]}\nstderr: {err[-1500:]}"
        )


@pytest.mark.parametrize("pattern", CONFIGS)
def test_every_config_named_loads(pattern):
    for name in _expand(pattern):
        assert (REPO / name).is_file(), f"the docs name {name}, which does not exist"
        load_config(REPO / name, cls=SftConfig if name.startswith("configs/sft_") else Config)


def test_every_relative_link_exists():
    missing = [f"{page.name}: {target}" for page, target in LINKS if not (page.parent / target).exists()]
    assert not missing, f"links to missing files: {missing}"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_anchor_exists():
    """``page.md#section`` links land on a heading of that page."""
    missing = []
    for page in PAGES:
        for target, anchor in re.findall(r"\]\(((?!https?://)[^)#\s]*)#([^)\s]+)\)", page.read_text()):
            linked = (page.parent / target) if target else page
            headings = re.findall(
                r"^#+ (.+)$", re.sub(r"```.*?```", "", linked.read_text(), flags=re.S), re.M
            )
            if anchor not in {_anchor(h) for h in headings}:
                missing.append(f"{page.name}: {target}#{anchor}")
    assert not missing, f"links to missing sections: {missing}"
