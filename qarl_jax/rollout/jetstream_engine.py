"""The rollout engine behind JetStream 0.2.2's ``Engine`` API, and a localhost gRPC server with
JetStream's ``Driver`` / orchestrator. The only module that imports JetStream (and so TensorFlow,
~7-10 s, quietly: :mod:`qarl_jax.quiet_import`): import it only to serve.

Adaptations to 0.2.2, each for a reason:
- ``insert`` cannot return tokens, so every ``generate`` emits the token sampled one call earlier
  (the first at insert) with its count; log-probs travel in the decode state (``ResultTokens`` has
  no field for them): ``emitted_logprobs`` are those of the tokens just returned.
- The orchestrator prepends ``bos_id`` to every prompt; Qwen3 has no BOS, so ``bos_id`` is the
  sentinel -1, which ``prefill`` strips.
- Driver threads SIGKILL the process on any exception, so requests are validated in the gRPC
  handler before they reach a thread (bad ones get INVALID_ARGUMENT); and 0.2.2's ``delete_pytree``
  calls ``jax.tree_map`` (removed from JAX), replaced here by a working one.
- ``server_lib`` binds every interface; :class:`Server` binds 127.0.0.1 unless told otherwise,
  and without SO_REUSEPORT (gRPC's default), so a second server on a bound port fails instead of
  silently sharing its traffic.
- gRPC answers a request body it cannot parse (garbage, invalid UTF-8 in a string field) with
  UNKNOWN and a logged traceback; :class:`Server` parses requests itself and answers
  INVALID_ARGUMENT.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading

import grpc
import jax
import jax.numpy as jnp
import numpy as np

from qarl_jax.quiet_import import import_tensorflow

import_tensorflow()  # before JetStream imports it: its start-up lines hidden (see quiet_import)

from jetstream.core import orchestrator  # noqa: E402
from jetstream.core.proto import jetstream_pb2  # noqa: E402
from jetstream.engine import engine_api, token_utils, tokenizer_api, tokenizer_pb2  # noqa: E402

from qarl_jax.rollout.engine import DecodeState, RolloutEngine, SlotRequest  # noqa: E402
from qarl_jax.rollout.sampling import GREEDY, SamplingParams  # noqa: E402

BOS_SENTINEL = -1
_PREFILL_LENGTHS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)  # pad_tokens'


def _delete_pytree(tree) -> None:
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            leaf.delete()


orchestrator.delete_pytree = _delete_pytree


class Tokenizer(tokenizer_api.Tokenizer):
    """A Hugging Face ``tokenizers.Tokenizer`` for the orchestrator (no BOS, EOS is the stop token)."""

    def __init__(self, hf_tokenizer, eos_ids: tuple[int, ...]):
        self.hf, self._eos, self._stops = hf_tokenizer, eos_ids[0], set(eos_ids)

    def encode(self, s: str, **kwargs):
        ids = np.asarray(self.hf.encode(s, add_special_tokens=False).ids, np.int32)
        return token_utils.pad_tokens(
            ids,
            self.bos_id,
            self.pad_id,
            is_bos=kwargs.get("is_bos", True),
            max_prefill_length=kwargs.get("max_prefill_length"),
            jax_padding=kwargs.get("jax_padding", True),
        )

    def decode(self, token_ids: list[int], **kwargs) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=False)

    @property
    def pad_id(self) -> int:
        return self._eos

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def bos_id(self) -> int:
        return BOS_SENTINEL

    @property
    def stop_tokens(self) -> set[int]:
        return self._stops


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class JetDecodeState:
    """The core state plus, per slot: a sampled token waiting to be emitted, its log-probs, and
    the log-probs of the tokens the last ``generate`` returned."""

    core: DecodeState
    pending: jax.Array  # [S] bool
    logprobs: jax.Array  # [S] f32, of the pending tokens (policy)
    emitted_logprobs: jax.Array  # [S] f32, of the tokens in the last ResultTokens (policy)


class JetStreamEngine(engine_api.Engine):
    """One interleaved engine: prefill, insert and generate all run the core on the same devices."""

    def __init__(
        self,
        core: RolloutEngine,
        tokenizer=None,
        sampling: SamplingParams = GREEDY,
        seed: int = 0,
    ):
        if not core.config.eos_ids:
            raise ValueError("the served engine needs EngineConfig.eos_ids (its stop tokens)")
        fits = [n for n in _PREFILL_LENGTHS if n <= core.config.max_prompt_len]
        if not fits:
            raise ValueError(f"max_len {core.config.max_len} leaves no room for JetStream's 16-token bucket")
        self.core, self.hf_tokenizer, self.sampling, self.seed = core, tokenizer, sampling, seed
        self._max_prefill = fits[-1]
        self._requests = 0
        self._lock = threading.Lock()
        self._insert = jax.jit(self._insert_impl, donate_argnums=(1,))
        self._generate = jax.jit(self._generate_impl, donate_argnums=(1,))

    # ---- request checks (run in the gRPC handler, before any driver thread sees the request) ----

    def prompt_ids(self, text: str) -> list[int]:
        if self.hf_tokenizer is None:
            raise ValueError("this server has no tokenizer: send token_content")
        return self.hf_tokenizer.encode(text, add_special_tokens=False).ids

    def validate(self, ids: list[int], max_tokens: int) -> str | None:
        """Why a prompt (token ids, no BOS) with ``max_tokens`` cannot be served, or None."""
        vocab = self.core.model.config.vocab_size
        if not ids:
            return "empty prompt"
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            return f"token ids out of range [0, {vocab}): {bad[:5]}"
        if len(ids) + 1 > self._max_prefill:  # +1: the orchestrator's BOS sentinel
            return f"prompt of {len(ids)} tokens exceeds the limit of {self._max_prefill - 1}"
        room = self.core.config.max_len - len(ids)
        if not 0 < max_tokens <= room:
            return f"max_tokens must be in [1, {room}] for a {len(ids)}-token prompt, got {max_tokens}"
        return None

    # ---- the Engine API -----------------------------------------------------------------------

    def load_params(self, *args, **kwargs):
        return self.core.params

    def prefill(self, *, params, existing_prefix=None, padded_tokens, true_length: int):
        if existing_prefix is not None:
            raise NotImplementedError("prefix caching (session_cache) is not supported")
        ids = np.asarray(padded_tokens)[:true_length]
        if ids.size and ids[0] == BOS_SENTINEL:
            ids = ids[1:]
        with self._lock:
            request, self._requests = self._requests, self._requests + 1
        return self.core.prefill(params, [ids.tolist()]), request

    def insert(self, prefix, decode_state: JetDecodeState, slot: int) -> JetDecodeState:
        prefix, request = prefix
        room = self.core.config.max_len
        req = SlotRequest(
            row=0, slot=slot, prompt_index=request, sample_index=0, max_new=room, sampling=self.sampling
        )
        cols = self.core.insert_columns([req])
        with self.core.context():
            return self._insert(prefix, decode_state, cols, np.int32(self.seed))

    def generate(self, params, decode_state: JetDecodeState):
        with self.core.context():
            state, data = self._generate(params, decode_state)
        return state, engine_api.ResultTokens(
            data=data, tokens_idx=(0, 1), valid_idx=(1, 2), length_idx=(2, 3), samples_per_slot=1
        )

    def init_decode_state(self, *args, **kwargs) -> JetDecodeState:
        s = self.core.config.slots
        return JetDecodeState(
            core=self.core.init_decode_state(),
            pending=jnp.zeros((s,), bool),
            logprobs=jnp.zeros((s,), jnp.float32),
            emitted_logprobs=jnp.zeros((s,), jnp.float32),
        )

    def get_prefix_destination_sharding(self):
        return None

    def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
        return tokenizer_pb2.TokenizerParameters(path="qarl_jax")

    def build_tokenizer(self, metadata: tokenizer_pb2.TokenizerParameters) -> Tokenizer:
        return Tokenizer(self.hf_tokenizer, self.core.config.eos_ids)

    @property
    def max_concurrent_decodes(self) -> int:
        return self.core.config.slots

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def max_prefill_length(self) -> int:
        return self._max_prefill

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self.core.mesh or jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("data",))

    @property
    def colocated_cpus(self):
        return None

    # ---- jitted bodies ------------------------------------------------------------------------

    def _insert_impl(self, prefix, state: JetDecodeState, cols, seed):
        core, first = self.core.insert_impl(prefix, state.core, cols, seed)
        slots = cols["slots"]
        return dataclasses.replace(
            state,
            core=core,
            pending=state.pending.at[slots].set(True, mode="drop"),
            logprobs=state.logprobs.at[slots].set(first.logprobs, mode="drop"),
        )

    def _generate_impl(self, params, state: JetDecodeState):
        core = state.core
        data = jnp.stack([core.tokens, state.pending.astype(jnp.int32), core.generated], axis=1)
        core, step = self.core.generate_impl(params, core)
        new = JetDecodeState(
            core=core,
            pending=step.valid,
            logprobs=jnp.where(step.valid, step.logprobs, 0.0),
            emitted_logprobs=state.logprobs,
        )
        return new, data


@dataclasses.dataclass(frozen=True)
class Unparsable:
    """A request body that is not a ``DecodeRequest``, with protobuf's reason."""

    error: str


