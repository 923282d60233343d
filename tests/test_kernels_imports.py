"""kernels_pallas stands alone: importing it (and running it on the CPU) loads nothing that JAX does
not load itself, and no backend's Pallas front end before that backend is asked for."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO

PROBE = """
import json, sys
import jax
before = {m.split(".")[0] for m in sys.modules}
import jax.numpy as jnp
import kernels_pallas as kp
from kernels_pallas import attention, rowwise
x = jnp.ones((2, 64), jnp.float32)
kp.quantized_matmul(x, kp.quantize(jnp.ones((64, 8)), "w8a8"), backend="cpu").block_until_ready()
rowwise.token_logprobs(x, jnp.zeros(2, jnp.int32), 0.7, backend="cpu").block_until_ready()
after = {m.split(".")[0] for m in sys.modules}
pallas = sorted(m for m in sys.modules if "pallas" in m and not m.startswith("kernels_pallas"))
ours = sorted(m for m in sys.modules if m.startswith("kernels_pallas"))
new = sorted(after - before - set(sys.stdlib_module_names))
print(json.dumps({"new": new, "pallas": pallas, "ours": ours}))
"""


def test_kernels_import_with_jax_alone_and_load_backends_lazily():
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["new"] == ["kernels_pallas"], got["new"]  # no flax, optax, qarl_jax, ...
    assert got["pallas"] == [], got["pallas"]  # Triton / Mosaic front ends untouched on CPU
    assert not [m for m in got["ours"] if m.endswith((".gpu", ".tpu", "_triton", "_mosaic"))], got["ours"]
