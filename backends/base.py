"""The engine-replica protocol every backend implements, and the boundary where foreign errors are translated.

A backend turns one engine's HTTP dialect into a stream of `Chunk`s of *new* tokens (deltas), whatever the
engine's own stream shape (vLLM deltas, SGLang cumulative). It never retries: resuming is the gateway's job.
"""

from __future__ import annotations

import re
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import aiohttp

from backends.errors import (
    BackendError,
    BackendProtocolError,
    BackendRejected,
    BackendTimeout,
    BackendUnavailable,
    WeightsNotLoaded,
)
from backends.generation_transport import IDLE_EXPIRY_S, TransportFactory
from backends.routed_experts import ExpertArray, RoutedExpertsFormatError

if TYPE_CHECKING:
    from backends.scoring import PromptScorer

FinishReason = Literal["stop", "length", "abort"]
PauseMode = Literal["abort", "keep", "wait"]
NewRequestsWhilePaused = Literal["block", "reject", "unknown"]
TransferBackend = Literal["nccl", "gloo", "tensor"]
"""How an in-memory weight transfer reaches an engine. `nccl`: a process group per engine, the trainer its rank 0
(vLLM `/init_weight_transfer_engine` with its `--weight-transfer-config` backend, SGLang `/init_weights_update_group`),
the tensors broadcast over it; `gloo`: the same over gloo, for vLLM's CPU build (the project's plugin,
`backends/vllm-gloo-plugin/`); `tensor`: the tensors sent inline in the update call (SGLang
`/update_weights_from_tensor`), no group."""
GROUP_BACKENDS: frozenset[TransferBackend] = frozenset({"nccl", "gloo"})  # a process group per engine, trainer rank 0


@dataclass(slots=True)
class SamplingParams:
    """Sampling for one engine request. Logprobs of sampled tokens are always requested (RL needs them).

    A value: nothing changes one once made (a continuation's is a `dataclasses.replace` copy). Not frozen only
    because one is made per request, and a frozen dataclass sets each field through `object.__setattr__`, which
    costs more than the whole construction otherwise does. `min_p` and the penalties None: not sent (the engine's
    default)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    top_logprobs: int = 0
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


def add_optional_sampling(fields: dict[str, Any], sampling: SamplingParams) -> None:
    """Add to an engine request's sampling `fields` those of `sampling` that both engines name alike and get only
    when set (`min_p`, `presence_penalty`, `frequency_penalty`): a value left out is the engine's default, which
    vLLM may take from the model's generation config."""
    if sampling.min_p is not None:
        fields["min_p"] = sampling.min_p
    if sampling.presence_penalty is not None:
        fields["presence_penalty"] = sampling.presence_penalty
    if sampling.frequency_penalty is not None:
        fields["frequency_penalty"] = sampling.frequency_penalty


@dataclass(frozen=True, slots=True)
class VersionSpan:
    """Output-token indexes [start, end) sampled under `version` (the engines' `weight_versions`)."""

    version: str
    start: int
    end: int


@dataclass(slots=True)
class Chunk:
    """New output of one engine request since the previous chunk.

    `routed_experts`, when present, covers positions [experts_start, prompt + output - 1) of this request
    (engines never report the last sampled token, which was not run through the model yet). `version_spans`
    index this request's output tokens; both usually arrive on the final chunk only.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    routed_experts: ExpertArray | None = None
    version_spans: list[VersionSpan] | None = None
    weight_version: str | None = None
    cached_tokens: int | None = None


def unfinished_answer(replica: str, streamed: bool) -> BackendError:
    """The error for an answer that ended without a finish reason: a stream cut short (the replica broke off:
    `BackendUnavailable`), or a whole answer that was complete but lacks one (a contract breach)."""
    if streamed:
        return BackendUnavailable(f"replica {replica}: the stream ended before the request finished", replica=replica)
    return BackendProtocolError(f"replica {replica}: a finished answer without finish_reason", replica=replica)


def merge_deltas(chunks: Sequence[Chunk]) -> Chunk:
    """Consecutive unfinished chunks as one delta (the events of one socket read): the layers above then do their
    per-chunk work, and write downstream, once per read instead of once per token."""
    if len(chunks) == 1:
        return chunks[0]
    merged = Chunk(token_ids=[], logprobs=[])
    tops: list[list[tuple[int, float]]] | None = None
    for chunk in chunks:
        merged.token_ids += chunk.token_ids
        merged.logprobs += chunk.logprobs
        if chunk.top_logprobs is not None:
            tops = (tops or []) + chunk.top_logprobs
        if chunk.weight_version is not None:
            merged.weight_version = chunk.weight_version
    merged.top_logprobs = tops
    return merged


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a replica's engine can do; the gateway adapts its orchestration to it."""

    pause_modes: frozenset[PauseMode]
    routed_experts_out: bool = False
    routed_experts_in: bool = False
    streams_routed_experts: bool = False
    version_spans: bool = True
    token_endpoint: str = "/v1/completions"
    new_requests_while_paused: NewRequestsWhilePaused = "unknown"
    transfer_backends: frozenset[TransferBackend] = frozenset()  # the in-memory weight transfers it takes

    def streams(self, wanted: bool) -> bool:
        """Whether a request that `wanted` a stream gets one: an engine that sends routed experts only in whole
        answers (vLLM's completions transport) answers whole whenever it sends them."""
        return wanted and (self.streams_routed_experts or not self.routed_experts_out)


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """One tensor of an in-memory transfer as the engine receives it: its checkpoint name, torch dtype name
    ("float32", "bfloat16") and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TransferGroup:
    """An engine's process group with the trainer for an in-memory weight transfer: the trainer is rank 0 and hosts
    the rendezvous at `master_address:master_port`; the engine's workers are ranks `rank_offset` … `world_size - 1`."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int


