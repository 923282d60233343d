"""TensorFlow imported without its start-up lines on stderr.

google-jetstream imports TensorFlow (through seqio), whose C++ libraries log while they load: on a
machine without CUDA, ``Could not find cuda drivers`` (cudart_stub.cc) once per library, each after
absl's ``WARNING: All log messages before absl::InitializeLog() is called are written to STDERR``;
elsewhere cuDNN/cuFFT/cuBLAS factory registrations (``E0000``), TF-TRT (``W0000``) or
cpu_feature_guard lines. No setting silences them: they are written while the libraries load, before
``absl::InitializeLog``, and until then absl writes every message to stderr whatever the threshold
(``TF_CPP_MIN_LOG_LEVEL=3`` still prints them; JAX sets the variable to 1 when imported anyway). So
the import runs with file descriptor 2 sent to a temporary file, which is dropped when the import
succeeds and copied back to stderr when it fails (then it explains the failure).

Every path to TensorFlow goes through here: :mod:`qarl_jax.rollout.jetstream_engine` (the only
module importing JetStream) calls :func:`import_tensorflow` before JetStream's imports. The TFDS
sources read array_record files through ``tfds.data_source``, which never imports TensorFlow.

The lines come back with ``TF_CPP_MIN_LOG_LEVEL=0`` (a value only the user sets: JAX's default is
1) or ``show=True`` (``python -m qarl_jax.serve --log-level DEBUG``).
"""

from __future__ import annotations

import importlib
import os
import sys
import tempfile


def import_tensorflow(show: bool = False, module: str = "tensorflow") -> None:
    """Import ``module`` (TensorFlow, or a module that imports it) with what its loading writes to
    stderr hidden, unless ``show`` or ``TF_CPP_MIN_LOG_LEVEL=0``; nothing when already imported."""
    if module in sys.modules:
        return
    if show or os.environ.get("TF_CPP_MIN_LOG_LEVEL") == "0":
        importlib.import_module(module)
        return
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr (a closed descriptor 2): nothing would be printed anyway
        importlib.import_module(module)
        return
    imported = False
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            importlib.import_module(module)
            imported = True
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if not imported:
                sink.seek(0)
                os.write(2, sink.read())
