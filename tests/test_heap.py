"""qarl_jax.run.heap: the malloc thresholds the CLI re-executes itself with (glibc only)."""

import os
import subprocess
import sys

import pytest

from qarl_jax.run import heap

glibc = pytest.mark.skipif(not heap.on_glibc(), reason="glibc's tunables only")


@glibc
def test_tunables_are_added_to_what_is_set_and_a_users_malloc_setting_wins():
    assert heap.tuned_environ({"A": "1"}) == {"A": "1", "GLIBC_TUNABLES": heap.TUNABLES}
    other = {"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX512F"}
    assert heap.tuned_environ(other)["GLIBC_TUNABLES"] == f"glibc.cpu.hwcaps=-AVX512F:{heap.TUNABLES}"
    assert heap.tuned_environ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) is None
    assert heap.tuned_environ({"GLIBC_TUNABLES": heap.TUNABLES}) is None


@glibc
def test_the_process_reexecutes_once_with_the_tunables():
    """The real exec: the same command runs again (once) with the thresholds in its environment."""
    code = (
        "import os, sys; from qarl_jax.run.heap import reexec_with_tunables; "
        "print('run', flush=True); reexec_with_tunables(); print(os.environ['GLIBC_TUNABLES'])"
    )
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["run", "run", heap.TUNABLES]