def parse_decode_request(data: bytes):
    """The ``DecodeRequest`` in ``data``, or :class:`Unparsable` (never raises: gRPC would log it)."""
    try:
        return jetstream_pb2.DecodeRequest.FromString(data)
    except Exception as e:
        return Unparsable(str(e) or type(e).__name__)


class ValidatingOrchestrator(orchestrator.LLMOrchestrator):
    """JetStream's servicer with requests checked first: a bad one is answered INVALID_ARGUMENT
    instead of reaching (and killing) a driver thread."""

    def __init__(self, driver: orchestrator.Driver, engine: JetStreamEngine):
        super().__init__(driver=driver)
        self._engine = engine

    def _problem(self, request) -> str | None:
        if isinstance(request, Unparsable):
            return f"malformed request: {request.error}"
        which = request.WhichOneof("content")
        if which is None:
            return "empty request: set text_content or token_content"
        if request.session_cache:
            return "session_cache is not supported"
        try:
            ids = (
                list(request.token_content.token_ids)
                if which == "token_content"
                else self._engine.prompt_ids(request.text_content.text)
            )
        except Exception as e:  # a tokenizer failure is the client's problem, not the server's
            return f"cannot tokenize the prompt: {e}"
        return self._engine.validate(ids, request.max_tokens)

    async def Decode(self, request, context=None):  # noqa: N802  (the gRPC method name)
        problem = self._problem(request)
        if problem is not None:
            if context is None:
                raise ValueError(problem)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
            return
        async for response in super().Decode(request, context):
            yield response


