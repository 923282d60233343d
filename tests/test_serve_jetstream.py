"""A real JetStream server (Driver + orchestrator, gRPC on localhost) around the rollout engine,
queried through JetStream's own stubs: expected tokens, and it survives malformed requests."""

import re
import subprocess
import sys

import grpc
import jax
import numpy as np
import pytest

from qarl_jax.models import Qwen3ForCausalLM, init_params, preset, save_pretrained
from qarl_jax.rollout import GREEDY, EngineConfig, RolloutEngine, rollout

EOS = 0
# no deadline on a request or a command: the server compiles its programs on its first request
# (past 60 s on a loaded host: a 60 s deadline failed there), and a hang is pytest-timeout's to end
TIMEOUT = None
# what TensorFlow's and absl's C++ libraries print while loading, and any library's DEBUG logging
NOISE = ("tensorflow/", "cpu_feature_guard", "oneDNN", "absl", "E0000", "W0000", "I0000", " DEBUG ")
ABSL_PREFIX = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ ")  # absl's "I1202 05:19:18.658097 ..."


def noise(text: str) -> list[str]:
    """The lines of ``text`` that are start-up noise (see NOISE)."""
    return [line for line in text.splitlines() if any(m in line for m in NOISE) or ABSL_PREFIX.match(line)]


@pytest.fixture(scope="module")
def js():
    """The JetStream modules, imported only here (TensorFlow: several seconds)."""
    from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc

    from qarl_jax.rollout import jetstream_engine

    jetstream_engine.quiet_orchestrator_logs()
    return jetstream_pb2, jetstream_pb2_grpc, jetstream_engine


# two layers: serving does not depend on depth, and the engine's compiles grow with the layers
CONFIG = preset("qwen3-tiny", num_hidden_layers=2)


@pytest.fixture(scope="module")
def core():
    model = Qwen3ForCausalLM(CONFIG)
    params = init_params(model, jax.random.key(0))
    return RolloutEngine(
        model, params, EngineConfig(slots=2, max_len=40, max_prefill_batch=1, eos_ids=(EOS,))
    )


@pytest.fixture(scope="module")
def server(js, core):
    _, _, jetstream_engine = js
    srv = jetstream_engine.Server(jetstream_engine.JetStreamEngine(core, sampling=GREEDY), port=0)
    yield srv
    srv.stop()


def decode(js, address, max_tokens, token_ids=None, text=None):
    pb2, pb2_grpc, _ = js
    request = pb2.DecodeRequest(max_tokens=max_tokens)
    if token_ids is not None:
        request.token_content.token_ids.extend(token_ids)
    if text is not None:
        request.text_content.text = text
    with grpc.insecure_channel(address) as channel:
        stub = pb2_grpc.OrchestratorStub(channel)
        out = []
        for response in stub.Decode(request, timeout=TIMEOUT):
            for sample in response.stream_content.samples:
                out.extend(sample.token_ids)
        return out


@pytest.mark.slow
def test_server_returns_engine_tokens_and_survives_bad_requests(js, core, server):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 128, size=n).tolist() for n in (6, 13)]
    want = rollout(core, prompts, max_new_tokens=8, sampling=GREEDY, progress=False)
    expected = [[t for t in s[0].tokens if t != EOS] for s in want]  # JetStream drops the stop token
    assert all(expected)

    assert decode(js, server.address, 8, token_ids=prompts[0]) == expected[0]
    bad = {
        "empty": dict(),
        "no tokens": dict(token_ids=[]),
        "out of range": dict(token_ids=[5, 128]),
        "negative": dict(token_ids=[-3, 4]),
        "too long": dict(token_ids=[1] * 40),
        "text without tokenizer": dict(text="1+1="),
    }
    for name, kwargs in bad.items():
        with pytest.raises(grpc.RpcError) as err:
            decode(js, server.address, 8, **kwargs)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
    for max_tokens in (0, -1, 100):
        with pytest.raises(grpc.RpcError) as err:
            decode(js, server.address, max_tokens, token_ids=prompts[0])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert decode(js, server.address, 8, token_ids=prompts[1]) == expected[1]  # still serving
    assert decode(js, server.address, 3, token_ids=prompts[0]) == expected[0][:3]


