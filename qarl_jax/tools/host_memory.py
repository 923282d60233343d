"""Host RAM of a run, per host, beside the per-device HBM plan of :mod:`qarl_jax.tools.memory_plan`.

Why: a pod host's RAM is shared by its devices' loading, checkpointing and the Python side of the
run; a plan of HBM alone let the largest config pass while every host would have built whole f32
leaves of a 235B model (~940 GB) against a v5p host's 448 GB.

  loading   the loader's bound (:mod:`qarl_jax.models.hf_io`): this host's shards of the largest
            leaf (devices a host x one device's shard, in model.param_dtype) + one read run
            (64 MiB); the shards already placed live in HBM, not here
  staging   a checkpoint save: this host's shards of the master weights and optimizer state,
            copied to host memory before they are written
  runtime   an allowance for the process (Python, the JAX runtime, the data pipeline, the grader
            pool): an estimate, not a measurement

The host's peak is runtime + the larger of loading and staging. Host RAM by platform: the Google
Cloud machine types of a pod slice's hosts (TPU VM of 4 chips) and of an 8-GPU host.
"""

from __future__ import annotations

from typing import Any

from qarl_jax.models.safetensors_io import CHUNK_BYTES

GB = 1e9
# a host's RAM in GB: v4 (ct4p-hightpu-4t) 407, v5e (ct5lp-hightpu-4t) 192, v5p (ct5p-hightpu-4t)
# 448, v6e (ct6e-standard-4t) 720; A100 80 GB (a2-ultragpu-8g) 1360, H100 (a3-highgpu-8g) 1872,
# H200 (a3-ultragpu-8g) 2952. Checked 2026-12-06: a3-highgpu-8g 208 vCPUs, 1,872 GB
# (cloud.google.com/compute/docs/accelerator-optimized-machines, "The A3 machine series");
# ct5lp-hightpu-4t 112 vCPUs, 192 GB (GKE's v5e machine types, cloud.google.com/kubernetes-engine/
# docs/concepts/tpus#v5e, as listed in Cyclenerd/google-cloud-pricing-cost-calculator#89); a v5e
# host is 8 chips with 512 GiB and a v6e host 8 chips with 1536 GiB (cloud.google.com/tpu/docs/v5e,
# /v6e), each split into two 4-chip VMs in a multi-host slice, so 192 and 720 GB a VM are below
# half a host (275 / 825 GB). Not re-found in a source this time: 720 (ct6e-standard-4t), 2952.
HOST_RAM_GB = {"v4": 407, "v5e": 192, "v5p": 448, "v6e": 720, "a100": 1360, "h100": 1872, "h200": 2952}
RUNTIME_GB = 8.0


def host_plan(
    largest_leaf_shard: int, per_host: int, params: int, optimizer: int, host_ram_gb: float | None
) -> dict[str, Any]:
    """Per-host bytes (``largest_leaf_shard``, ``params``, ``optimizer``: one device's bytes) and
    whether they fit ``host_ram_gb`` (None: not judged)."""
    loading = per_host * largest_leaf_shard + CHUNK_BYTES
    staging = per_host * (params + optimizer)
    runtime = int(RUNTIME_GB * GB)
    peak = runtime + max(loading, staging)
    ram = None if host_ram_gb is None else host_ram_gb * GB
    return dict(
        loading=loading,
        staging=staging,
        runtime=runtime,
        peak=peak,
        ram=ram,
        fits=None if ram is None else peak <= ram,
    )


def format_host(h: dict[str, Any], per_host: int) -> str:
    line = (
        f"per host ({per_host} devices): loading {h['loading'] / GB:.2f} GB, checkpoint staging "
        f"{h['staging'] / GB:.2f} GB, runtime allowance {h['runtime'] / GB:g} GB: "
        f"peak {h['peak'] / GB:.2f} GB"
    )
    if h["ram"] is not None:
        verdict = "fits" if h["fits"] else "DOES NOT FIT"
        line += f"; {h['peak'] / h['ram']:.0%} of {h['ram'] / GB:g} GB host RAM: {verdict}"
    return line
