"""Test set-up: 8 fake CPU devices (set before JAX is imported) so sharding tests run anywhere;
the CLI's malloc tunables (:mod:`qarl_jax.heap`) for the processes started after this point (the
pytest-xdist workers and the commands tests run)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()

import pathlib  # noqa: E402

import pytest  # noqa: E402

from qarl_jax.heap import tuned_environ  # noqa: E402

os.environ.update(tuned_environ(os.environ) or {})

REPO = pathlib.Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


def pytest_collection_modifyitems(config, items):
    """Modules holding a ``slow`` test run first (the order is otherwise kept): under the README's
    ``-n 2 --dist loadfile`` the longest modules start at once, instead of one of them starting
    last and leaving a worker to finish it alone."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)  # a stable sort: the slow modules' tests first


@pytest.fixture(scope="session")
def gsm8k_dir() -> pathlib.Path:
    """The published GSM8K files, read in place from ../shared (never copied into the repo)."""
    path = SHARED / "data" / "gsm8k"
    if not path.is_dir():
        pytest.fail(f"GSM8K data not found at {path}: the repo expects ../shared beside it")
    return path


@pytest.fixture(scope="module", autouse=True)
def release_compiled_programs():
    """Drop every jit cache when a module ends, so its compiled programs are freed. Why: each
    XLA:CPU executable keeps a few memory mappings for its JIT code while a cache holds it, and one
    process running the whole suite kept ~650 tests' programs alive: the mappings grew past the
    kernel's ``vm.max_map_count`` (65530) and the next compile or cache read died with SIGSEGV
    (measured per test from ``/proc/self/maps``: 20k mappings a third of the way through)."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="module")
def module_compilation_cache(tmp_path_factory):
    """XLA's persistent cache for one module's runs (they recompile the same programs), in a
    directory of its own, switched off again when the module ends (JAX initialises the cache once
    per process: a module that merely set the directory would leave every later test writing it)."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    options = {
        "jax_compilation_cache_dir": str(tmp_path_factory.mktemp("jax-cache")),
        "jax_persistent_cache_min_compile_time_secs": 0.0,
        "jax_persistent_cache_min_entry_size_bytes": 0,
    }
    old = {name: getattr(jax.config, name) for name in options}
    for name, value in options.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()
    yield
    for name, value in old.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()