@pytest.mark.slow
def test_serve_cli_on_a_checkpoint(tmp_path, js):
    """``python -m qarl_jax.serve`` loads a checkpoint, freezes it (w8a8) and answers on localhost;
    neither ``--help`` nor serving prints TensorFlow's or absl's start-up lines or DEBUG logs."""
    from qarl_jax.data.arith_tokenizer import build_arithmetic_tokenizer

    serve = [sys.executable, "-m", "qarl_jax.serve"]
    helped = subprocess.run([*serve, "--help"], capture_output=True, text=True, timeout=TIMEOUT)
    assert helped.returncode == 0 and "--log-level" in helped.stdout
    assert not noise(helped.stdout + helped.stderr)
    model_dir = tmp_path / "model"
    tokenizer = build_arithmetic_tokenizer()
    params = init_params(Qwen3ForCausalLM(CONFIG), jax.random.key(2))
    save_pretrained(model_dir, CONFIG, params, tokenizer)
    cmd = [*serve, "--checkpoint", str(model_dir), "--quant", "w8a8", "--port", "0", "--slots", "2"]
    cmd += ["--max-len", "64"]
    with (tmp_path / "stderr").open("w") as stderr:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True)
    printed = []
    try:
        for line in proc.stdout:
            printed.append(line)
            if line.startswith("serving on"):
                break
        assert printed[-1].startswith("serving on 127.0.0.1:"), printed
        address = printed[-1].split()[-1]
        out = decode(js, address, 5, text="12+7=")
        assert 1 <= len(out) <= 5 and all(0 <= t < 128 for t in out)
        with pytest.raises(grpc.RpcError):
            decode(js, address, 5, text="")
        assert decode(js, address, 5, text="12+7=") == out
    finally:
        proc.terminate()
        printed.append(proc.communicate(timeout=30)[0])
    assert not noise("".join(printed) + (tmp_path / "stderr").read_text())


@pytest.mark.parametrize("case", ["quiet", "show", "user level 0", "failing"])
def test_import_tensorflow_hides_start_up_lines_unless_asked(case, tmp_path, monkeypatch, capfd):
    """What a module writes to descriptor 2 while loading (as TensorFlow's C++ libraries do) is
    dropped; shown with ``show`` or ``TF_CPP_MIN_LOG_LEVEL=0``, and when the import fails."""
    from qarl_jax.quiet_import import import_tensorflow

    name = f"noisy_{case.replace(' ', '_')}"
    fail = "raise ImportError('no library')" if case == "failing" else ""
    (tmp_path / f"{name}.py").write_text(f"import os\nos.write(2, b'I0000 loading\\n')\n{fail}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    if case == "user level 0":
        monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "0")
    if case == "failing":
        with pytest.raises(ImportError, match="no library"):
            import_tensorflow(module=name)
    else:
        import_tensorflow(show=case == "show", module=name)
        assert name in sys.modules
        import_tensorflow(module=name)  # imported already: nothing happens
    assert capfd.readouterr().err == ("" if case == "quiet" else "I0000 loading\n")


@pytest.mark.slow
def test_bound_port_and_unparsable_requests(js, core, server, tmp_path, capsys):
    """A second server on the bound port fails (no SO_REUSEPORT), the CLI says so before loading a
    model; request bodies that are not a DecodeRequest (invalid UTF-8 text, garbage) are
    INVALID_ARGUMENT; a directory that is no model says how to export one."""
    from qarl_jax import serve

    pb2, _, jetstream_engine = js
    with pytest.raises(OSError, match=f"cannot bind 127.0.0.1:{server.port}: the port is in use"):
        jetstream_engine.Server(jetstream_engine.JetStreamEngine(core, sampling=GREEDY), port=server.port)
    assert serve.main(["--checkpoint", str(tmp_path), "--port", str(server.port)]) == 2
    assert f"cannot serve on 127.0.0.1:{server.port}" in capsys.readouterr().err
    valid = pb2.DecodeRequest(max_tokens=4)
    valid.text_content.text = "AB"
    bodies = {"invalid UTF-8": valid.SerializeToString().replace(b"AB", b"\xff\xfe"), "garbage": b"\xff" * 7}
    with grpc.insecure_channel(server.address) as channel:
        call = channel.unary_stream("/jetstream_proto.Orchestrator/Decode", request_serializer=lambda b: b)
        for name, body in bodies.items():
            with pytest.raises(grpc.RpcError) as err:
                list(call(body, timeout=TIMEOUT))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
            assert "malformed request" in err.value.details(), name
    assert serve.main(["--checkpoint", str(tmp_path), "--port", "0"]) == 3
    err = capsys.readouterr().err
    assert "neither a Hugging Face model directory" in err and "--export-hf" in err
