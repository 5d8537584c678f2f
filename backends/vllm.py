"""The vLLM adapter: one replica of a vLLM OpenAI server started with `VLLM_SERVER_DEV_MODE=1`.

Behaviour follows ../shared/contracts (vLLM 0.33 from source, 0.32 observed); where the two differ both are
handled. Transport per request:

- with `--enable-scale-out` (spec `scale_out`): streaming `POST /inference/v1/generate`, whose final chunk
  carries `weight_versions` (0.32 and 0.33) and, with R3, `routed_experts`;
- otherwise, no R3: streaming `POST /v1/completions` with token-id prompts (`return_token_ids` gives delta token
  ids, `return_tokens_as_token_ids` keeps top logprobs keyed by id, `return_weight_versions` the version spans:
  0.33 only, 0.32 ignores the field);
- otherwise, with R3: non-streaming `POST /v1/completions`, the only completions transport that carries
  `routed_experts` (streaming completion chunks have no such field); the tokens then arrive in one chunk.

A caller that needs the tokens only at the end (`generate(stream=False)`) gets the same endpoint without streaming:
one answer instead of an event per token (an abort still answers with the partial tokens, in both modes). Either
answer is read by the same loop (`_chunks`): a whole one is a batch of one finished event.

Per-token versions across a `keep` pause need the engine's spans. `capabilities.version_spans` is True with
scale-out, and on the completions transport once `GET /version` says >= 0.33 or a finished request came back
with spans; where it stays False, `pause("keep")` pauses with `abort` instead, and the gateway resumes the
aborted requests itself, so every token still carries the version that sampled it.

Weight updates use the dev-mode routes: `/collective_rpc reload_weights` (from a path), `/update_weight_version`,
and, where the caller flushes (no cache salt, or `weights.kv_after_update: recompute`),
`/reset_prefix_cache?reset_running_requests=true`, because vLLM does not flush the prefix cache when weights change
(running requests are preempted and recompute their KV, so the reset never waits for them). With a `cache_salt` per
weight version on every request, nothing is flushed: kept requests go on with their KV, new ones miss the old
version's prefixes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import aiohttp
import orjson

from backends.base import (
    Capabilities,
    Chunk,
    FinishReason,
    PauseMode,
    ReplicaSpec,
    SamplingParams,
    TensorMeta,
    TransferBackend,
    TransferGroup,
    VersionSpan,
    add_optional_sampling,
    encodable_ids,
    merge_deltas,
    raise_for_load_status,
    translate_errors,
    unfinished_answer,
    version_tuple,
)
from backends.errors import BackendError, BackendProtocolError
from backends.http_client import HttpEngineBackend, answer_batches, request, request_json
from backends.lora import EngineAdapters
from backends.routed_experts import ExpertArray, decode_npy_b64, encode_npy_b64
from backends.scoring import PromptScorer
from backends.weight_transfer import VllmTransfer

__all__ = ["VllmBackend", "without_prompt_echo"]

logger = logging.getLogger(__name__)

_PROMPT_ECHO_KEY = b'"prompt_token_ids":'
_JSON_SPACE = (b" ", b"\t", b"\r", b"\n")
PROMPT_ECHO_MIN_BYTES = 1024
"""Echoed prompt ids shorter than this (about 200 ids) are parsed with the rest: cutting them out costs more."""
_SHORTEST_CUT = len(_PROMPT_ECHO_KEY) + PROMPT_ECHO_MIN_BYTES


def without_prompt_echo(answer: bytes) -> bytes:
    """`answer` (the JSON of a whole answer or of a stream's first event) with the prompt ids that vLLM echoes back
    (`"prompt_token_ids": [...]`, with `return_token_ids`) replaced by `null`, unparsed: the gateway sent that
    prompt and never reads it back, and parsing it is a Python int per prompt token on the event loop, every turn,
    where the cut scans bytes. Only a flat array of at least
    `PROMPT_ECHO_MIN_BYTES` is cut; anything else is returned as it is.

    The key cannot be matched inside a string: there its quotes are escaped (`\\"prompt_token_ids\\":`), and an
    engine's keys are its schema's. vLLM puts the key before `routed_experts` (in a completions choice) or before
    `choices` (`/inference/v1/generate`), so the search stops short of the experts' base64."""
    if len(answer) < _SHORTEST_CUT:
        return answer  # too short to hold an echo worth cutting (most short answers): no search
    start = answer.find(_PROMPT_ECHO_KEY)
    if start < 0:
        return answer
    value = start + len(_PROMPT_ECHO_KEY)
    while answer[value : value + 1] in _JSON_SPACE:  # `": [`: whitespace after the colon (b"" ends it)
        value += 1
    if answer[value : value + 1] != b"[":
        return answer  # null, or not an array
    end = answer.find(b"]", value)
    if end - value < PROMPT_ECHO_MIN_BYTES or answer.find(b"[", value + 1, end) >= 0:
        return answer  # short (or unterminated: end is -1), or nested: parsed as it is
    return answer[:value] + b"null" + answer[end + 1 :]


COMPLETIONS = "/v1/completions"
GENERATE = "/inference/v1/generate"
DP_RANK_HEADER = "X-data-parallel-rank"
"""Pins a request to one data-parallel rank (vLLM's API server reads it on both generation routes)."""

# vLLM's finish reasons (v1/engine/__init__.py). `repetition` ends a request like a stop condition; `error`
# is a failed request and raises instead.
_FINISH_REASONS: dict[str, FinishReason] = {
    "stop": "stop",
    "length": "length",
    "abort": "abort",
    "repetition": "stop",
    "content_filter": "stop",
}


@dataclasses.dataclass(slots=True)
class _Answer:
    """What reading one request's answer needs besides its body: `streamed`, or read whole."""

    path: str
    sampling: SamplingParams
    prompt_len: int
    experts_start: int
    streamed: bool
    headers: dict[str, str] | None = None  # the data-parallel rank it is pinned to


def completion_engine_id(request_id: str) -> str:
    """The engine's id of a `/v1/completions` request sent with body `request_id` (prompt index 0)."""
    return f"cmpl-{request_id}-0"


def generate_engine_id(request_id: str) -> str:
    """The engine's id of an `/inference/v1/generate` request."""
    return f"generate-tokens-{request_id}"


class VllmBackend(HttpEngineBackend):
    """One vLLM replica behind the `EngineBackend` protocol; owns one pooled HTTP client (closed by `aclose`).

    `generate` is an async generator: a consumer that stops early must close it (`contextlib.aclosing`), which
    closes the HTTP stream, and vLLM aborts a request whose client went away.
    """

    running_gauge = "vllm:num_requests_running"
    waiting_gauge = "vllm:num_requests_waiting"
    kv_usage_gauge = "vllm:kv_cache_usage_perc"
    cache_queries_counter = "vllm:prefix_cache_queries_total"
    cache_hits_counter = "vllm:prefix_cache_hits_total"
    rank_label = "engine"  # vLLM labels each engine core's samples with its data-parallel rank

    def __init__(self, spec: ReplicaSpec) -> None:
        super().__init__(spec)
        self._generate_endpoint = spec.scale_out
        self._engine_version: str | None = None
        self.capabilities = Capabilities(
            pause_modes=frozenset({"abort", "keep", "wait"}),
            routed_experts_out=spec.routed_experts,
            routed_experts_in=spec.routed_experts_input,
            streams_routed_experts=spec.scale_out,
            version_spans=spec.scale_out,
            token_endpoint=GENERATE if self._generate_endpoint else COMPLETIONS,
            new_requests_while_paused=spec.new_requests_while_paused,
            transfer_backends=frozenset({spec.weight_transfer} if spec.weight_transfer else ()),
        )
        self._transfer = VllmTransfer(self._client, self.id, self._control, self._long)
        self.adapters = EngineAdapters(self._client, self.id, "vllm", self._control, self._long)
        self.scorer = PromptScorer(self._client, self.id, "vllm", spec.model, self._long)

    # -- generation ----------------------------------------------------------------------------------------

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
        """The new tokens of one request (`EngineBackend.generate`; see the module docstring for the transport),
        streamed where asked and possible, else one whole answer. The body is encoded here, before the first iteration
        sends it. `dp_rank` goes as the `X-data-parallel-rank` header, which both transports read."""
        path, body = self._body(token_ids, sampling, request_id, routed_experts, experts_start)
        if cache_salt is not None:
            body["cache_salt"] = cache_salt  # both transports take it (at most 128 characters)
        if adapter is not None:
            body["model"] = adapter  # a loaded adapter's name (`backends.lora`)
        streamed = self.capabilities.streams(stream)  # routed experts come only in whole answers of /v1/completions
        if streamed:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        headers = None if dp_rank is None else {DP_RANK_HEADER: str(dp_rank)}
        answer = _Answer(path, sampling, len(token_ids), experts_start, streamed, headers)
        return self._chunks(answer, orjson.dumps(body), deadline)

    def _body(
        self,
        token_ids: Sequence[int],
        sampling: SamplingParams,
        request_id: str,
        routed_experts: ExpertArray | None,
        experts_start: int,
    ) -> tuple[str, dict[str, Any]]:
        """The path and (not yet encoded) body of one generation request on this replica's transport."""
        replay = (
            encode_npy_b64(routed_experts) if routed_experts is not None and self.spec.routed_experts_input else None
        )
        if self._generate_endpoint:
            return GENERATE, self._generate_body(token_ids, sampling, request_id, experts_start, replay)
        return COMPLETIONS, self._completion_body(token_ids, sampling, request_id, experts_start, replay)

    def _sampling_fields(self, sampling: SamplingParams) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "stop_token_ids": list(sampling.stop_token_ids),
            "ignore_eos": sampling.ignore_eos,
            "min_tokens": sampling.min_tokens,
            # 0 still returns the sampled token's logprob, which RL always needs.
            "logprobs": sampling.top_logprobs,
        }
        if sampling.top_k is not None:
            fields["top_k"] = sampling.top_k
        if sampling.seed is not None:
            fields["seed"] = sampling.seed
        add_optional_sampling(fields, sampling)
        return fields

    def _completion_body(
        self,
        token_ids: Sequence[int],
        sampling: SamplingParams,
        request_id: str,
        experts_start: int,
        replay: str | None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.spec.model,
            "prompt": encodable_ids(token_ids),
            **self._sampling_fields(sampling),
            "return_token_ids": True,
            # Top logprobs are otherwise keyed by decoded text, and tokens that decode alike collapse.
            "return_tokens_as_token_ids": True,
            "return_weight_versions": True,
            "request_id": request_id,  # the engine id becomes cmpl-<id>-0, which /abort_requests can name
        }
        if self.spec.routed_experts:
            body["routed_experts_prompt_start"] = experts_start
        if replay is not None:
            body["replay_routed_experts"] = replay  # a simulator extension; real vLLM ignores unknown fields
        return body

    def _generate_body(
        self,
        token_ids: Sequence[int],
        sampling: SamplingParams,
        request_id: str,
        experts_start: int,
        replay: str | None,
    ) -> dict[str, Any]:
        params = self._sampling_fields(sampling)
        if self.spec.routed_experts and experts_start:
            # A SamplingParams field in 0.33; an engine that ignores it returns every position and
            # `_experts` slices locally.
            params["routed_experts_prompt_start"] = experts_start
        body: dict[str, Any] = {
            "model": self.spec.model,
            "token_ids": encodable_ids(token_ids),
            "sampling_params": params,
            "request_id": request_id,
        }
        if replay is not None:
            body["replay_routed_experts"] = replay
        return body

    async def _chunks(self, answer: _Answer, body: bytes, deadline: float | None) -> AsyncGenerator[Chunk, None]:
        """The answer's chunks, streamed or whole alike: a whole answer is a batch of one finished event."""
        # The finishing chunk is held back until the answer ends: a stream's usage event (cached tokens) follows it.
        final: Chunk | None = None
        cached: int | None = None
        produced = 0
        path, sampling, experts_start = answer.path, answer.sampling, answer.experts_start
        # An unfinished choice of a `/v1/completions` event without top logprobs carries token ids and their
        # logprobs, nothing else: those go straight into the read's delta (what `_chunk` and `merge_deltas` would
        # make of them, without a chunk per event). Any other choice takes `_chunk`.
        lean = path == COMPLETIONS and sampling.top_logprobs == 0
        batches = answer_batches(
            self._client,
            self.id,
            path,
            body,
            stream=answer.streamed,
            deadline=deadline,
            first_event=without_prompt_echo,
            headers=answer.headers,
        )
        del body  # the transport holds it until it is sent, and no longer (see `answer_batches`)
        async with contextlib.aclosing(batches):
            async for events in batches:
                deltas: list[Chunk] = []
                token_ids: list[int] = []
                logprobs: list[float] = []
                with translate_errors(self.id):
                    for event in events:
                        if not isinstance(event, dict):
                            raise TypeError(f"stream event is not an object: {event!r}")
                        usage = event.get("usage")
                        if usage:
                            cached = _cached_tokens(usage)
                        for choice in event.get("choices") or ():  # the usage event has none
                            if lean and type(choice) is dict and choice.get("finish_reason") is None:
                                ids = _token_ids(choice)
                                values, _ = _completion_logprobs(choice.get("logprobs"), want_top=False)
                                if len(values) != len(ids):
                                    raise self._misaligned(len(ids), len(values))
                                token_ids += ids
                                logprobs += values
                                produced += len(ids)
                                continue
                            chunk = self._chunk(choice, path, sampling, answer.prompt_len + produced, experts_start)
                            produced += len(chunk.token_ids)
                            if chunk.finish_reason is not None:
                                final = chunk
                            elif chunk.token_ids:
                                deltas.append(chunk)
                if token_ids:  # a lean read has no other deltas (`lean` holds for the whole stream)
                    yield Chunk(token_ids=token_ids, logprobs=logprobs)
                elif deltas:
                    yield merge_deltas(deltas)  # a single event passes through as it is
        if final is None:
            raise unfinished_answer(self.id, answer.streamed)
        final.cached_tokens = cached
        yield final

    def _chunk(
        self, choice: dict[str, Any], path: str, sampling: SamplingParams, before: int, experts_start: int
    ) -> Chunk:
        """One choice of an event (or of a whole answer) as a `Chunk`; `before` = prompt + tokens already seen."""
        if not isinstance(choice, dict):
            raise TypeError(f"choice is not an object: {choice!r}")
        token_ids = _token_ids(choice)
        want_top = sampling.top_logprobs > 0
        if path == GENERATE:
            logprobs, top = _generate_logprobs(choice.get("logprobs"), token_ids, want_top)
        else:
            logprobs, top = _completion_logprobs(choice.get("logprobs"), want_top)
        if len(logprobs) != len(token_ids):
            raise self._misaligned(len(token_ids), len(logprobs))
        chunk = Chunk(token_ids=token_ids, logprobs=logprobs)
        if sampling.top_logprobs > 0:
            if len(top) != len(token_ids):
                raise BackendProtocolError(
                    f"replica {self.id}: {len(token_ids)} token ids but {len(top)} top logprobs", replica=self.id
                )
            chunk.top_logprobs = top
        reason = choice.get("finish_reason")
        if reason is None:
            return chunk
        chunk.finish_reason = self._finish_reason(str(reason), choice)
        stop_reason = choice.get("stop_reason")
        chunk.stop_reason = stop_reason if isinstance(stop_reason, int | str) else None
        spans = [
            VersionSpan(str(s["version"]), int(s["start"]), int(s["end"])) for s in choice.get("weight_versions") or ()
        ]
        if spans:
            chunk.version_spans = spans
            chunk.weight_version = spans[-1].version
            if not self.capabilities.version_spans:
                self.capabilities = dataclasses.replace(self.capabilities, version_spans=True)
        if self.spec.routed_experts and choice.get("routed_experts") is not None:
            total = before + len(token_ids) - 1  # every position but the last sampled token went through the model
            chunk.routed_experts = _experts(str(choice["routed_experts"]), total, experts_start)
        return chunk

    def _misaligned(self, token_ids: int, logprobs: int) -> BackendProtocolError:
        return BackendProtocolError(
            f"replica {self.id}: {token_ids} token ids but {logprobs} logprobs", replica=self.id
        )

    def _finish_reason(self, reason: str, choice: dict[str, Any]) -> FinishReason:
        if reason == "error":
            raise BackendError(
                f"replica {self.id}: the request failed in the engine (stop_reason={choice.get('stop_reason')!r})",
                replica=self.id,
                code="finish_reason_error",
            )
        mapped = _FINISH_REASONS.get(reason)
        if mapped is None:
            logger.warning("replica %s: unknown finish_reason %r, treated as stop", self.id, reason)
            return "stop"
        return mapped

    # -- control -------------------------------------------------------------------------------------------

    async def abort(self, request_id: str) -> None:
        """Abort one request. Both engine ids are named: vLLM ignores ids it does not know, and the caller
        need not know which transport the request took."""
        ids = [completion_engine_id(request_id), generate_engine_id(request_id)]
        # The answer says nothing useful: vLLM reports len(request_ids) as aborted, matched or not.
        await request(
            self._client, self.id, "POST", "/abort_requests", json={"request_ids": ids}, timeout=self._control
        )

    async def pause(self, mode: PauseMode) -> None:
        """`POST /pause?mode=`; returns once the engine is paused (for `wait`, after in-flight requests drained,
        hence the long read timeout). `keep` becomes `abort` where the engine cannot say which tokens the new
        weights produced (see the module docstring): the gateway then resumes those requests itself."""
        if mode == "keep" and not await self._reports_version_spans():
            logger.warning(
                "replica %s (vLLM %s) reports no per-token weight versions on %s: pausing with abort, not keep",
                self.id,
                self._engine_version,
                COMPLETIONS,
            )
            mode = "abort"
        timeout = self._long if mode == "wait" else self._control
        self._client.pacer.suspend()  # the aborted requests' answers come in at once
        # `clear_cache` defaults to true, and vLLM 0.32 honours it in keep mode too (its docs say it is ignored
        # there): once the engine is idle it resets the prefix cache with `reset_running_requests`, preempting every
        # kept request. A keep pause keeps them; a flush, where one is wanted, comes with the load.
        params: dict[str, str] = {"mode": mode, "clear_cache": "false"} if mode == "keep" else {"mode": mode}
        answer = await self._call("POST", "/pause", params=params, timeout=timeout)
        self._expect_status(answer, "paused")

    async def _reports_version_spans(self) -> bool:
        """Whether finished requests carry `weight_versions`: with scale-out, on vLLM >= 0.33, or once seen."""
        if self.capabilities.version_spans:
            return True
        if self._engine_version is None:
            try:
                answer = await self._call("GET", "/version")
                self._engine_version = str(answer["version"])
            except (BackendError, KeyError, TypeError) as exc:
                logger.warning("replica %s: GET /version failed (%s); assuming no version spans", self.id, exc)
                return False
        if version_tuple(self._engine_version) >= (0, 33):
            self.capabilities = dataclasses.replace(self.capabilities, version_spans=True)
        return self.capabilities.version_spans

    async def resume(self) -> None:
        answer = await self._call("POST", "/resume")
        self._expect_status(answer, "resumed")
        self._client.pacer.restore()

    async def update_weights(self, version: str, source: str | None, *, flush: bool = True) -> bool:
        """Reload weights from `source` (if given), relabel them `version`, then, with `flush`, flush the prefix
        cache (vLLM keeps KV computed under the old weights otherwise). Returns whether the flush succeeded (True
        without one)."""
        if source is not None:
            rpc = {"method": "reload_weights", "kwargs": {"weights_path": source}}
            # An error answer is vLLM saying the reload failed (`WeightsNotLoaded`): a checkpoint it cannot read
            # fails before any weight is touched. The answer's body (`{"results": [...]}`) says nothing more.
            reply = await request(
                self._client, self.id, "POST", "/collective_rpc", json=rpc, timeout=self._long, check=False
            )
            raise_for_load_status(self.id, reply.status, reply.content, f"reload_weights from {source!r}")
        answer = await self._call("POST", "/update_weight_version", json={"new_version": version})
        if isinstance(answer, dict) and answer.get("success") is False:
            raise BackendError(
                f"replica {self.id}: update_weight_version to {version!r} failed: {answer}",
                replica=self.id,
                code="update_weight_version",
            )
        return await self.flush_cache() if flush else True

    async def weight_version(self) -> str:
        answer = await self._call("GET", "/weight_info")
        with translate_errors(self.id):
            return str(answer["weight_version"])

    # -- in-memory weight transfer (backends.weight_transfer) ------------------------------------------------

    async def transfer_workers(self) -> int:
        return await self._transfer.workers()

    def lost_contact(self) -> None:
        self._transfer.forget()

    def forms_transfer_group(self, group: TransferGroup | None) -> bool:
        return self._transfer.forms(group)

    async def open_transfer(self, backend: TransferBackend, group: TransferGroup | None) -> bool:
        return await self._transfer.open(group)

    async def receive_transfer_chunk(self, chunk: Sequence[TensorMeta]) -> None:
        await self._transfer.receive(chunk)

    async def finish_transfer(self, version: str, *, flush: bool = True) -> bool:
        await self._transfer.finish(version)
        return await self.flush_cache() if flush else True

    async def abort_transfer(self) -> None:
        await self._transfer.abort()

    async def flush_cache(self) -> bool:
        """`POST /reset_prefix_cache?reset_running_requests=true`: running (or keep-paused) requests are preempted
        and recompute their KV under the weights loaded when they next run, so the reset succeeds at once.
        Without that, vLLM refuses while they hold blocks, and requests queued at the paused engine would be
        admitted on resume onto prefix KV of the old weights. False if the engine still refuses (older servers
        ignore the parameter); an empty 200 (older servers) counts as success."""
        answer = await self._call("POST", "/reset_prefix_cache", params={"reset_running_requests": "true"})
        if isinstance(answer, dict):
            return answer.get("success") is not False
        return True

    async def _call(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: dict[str, str] | None = None,
        timeout: aiohttp.ClientTimeout | None = None,
    ) -> Any:
        return await request_json(
            self._client, self.id, method, path, json=json, params=params, timeout=timeout or self._control
        )

    def _expect_status(self, answer: Any, status: str) -> None:
        if isinstance(answer, dict) and answer.get("status") not in (None, status):
            raise BackendProtocolError(f"replica {self.id}: expected status {status!r}, got {answer}", replica=self.id)