class Server:
    """JetStream's Driver (interleaved: one engine prefills and generates) behind a gRPC server on
    ``host:port`` (port 0: any free port, see ``self.port``). ``stop`` ends threads and server."""

    def __init__(self, engine: JetStreamEngine, port: int = 9000, host: str = "127.0.0.1", threads: int = 16):
        params = engine.load_params()
        self.driver = orchestrator.Driver(
            prefill_engines=[engine],
            generate_engines=[engine],
            prefill_params=[params],
            generate_params=[params],
            interleaved_mode=True,
        )
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=threads)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="grpc-loop", daemon=True)
        self._thread.start()

        async def build():
            server = grpc.aio.server(self._executor, options=[("grpc.so_reuseport", 0)])
            servicer = ValidatingOrchestrator(self.driver, engine)
            handlers = {
                "Decode": grpc.unary_stream_rpc_method_handler(
                    servicer.Decode,
                    request_deserializer=parse_decode_request,
                    response_serializer=jetstream_pb2.DecodeResponse.SerializeToString,
                ),
                "HealthCheck": grpc.unary_unary_rpc_method_handler(
                    servicer.HealthCheck,
                    request_deserializer=jetstream_pb2.HealthCheckRequest.FromString,
                    response_serializer=jetstream_pb2.HealthCheckResponse.SerializeToString,
                ),
            }
            service = jetstream_pb2.DESCRIPTOR.services_by_name["Orchestrator"].full_name
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
            try:
                bound = server.add_insecure_port(f"{host}:{port}")
            except RuntimeError:  # newer gRPC raises where older returned port 0
                bound = 0
            if bound:
                await server.start()
            return server, bound

        try:
            self._server, self.port = self._run(build())
        except BaseException:
            self.driver.stop()
            raise
        if not self.port:
            self.stop()
            raise OSError(f"cannot bind {host}:{port}: the port is in use (another server?) or not ours")
        self.address = f"{host}:{self.port}"

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def wait(self) -> None:
        """Block until the server terminates (e.g. Ctrl-C), then stop everything."""
        try:
            self._run(self._server.wait_for_termination())
        finally:
            self.stop()

    def stop(self) -> None:
        if self._loop.is_closed():
            return
        self.driver.stop()
        self._run(self._server.stop(grace=1))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
        self._executor.shutdown(wait=False)


def quiet_orchestrator_logs(level: int = logging.WARNING) -> None:
    """The orchestrator sets the root logger to DEBUG on import and logs every step; calm it."""
    logging.getLogger().setLevel(level)


__all__ = [
    "BOS_SENTINEL",
    "JetDecodeState",
    "JetStreamEngine",
    "Server",
    "Tokenizer",
    "quiet_orchestrator_logs",
]