@dataclass(frozen=True, slots=True)
class Load:
    """In-flight work the engine reports, the share of its KV cache in use (0 to 1; the fullest of its engines where
    it runs several), and its prefix cache's counters since it started: prompt tokens looked up, and those found
    cached (None where it does not say). `ranks`: the same, per data-parallel rank, for an engine that runs several
    and labels its metrics by rank (empty otherwise)."""

    running: int | None = None
    waiting: int | None = None
    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None
    kv_usage: float | None = None
    ranks: dict[int, Load] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Explicit timeouts for every outbound call, seconds."""

    connect: float = 5.0
    read: float = 600.0
    write: float = 30.0
    pool: float = 30.0
    # Pause, resume, abort, version and cache calls: short, but an engine busy on a loaded host answers them late
    # (a pause waits for the scheduler's step); bounded so they cannot hang a weight update forever.
    control: float = 30.0
    health: float = 2.0  # a health or load probe: an engine that cannot answer this fast is unhealthy
    # A whole (non-streamed) answer's wait for its first byte is its whole generation: bounded by this instead of
    # `read` (the gateway passes its request deadline; None: `read`).
    whole_answer: float | None = None
    # An unused connection to the replica is closed after this instead of reused, by both clients. Under the
    # engine's keep-alive (uvicorn's 5 s in vLLM and SGLang by default), no request goes out on a connection the
    # server is closing at that moment: such a request would fail as if the replica had broken.
    keepalive: float = IDLE_EXPIRY_S

    def client(self, read: float | None = None) -> aiohttp.ClientTimeout:
        """As aiohttp's timeouts: `connect` bounds opening a socket, `pool` waiting for a pooled connection (and
        the connect within it), `read` every gap between bytes of the answer (`read` overrides it). aiohttp has no
        separate write timeout: a request body the engine does not take stalls into the read timeout."""
        return aiohttp.ClientTimeout(
            total=None, connect=self.pool + self.connect, sock_connect=self.connect, sock_read=read or self.read
        )


@runtime_checkable
class EngineBackend(Protocol):
    """One engine replica. `data_parallel_size`: the data-parallel ranks it runs behind its one server (1: none),
    each of which a generation request may be pinned to (`generate`'s `dp_rank`). `scorer`: its prompt-scoring
    calls (a teacher's, `backends.scoring`)."""

    id: str
    url: str
    capabilities: Capabilities
    data_parallel_size: int
    scorer: PromptScorer

    @property
    def paced_reads(self) -> int:
        """Stream reads held back so far to take several events at once (`backends.read_pacing`; 0: never)."""
        ...

    def generate(
        self,
        token_ids: Sequence[int],
        sampling: SamplingParams,
        request_id: str,
        routed_experts: ExpertArray | None = None,
        experts_start: int = 0,
        *,
        stream: bool = True,
        deadline: float | None = None,
        cache_salt: str | None = None,
        dp_rank: int | None = None,
        adapter: str | None = None,
    ) -> AsyncGenerator[Chunk, None]:
        """The new tokens of one request, as chunks. Ends with a chunk whose `finish_reason` is set; an engine-side
        abort ends with `finish_reason="abort"` and the partial tokens. Raises `BackendError` on failure, and
        `BackendTimeout` once `deadline` (loop time) passed, if given.

        `stream` says whether the caller wants the tokens as they come: the adapter then streams the answer where
        its engine can (`Capabilities.streams`), else reads it whole, in one go, and yields it as one chunk with every
        token. A whole answer still brings the partial tokens of an abort, but a failure mid-request loses what the
        engine had generated (the caller generates it again).

        The call itself builds the request (its body encoded); nothing is sent before the first iteration. So a
        caller may build a request ahead, while it cannot be sent yet, and drop it unstarted. `token_ids` may be the
        caller's own list (a first segment's prompt, uncopied): nothing of it is kept past the call.

        `cache_salt` partitions the engine's prefix cache (vLLM `cache_salt`, SGLang `extra_key`): a prefix cached
        by a request with another salt (or none) is never reused by this one.

        `dp_rank` pins the request to that data-parallel rank of the engine (vLLM's `X-data-parallel-rank` header,
        SGLang's `routed_dp_rank`); None: the engine's own balancer picks one.

        `adapter` names a LoRA adapter the engine holds (vLLM's `model`, SGLang's `lora_path`; `backends.lora`);
        None: the engine's own model."""
        ...

    async def abort(self, request_id: str) -> None:
        """Abort one in-flight request (its stream then ends with `abort`)."""
        ...

    async def pause(self, mode: PauseMode) -> None:
        """Stop generating: abort in-flight requests, keep them frozen, or wait for them to finish."""
        ...

    async def resume(self) -> None: ...

    async def update_weights(self, version: str, source: str | None, *, flush: bool = True) -> bool:
        """Load new weights from `source` (a path the engine can read) and label them `version`; with no
        source the weights were synced out of band (NCCL, checkpoint engine) and only the label changes.
        `flush`: drop the prefix cache too (its KV was computed under the old weights); without it, requests kept
        through the update keep their KV, and the caller keeps new work off old entries (a cache salt).
        Returns whether the prefix cache is clean: False when the engine switched weights but could not
        flush (requests still hold KV), so the caller must `flush_cache` before new work reuses stale KV.
        Raises `WeightsNotLoaded` only where the engine answered that the load from `source` failed and it kept
        its weights (and label); any other failure leaves the engine's weights unknown."""
        ...

    async def weight_version(self) -> str: ...

    async def transfer_workers(self) -> int:
        """The engine's worker processes that join a transfer's process group (its world size without the trainer)."""
        ...

    def forms_transfer_group(self, group: TransferGroup | None) -> bool:
        """Whether opening a transfer with `group` forms it (the trainer must join its rendezvous) rather than keep
        the one an earlier transfer formed; told in the layout before the engine is asked to open."""
        ...

    async def open_transfer(self, backend: TransferBackend, group: TransferGroup | None) -> bool:
        """Open the engine's side of an in-memory weight transfer: join `group` (`nccl`; the call blocks until the
        trainer joins as rank 0; a group formed by an earlier transfer with the same rendezvous is kept, not formed
        again), then open an update session (vLLM `/start_weight_update`, SGLang `/begin_weight_update`). Returns
        whether a group was formed now (the trainer must join it). From here the engine's weights change as the
        trainer pushes tensors: the caller keeps it paused until `finish_transfer` (or `abort_transfer`)."""
        ...

    async def receive_transfer_chunk(self, chunk: Sequence[TensorMeta]) -> None:
        """Receive one chunk the trainer broadcasts over the engine's group, in that order (vLLM `/update_weights`,
        SGLang `/update_weights_from_distributed`): answered once the engine has received and loaded it. The
        gateway's fan-out of a transfer's manifest; without one the trainer makes these calls itself."""
        ...

    async def finish_transfer(self, version: str, *, flush: bool = True) -> bool:
        """Close the update session and label the weights `version`; `flush` and the answer as `update_weights`."""
        ...

    async def abort_transfer(self) -> None:
        """Close an update session the trainer never committed. The engine's weights are unknown (some tensors may
        have landed): the caller reloads them or holds the replica out."""
        ...

    async def flush_cache(self) -> bool:
        """Drop the prefix cache (stale after a weight update); False if the engine refused."""
        ...

    async def health(self) -> bool: ...

    async def load(self) -> Load: ...

    async def aclose(self) -> None: ...


@dataclass(frozen=True, slots=True)
class StreamPacing:
    """Reads of a replica's streams at most once per `interval_s` while at least `min_streams` are open (0: off;
    see `backends.read_pacing`)."""

    interval_s: float = 0.0
    min_streams: int = 1


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """How to reach and drive one replica (built from the gateway's config).

    `routed_experts`: the engine was started with routed-experts capture and the gateway wants them (R3);
    `routed_experts_shape` = (layers, top_k) is needed to decode SGLang's shapeless int32 payload.
    `scale_out` (vLLM): `/inference/v1/generate` is enabled, so routed experts can be streamed.
    `keep_mode` (SGLang): which pause mode implements the gateway's `keep` (retract recomputes KV; in_place
    keeps it but then the cache cannot be flushed until those requests finish).
    `data_parallel_size`: the engine's data-parallel ranks (the gateway pins each request to one).
    """

    id: str
    url: str
    model: str = "tiny"
    routed_experts: bool = False
    routed_experts_shape: tuple[int, int] | None = None
    routed_experts_input: bool = False
    scale_out: bool = False
    keep_mode: Literal["retract", "in_place"] = "retract"
    new_requests_while_paused: NewRequestsWhilePaused = "unknown"
    data_parallel_size: int = 1
    weight_transfer: TransferBackend | None = None  # vLLM: its `--weight-transfer-config` backend (None: none)
    timeouts: Timeouts = field(default_factory=Timeouts)
    max_connections: int = 1024
    stream_pacing: StreamPacing = field(default_factory=StreamPacing)
    generation_transport: TransportFactory | None = None
    """Builds the replica's `GenerationTransport`; None: aiohttp's (`AiohttpTransport`)."""


class translate_errors:  # used like the function it was: `with translate_errors(replica):`
    """Map HTTP-client (aiohttp) and decoding errors to the gateway's error tree (the only place that knows them).

    A class rather than a `contextlib.contextmanager`: it wraps every batch of a stream, and entering a generator-
    based context manager costs several times more.
    """

    __slots__ = ("replica",)

    def __init__(self, replica: str) -> None:
        self.replica = replica

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None or isinstance(exc, BackendError):
            return
        replica = self.replica
        if isinstance(exc, TimeoutError):  # aiohttp's connect and read timeouts are TimeoutErrors
            raise BackendTimeout(f"replica {replica}: {type(exc).__name__}: {exc}", replica=replica) from exc
        if isinstance(exc, aiohttp.ClientError | OSError):
            raise BackendUnavailable(f"replica {replica}: {type(exc).__name__}: {exc}", replica=replica) from exc
        if isinstance(exc, ValueError | KeyError | TypeError | IndexError | RoutedExpertsFormatError):
            # orjson.JSONDecodeError is a ValueError; a missing or mistyped field is a contract breach.
            raise BackendProtocolError(f"replica {replica}: unexpected response: {exc!r}", replica=replica) from exc


def encodable_ids(token_ids: Sequence[int]) -> Sequence[int]:
    """`token_ids` as orjson encodes it: a list or tuple as it is (no copy of a long prompt per request), any other
    sequence copied into a list. The caller encodes the result at once: a list it did not copy must not change
    before that."""
    return token_ids if type(token_ids) is list or type(token_ids) is tuple else list(token_ids)


def raise_for_status(replica: str, status: int, body: bytes) -> None:
    """Raise the right BackendError for a non-2xx answer (4xx: rejected, 503: unavailable, else 5xx)."""
    if status < 300:
        return
    text = body[:500].decode("utf-8", "replace")
    message = f"replica {replica} answered {status}: {text}"
    if status == 503:
        raise BackendUnavailable(message, replica=replica, code=str(status))
    if 400 <= status < 500 and status not in (408, 429):
        raise BackendRejected(message, replica=replica, code=str(status))
    raise BackendError(message, replica=replica, code=str(status))


def raise_for_load_status(replica: str, status: int, body: bytes, what: str) -> None:
    """`raise_for_status` for the answer to a weight load: an error status is the engine saying the load failed,
    so `WeightsNotLoaded` (see there for why the engines then keep their weights); except 408, 429 and 503, which
    say the engine did not take the call up at all and stay what `raise_for_status` makes of them."""
    if status < 300 or status in (408, 429, 503):
        raise_for_status(replica, status, body)
        return
    text = body[:500].decode("utf-8", "replace")
    raise WeightsNotLoaded(f"replica {replica}: {what} failed ({status}): {text}", replica=replica, code=str(status))


def spans_to_versions(spans: Sequence[VersionSpan], count: int, fallback: str) -> list[str]:
    """Per-token version labels for `count` tokens from engine spans; tokens no span covers get `fallback`."""
    versions = [fallback] * count
    for span in spans:
        start, end = max(0, span.start), min(count, span.end)
        if start < end:
            versions[start:end] = [span.version] * (end - start)
    return versions


def version_tuple(version: str) -> tuple[int, ...]:
    """`"0.32.0+cpu"` → (0, 32, 0): the leading numeric release parts of an engine's version string."""
    match = re.match(r"\d+(?:\.\d+)*", version.strip())
    return tuple(int(part) for part in match.group(0).split(".")) if match else ()