def _cached_tokens(usage: Any) -> int | None:
    """`usage.prompt_tokens_details.cached_tokens`; vLLM sends null details without --enable-prompt-tokens-details."""
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict) or details.get("cached_tokens") is None:
        return None
    return int(details["cached_tokens"])


def _token_id(key: str) -> int:
    """`"token_id:1331"` → 1331 (the request asks for `return_tokens_as_token_ids`)."""
    prefix, _, number = key.partition(":")
    if prefix != "token_id":
        raise ValueError(f"top logprob key {key!r} is not 'token_id:N' (return_tokens_as_token_ids ignored?)")
    return int(number)


def _token_ids(choice: dict[str, Any]) -> list[int]:
    return [int(t) for t in choice.get("token_ids") or ()]


def _completion_logprobs(logprobs: Any, want_top: bool = True) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """`CompletionLogProbs {token_logprobs, top_logprobs: [{"token_id:N": lp}]}` → (logprobs, top, best first);
    the top lists are parsed only when wanted (with `logprobs: 0` vLLM still sends the sampled token's)."""
    if logprobs is None:
        return [], []
    values = [float(v) for v in logprobs["token_logprobs"]]
    if not want_top:
        return values, []
    top = [
        sorted(((_token_id(k), float(v)) for k, v in dict(entry or {}).items()), key=lambda kv: -kv[1])
        for entry in logprobs.get("top_logprobs") or ()
    ]
    return values, top


def _generate_logprobs(
    logprobs: Any, token_ids: list[int], want_top: bool = True
) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """`{content: [{token_id, logprob, top_logprobs: [{token_id, logprob}]}]}` → (logprobs, top); the top lists
    only when wanted."""
    if logprobs is None:
        return [], []
    content = logprobs["content"]
    if [int(entry["token_id"]) for entry in content] != token_ids:
        raise ValueError("logprobs.content token ids differ from the chunk's token_ids")
    values = [float(entry["logprob"]) for entry in content]
    if not want_top:
        return values, []
    top = [
        [(int(alt["token_id"]), float(alt["logprob"])) for alt in entry.get("top_logprobs") or ()] for entry in content
    ]
    return values, top


def _experts(payload: str, total: int, start: int) -> ExpertArray:
    """Decode the `.npy` payload into positions [start, total). An engine that ignored the start field (the
    generate endpoint of some versions) returns positions from 0: those are sliced off here."""
    experts = decode_npy_b64(payload)
    if start and len(experts) == total and total > start:
        experts = experts[start:]
    return experts
