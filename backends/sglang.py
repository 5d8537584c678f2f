"""The SGLang adapter: one replica of an SGLang 0.5.23 server, driven through its native routes.

Behaviour follows ../shared/contracts (SGLang 0.5.23 from source and observed on CPU). Generation is a streaming
`POST /generate` with token ids; SGLang 0.5.23 rejects unknown fields with a 400, so the body carries only the
fields the server declares, and optional ones only when they are used. Stream chunks are cumulative by default
and deltas when the server runs with `--incremental-streaming-output`; both become delta `Chunk`s. Routed experts
(R3) arrive on the final chunk as shapeless raw int32, reshaped with the configured (layers, top_k). A caller that
needs the tokens only at the end (`generate(stream=False)`) gets one non-streaming answer with the same fields (an
abort answers 200 with the partial output, as a stream's last chunk does).

Control maps onto the native routes: `/abort_request`, `/pause_generation` (the gateway's `keep` is the spec's
`keep_mode`: retract or in_place; SGLang has no drain-then-pause, the gateway emulates `wait`),
`/continue_generation`, `/update_weights_from_disk` or `/update_weight_version`, `/flush_cache`, and `/model_info`
for the version (`/get_weight_version` is 404 in 0.5.23).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, Sequence
from typing import Any

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
)
from backends.errors import BackendError, BackendProtocolError, BackendRejected, WeightsNotLoaded
from backends.http_client import HttpEngineBackend, answer_batches, request, request_json
from backends.lora import EngineAdapters
from backends.routed_experts import ExpertArray, decode_int32_b64, encode_int32_b64
from backends.scoring import PromptScorer
from backends.weight_transfer import SglangTransfer

__all__ = ["SglangBackend"]

logger = logging.getLogger(__name__)

GENERATE = "/generate"
UPDATE_FROM_DISK = "/update_weights_from_disk"

# The 400 that /update_weights_from_disk answers after pause(in_place): the weights and the version DID switch,
# only the radix cache kept KV of the old weights (observed on 0.5.23).
_CACHE_NOT_FLUSHED = "cache was not flushed"


class SglangBackend(HttpEngineBackend):
    """One SGLang replica behind the `EngineBackend` protocol; owns one pooled HTTP client (closed by `aclose`).

    `generate` is an async generator: a consumer that stops early must close it (`contextlib.aclosing`), which
    closes the HTTP stream, and SGLang aborts a request whose client went away. `cumulative_streams`: a stream of
    this replica repeated the whole output in every event (the server runs without `--incremental-streaming-output`;
    logged once).
    """

    running_gauge = "sglang:num_running_reqs"
    waiting_gauge = "sglang:num_queue_reqs"
    kv_usage_gauge = "sglang:token_usage"
    cache_queries_counter = "sglang:prompt_tokens_total"
    cache_hits_counter = "sglang:cached_tokens_total"
    rank_label = "dp_rank"  # SGLang labels each scheduler's samples with its rank where it runs several

    def __init__(self, spec: ReplicaSpec) -> None:
        if spec.routed_experts and spec.routed_experts_shape is None:
            raise ValueError(
                f"replica {spec.id}: SGLang sends routed experts without a shape; set routed_experts_shape "
                "= (num_hidden_layers, num_experts_per_tok)"
            )
        super().__init__(spec)
        self.capabilities = Capabilities(
            pause_modes=frozenset({"abort", "keep"}),
            routed_experts_out=spec.routed_experts,
            routed_experts_in=spec.routed_experts_input,
            streams_routed_experts=True,
            version_spans=True,
            token_endpoint=GENERATE,
            # SGLang always holds new requests while paused (tokenizer manager `is_pause_cond`).
            new_requests_while_paused="block",
            transfer_backends=frozenset({"nccl", "tensor"}),
        )
        self._transfer = SglangTransfer(self._client, self.id, self._control, self._long, spec.data_parallel_size)
        self.adapters = EngineAdapters(self._client, self.id, "sglang", self._control, self._long)
        self.scorer = PromptScorer(self._client, self.id, "sglang", spec.model, self._long)
        self._experts_shape = spec.routed_experts_shape if spec.routed_experts else None
        self.cumulative_streams = False

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
        """The new tokens of one request (`EngineBackend.generate`), streamed, or with `stream=False` one answer at
        the end; the last chunk carries the finish reason, version spans and (with R3) the routed experts of
        positions [experts_start, prompt + output - 1). The body is encoded here, before the first iteration sends
        it. `cache_salt` goes as `extra_key`, which the radix cache keys prefixes by; `dp_rank` as `routed_dp_rank`
        (`data_parallel_rank` is its deprecated alias)."""
        body = self._body(token_ids, sampling, request_id, routed_experts, experts_start, stream)
        if cache_salt is not None:
            body["extra_key"] = cache_salt
        if dp_rank is not None:
            body["routed_dp_rank"] = dp_rank
        if adapter is not None:
            body["lora_path"] = adapter  # a loaded adapter's name (`backends.lora`)
        return self._chunks(orjson.dumps(body), sampling, len(token_ids), experts_start, stream, deadline)

    async def _chunks(
        self,
        body: bytes,
        sampling: SamplingParams,
        prompt_len: int,
        experts_start: int,
        streamed: bool,
        deadline: float | None,
    ) -> AsyncGenerator[Chunk, None]:
        """The answer's chunks, streamed or whole alike: a whole answer is a batch of one finished event (an abort
        answers 200 with the partial output, as a stream's last event does)."""
        seen = 0
        finished = False
        # Whether each event repeats the whole output so far (then only each read's last one is decoded): known from
        # the first event that follows tokens and brings more (a server sends one kind or the other).
        cumulative: bool | None = None

        def latest_only() -> bool:
            return cumulative is True

        batches = answer_batches(
            self._client, self.id, GENERATE, body, stream=streamed, deadline=deadline, latest_only=latest_only
        )
        del body  # the transport holds it until it is sent, and no longer (see `answer_batches`)
        async with contextlib.aclosing(batches):
            async for events in batches:
                deltas: list[Chunk] = []
                final: Chunk | None = None
                for event in events:
                    if finished:
                        break  # read on to [DONE] so the connection goes back to the pool
                    with translate_errors(self.id):
                        before = seen
                        chunk, seen = self._chunk(event, sampling, prompt_len, experts_start, seen)
                        if cumulative is None and 0 < before < seen:
                            cumulative = _repeats_output(event, seen, sampling)
                            if cumulative:
                                self._note_cumulative_stream()
                    finished = chunk.finish_reason is not None
                    if finished:
                        final = chunk
                    elif chunk.token_ids:
                        deltas.append(chunk)
                if deltas:
                    yield merge_deltas(deltas)
                if final is not None:
                    yield final
        if not finished:
            raise unfinished_answer(self.id, streamed)

    def _note_cumulative_stream(self) -> None:
        if self.cumulative_streams:
            return
        self.cumulative_streams = True
        logger.warning(
            "replica %s streams cumulative events (SGLang's default): every event repeats the whole output so far, so "
            "the gateway's CPU per token grows with the output (a delta's stays the same whatever the length; "
            "docs/benchmarks.md); it decodes only the last event of each read, which helps while many "
            "streams are open. Start the server with --incremental-streaming-output",
            self.id,
            extra={"replica": self.id},
        )

    def _body(
        self,
        token_ids: Sequence[int],
        sampling: SamplingParams,
        request_id: str,
        routed_experts: ExpertArray | None,
        experts_start: int,
        stream: bool,
    ) -> dict[str, Any]:
        params: dict[str, Any] = {
            "max_new_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "ignore_eos": sampling.ignore_eos,
        }
        if sampling.top_k is not None:
            params["top_k"] = sampling.top_k
        if sampling.seed is not None:
            params["sampling_seed"] = sampling.seed
        if sampling.stop_token_ids:
            params["stop_token_ids"] = list(sampling.stop_token_ids)
        if sampling.min_tokens > 0:
            params["min_new_tokens"] = sampling.min_tokens
        add_optional_sampling(params, sampling)  # only when set: SGLang refuses a null
        body: dict[str, Any] = {
            "rid": request_id,  # the id /abort_request names
            "input_ids": encodable_ids(token_ids),
            "sampling_params": params,
            "stream": stream,
            "return_logprob": True,  # output tokens only (logprob_start_len defaults to -1)
        }
        if sampling.top_logprobs > 0:
            body["top_logprobs_num"] = sampling.top_logprobs
        if self.spec.routed_experts:
            body["return_routed_experts"] = True
            body["routed_experts_start_len"] = experts_start
        if routed_experts is not None and self.spec.routed_experts_input:
            body["replay_routed_experts"] = encode_int32_b64(routed_experts)
        return body

    def _chunk(
        self, event: dict[str, Any], sampling: SamplingParams, prompt_len: int, experts_start: int, seen: int
    ) -> tuple[Chunk, int]:
        """One stream event as a delta `Chunk`, and the number of output tokens seen after it.

        An event is cumulative when its lists cover all `completion_tokens` so far, else a delta of the tokens
        after `seen` (the first event of a request reads the same either way). Logprobs are aligned on their own:
        a server may stream delta ids with cumulative logprobs."""
        meta = event["meta_info"]
        total = int(meta["completion_tokens"])
        token_ids = [int(t) for t in _tail(event["output_ids"], total, seen, "output_ids")]
        entries = meta.get("output_token_logprobs")
        if entries is None and token_ids:
            raise ValueError("return_logprob was asked but the chunk has no output_token_logprobs")
        entries = _tail(entries or [], total, seen, "output_token_logprobs") if token_ids else []
        if [int(entry[1]) for entry in entries] != token_ids:
            raise ValueError("output_token_logprobs token ids differ from the chunk's output_ids")
        chunk = Chunk(token_ids=token_ids, logprobs=[float(entry[0]) for entry in entries])
        if sampling.top_logprobs > 0:
            top = _tail(meta["output_top_logprobs"], total, seen, "output_top_logprobs") if token_ids else []
            chunk.top_logprobs = [[(int(alt[1]), float(alt[0])) for alt in position or ()] for position in top]
        if meta.get("weight_version") is not None:
            chunk.weight_version = str(meta["weight_version"])
        reason = meta.get("finish_reason")
        if reason is not None:
            self._finish(chunk, reason, meta, prompt_len, prompt_len + total, experts_start)
        return chunk, total

    def _finish(
        self, chunk: Chunk, reason: Any, meta: dict[str, Any], prompt_len: int, seq_len: int, experts_start: int
    ) -> None:
        """Fill the end-of-request fields of the final chunk (`seq_len` = prompt + all output tokens)."""
        chunk.finish_reason, chunk.stop_reason = self._finish_reason(reason)
        spans = [
            VersionSpan(str(s["version"]), int(s["start"]), int(s["end"])) for s in meta.get("weight_versions") or ()
        ]
        if spans:
            chunk.version_spans = spans
        if meta.get("cached_tokens") is not None:
            chunk.cached_tokens = int(meta["cached_tokens"])
        payload, shape = meta.get("routed_experts"), self._experts_shape
        if shape is not None and payload is not None:
            chunk.routed_experts = self._experts(str(payload), shape, seq_len - 1 - experts_start, seq_len > prompt_len)

    def _finish_reason(self, reason: Any) -> tuple[FinishReason, int | str | None]:
        """SGLang's `finish_reason` object → (finish reason, stop reason)."""
        details: dict[str, Any] = reason if isinstance(reason, dict) else {"type": str(reason)}
        kind = details.get("type")
        if kind == "stop":
            matched = details.get("matched")
            return "stop", matched if isinstance(matched, int | str) else None
        if kind == "length":
            return "length", None
        if kind == "abort":
            status = details.get("status_code")
            # An abort the server still streamed: resumable, unless it says the request itself is bad (e.g.
            # too long for the context), which no other replica will accept either.
            if isinstance(status, int) and 400 <= status < 500 and status not in (408, 429):
                raise BackendRejected(
                    f"replica {self.id} aborted the request ({status}): {details.get('message')}",
                    replica=self.id,
                    code=str(status),
                )
            return "abort", None
        logger.warning("replica %s: unknown finish_reason %r, treated as stop", self.id, reason)
        return "stop", None

    def _experts(self, payload: str, shape: tuple[int, int], expected: int, check: bool) -> ExpertArray:
        """Decode the raw int32 payload with the configured (layers, top_k). It must cover `expected` = prompt +
        output - 1 - start positions: a wrong shape that still divides the payload shows up here rather than as
        corrupt training data. `check` is off for a request without output (aborted right after prefill), where
        engines disagree on whether the last prompt position counts."""
        layers, top_k = shape
        experts = decode_int32_b64(payload, layers, top_k)
        if check and len(experts) != expected:
            raise BackendProtocolError(
                f"replica {self.id}: routed experts cover {len(experts)} positions, expected {expected} "
                f"(prompt + output - 1 - start) with (layers, top_k) = ({layers}, {top_k})",
                replica=self.id,
            )
        return experts

    # -- control -------------------------------------------------------------------------------------------

    async def abort(self, request_id: str) -> None:
        """`POST /abort_request {rid}`: the request's stream then ends with `abort` and its partial output."""
        await self._call("POST", "/abort_request", json={"rid": request_id})

    async def pause(self, mode: PauseMode) -> None:
        """`abort` ends in-flight requests with their partial output; `keep` freezes them (retract or in_place,
        from the spec). `wait` is not an SGLang mode: the gateway drains itself, then pauses with `keep`."""
        if mode == "wait":
            raise ValueError(f"replica {self.id}: SGLang has no drain-then-pause mode 'wait' (not a capability)")
        sglang_mode = "abort" if mode == "abort" else self.spec.keep_mode
        self._client.pacer.suspend()  # the aborted requests' answers come in at once
        answer = await self._call("POST", "/pause_generation", json={"mode": sglang_mode})
        self._expect_ok(answer)

    async def resume(self) -> None:
        answer = await self._call("POST", "/continue_generation", json={})
        self._expect_ok(answer)
        self._client.pacer.restore()

    async def update_weights(self, version: str, source: str | None, *, flush: bool = True) -> bool:
        """From `source`: `/update_weights_from_disk` with the version label and, with `flush`, a cache flush. It
        returns False (without raising) when SGLang switched weights and version but could not flush the radix cache
        because in_place-paused requests hold KV. Without a source only the label changes (`/update_weight_version`,
        in-flight requests kept), then, with `flush`, the cache is flushed if the engine allows it. A load SGLang
        answers as failed raises `WeightsNotLoaded`: it rolled back to the weights it had."""
        if source is None:
            body = {"new_version": version, "abort_all_requests": False}
            answer = await self._call("POST", "/update_weight_version", json=body)
            self._expect_success(answer, f"update_weight_version to {version!r}")
            return await self.flush_cache() if flush else True
        body = {"model_path": source, "weight_version": version, "flush_cache": flush}
        return await self._update_from_disk(body)

    async def _update_from_disk(self, body: dict[str, Any]) -> bool:
        # Not `request_json`: one 400 here is a success whose body must be read, and that helper raises on it.
        # The long timeout: an unpaused server takes its writer lock, waiting for in-flight requests.
        response = await request(
            self._client, self.id, "POST", UPDATE_FROM_DISK, json=body, timeout=self._long, check=False
        )
        with translate_errors(self.id):
            if response.status == 400 and _cache_not_flushed(response.content):
                logger.warning(
                    "replica %s: weights %s (version %s) loaded, prefix cache not flushed (requests hold KV)",
                    self.id,
                    body["model_path"],
                    body["weight_version"],
                )
                await self._relabel(str(body["weight_version"]))
                return False
            # Any other error answer: the load failed and SGLang rolled back to the weights (and label) it had.
            what = f"update_weights_from_disk {body['model_path']!r}"
            raise_for_load_status(self.id, response.status, response.content, what)
            answer = orjson.loads(response.content) if response.content.strip() else None
        if isinstance(answer, dict) and answer.get("success") is False:
            raise WeightsNotLoaded(f"replica {self.id}: {what} failed: {answer.get('message')}", replica=self.id)
        return True

    async def _relabel(self, version: str) -> None:
        """After that 400 the scheduler runs `version` but the tokenizer manager, which `/model_info` reads,
        still holds the old label (it updates it only on success; observed on 0.5.23): set it explicitly."""
        answer = await self._call(
            "POST", "/update_weight_version", json={"new_version": version, "abort_all_requests": False}
        )
        self._expect_success(answer, f"update_weight_version to {version!r}")

    async def weight_version(self) -> str:
        """The label of the loaded weights, from `GET /model_info`."""
        answer = await self._call("GET", "/model_info")
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
        return await self._transfer.open(backend, group)

    async def receive_transfer_chunk(self, chunk: Sequence[TensorMeta]) -> None:
        await self._transfer.receive(chunk)

    async def finish_transfer(self, version: str, *, flush: bool = True) -> bool:
        await self._transfer.finish(version)
        return await self.flush_cache() if flush else True

    async def abort_transfer(self) -> None:
        await self._transfer.abort()

    async def flush_cache(self) -> bool:
        """`POST /flush_cache`: False (400) while requests are running or waiting."""
        try:
            await request(self._client, self.id, "POST", "/flush_cache", timeout=self._control)
        except BackendRejected as exc:
            if exc.code == "400":
                return False
            raise
        return True

    async def _call(self, method: str, path: str, *, json: Any = None) -> Any:
        return await request_json(self._client, self.id, method, path, json=json, timeout=self._control)

    def _expect_ok(self, answer: Any) -> None:
        if isinstance(answer, dict) and answer.get("status") not in (None, "ok"):
            raise BackendProtocolError(f"replica {self.id}: expected status 'ok', got {answer}", replica=self.id)

    def _expect_success(self, answer: Any, what: str) -> None:
        if isinstance(answer, dict) and answer.get("success") is False:
            raise BackendError(f"replica {self.id}: {what} failed: {answer.get('message')}", replica=self.id)


def _repeats_output(event: dict[str, Any], total: int, sampling: SamplingParams) -> bool:
    """Whether every list of `event` that the adapter reads covers all `total` output tokens (a cumulative event)."""
    meta = event["meta_info"]
    lists = [event["output_ids"], meta.get("output_token_logprobs") or ()]
    if sampling.top_logprobs > 0:
        lists.append(meta.get("output_top_logprobs") or ())
    return all(len(values) == total for values in lists)


def _tail(values: Sequence[Any], total: int, seen: int, name: str) -> Sequence[Any]:
    """The entries after the first `seen` of a list that is either cumulative (`total` long) or a delta."""
    if len(values) == total:
        return values[seen:]
    if len(values) == total - seen:
        return values
    raise ValueError(f"{name} has {len(values)} entries: neither all {total} tokens nor the {total - seen} new ones")


def _cache_not_flushed(content: bytes) -> bool:
    try:
        answer = orjson.loads(content)
    except orjson.JSONDecodeError:
        return False
    return isinstance(answer, dict) and _CACHE_NOT_FLUSHED in str(answer.get("message", ""))
