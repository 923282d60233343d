"""Test set-up: 8 fake CPU devices (set before JAX is imported) so sharding tests run anywhere."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()

import pathlib  # noqa: E402

import pytest  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


@pytest.fixture(scope="session")
def gsm8k_dir() -> pathlib.Path:
    """The published GSM8K files, read in place from ../shared (never copied into the repo)."""
    path = SHARED / "data" / "gsm8k"
    if not path.is_dir():
        pytest.fail(f"GSM8K data not found at {path}: the repo expects ../shared beside it")
    return path
