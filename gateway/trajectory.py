"""Sessions, samples and trajectories: the data the trainer trains on, and its compact binary encoding.

A *sample* is one token sequence: `prompt_ids`, then the response as alternating spans — model spans (sampled
tokens: `loss_mask` 1, with logprobs, the weight version that sampled each token, routed experts) and
environment spans (tool results, user turns, template tokens: `loss_mask` 0, logprob 0, version -1). A
multi-turn episode whose messages extend the previous turn is ONE sample; a rewritten history starts another, and
`rewritten_from` names the sample whose conversation it renders again (a chat template that is not prefix-stable,
such as Qwen3's, which drops earlier turns' reasoning, makes one sample per turn, each with its exact ids). A new
sample branches from the earlier one it shares leading ids with (`parent`, `branch_point`): its hash holds its
prompt from the branch point on, the shared ids stay in the parent's (`gateway.sample_tree.joined` joins them).

Arrays travel as little-endian numpy bytes, never JSON lists: ids and versions int32, mask uint8, logprobs
float32, routed experts in the smallest unsigned dtype with their shape beside them. Routed experts cover
every position that went through the model: `len(prompt_ids) + len(response_ids) - 1` rows.

A sample grows turn after turn and is written at every turn's end, so its arrays are stored in chunks: a write
that extends a sample sends only what it added (`Sample.to_redis_extending`), and an episode costs Redis
O(length) instead of O(turns × length) (routed experts alone are layers × top-k bytes per position). Chunk 0 is
`response_ids`, `loss_mask`, `logprobs`, `versions`, `experts`; chunk k ≥ 1 the same names with `.k`;
`chunk_ends` says where each chunk ends, as `response tokens:experts rows` pairs. The chat conversation is chunked
alike: `conversation` holds a JSON list of messages, `conversation.k` the messages that write k appended (an empty
list, or no field: none), so a turn that extends the conversation sends its new messages only; one that changes an
earlier message sends it whole, as chunk 0, and empties the others. `prompt_ids`, the scalars, the tools and the
chat template's arguments are written whole; an extending write leaves out a conversation, tools and arguments the
hash holds already (a write at a segment boundary, `Sample.conversation_stored`), and the hash keeps them.

Where the model spans came from is written whole at every write (a few bytes per segment): `num_resumes` (the
resumes the sample's model spans needed, all turns together) and `segments`, int32 quadruples `start, end,
version, replica` (response token positions [start, end), the weight version that sampled them, an index into
`segment_replicas`, the replica ids joined by newlines), and `segment_sampling`, what each segment was sampled
with as the engine got it (after the caller's `sampling:` policy): the JSON `[[index per segment], [settings...]]`,
each distinct settings object once (-1: not recorded). A hash written before these fields existed reads as 0
resumes and no segments, and one written before `segment_sampling` as segments without their sampling.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import numpy as np
import numpy.typing as npt
import orjson

from backends.routed_experts import ExpertArray, smallest_unsigned

SessionStatus = Literal["active", "finished", "abandoned"]
ENV_VERSION = -1  # the version of a token the model did not sample
MAX_VERSION = 2**31 - 1  # per-token versions are stored as int32 (below): a weight version must fit

I32 = np.dtype("<i4")
F32 = np.dtype("<f4")
U8 = np.dtype("u1")


class TrajectoryFormatError(ValueError):
    """Stored bytes that do not decode to a consistent sample."""


CHUNKED = ("response_ids", "loss_mask", "logprobs", "versions", "experts", "conversation")
"""The sample's fields stored in chunks (`experts` only when the sample has routed experts; a `conversation` chunk
only where a write appended messages)."""


def chunk_field(name: str, chunk: int) -> str:
    """The hash field of chunk `chunk` of a chunked field."""
    return name if chunk == 0 else f"{name}.{chunk}"


@dataclass(frozen=True, slots=True)
class SampleSegment:
    """Response tokens [start, end) of a sample (positions in `response_ids`): a run of model tokens sampled by one
    engine request on `replica` under weight `version` (docs/architecture.md §3). A generation interrupted by a weight
    update or a replica failure is several segments; an engine request that went on across an update (pause mode
    `keep`) is one segment per version. `sampling`: what its turn's engine request was sampled with
    (`gateway.generation.request.sampling_used`: temperature, top_p, max_tokens..., after the caller's policy);
    None where it was not recorded."""

    start: int
    end: int
    replica: str
    version: int
    sampling: Mapping[str, Any] | None = field(default=None, hash=False)


@dataclass(frozen=True, slots=True)
class StoredChunks:
    """What a sample's hash holds of its chunked arrays: per chunk, the response tokens and the routed experts rows
    it ends at; and the dtype of the experts (None: the sample has none)."""

    ends: tuple[tuple[int, int], ...]
    experts_dtype: str | None
    # The chat conversation the hash holds, all its chunks together (None: none).
    messages: tuple[dict[str, Any], ...] | None = None

    @property
    def response_tokens(self) -> int:
        return self.ends[-1][0]

    @property
    def experts_rows(self) -> int:
        return self.ends[-1][1]

    @property
    def ends_field(self) -> str:
        return ",".join(f"{tokens}:{rows}" for tokens, rows in self.ends)


@dataclass(frozen=True, slots=True)
class SampleSaved:
    """A sample write that reached Redis: the session's revision it made, what the sample's hash holds now (what
    the next write of that sample may extend), and the index it went to (another than asked when another turn
    took that one first: `TrajectoryStore.save_sample`)."""

    revision: int
    stored: StoredChunks
    index: int


@dataclass
class Sample:
    """One trainable token sequence. Response arrays are aligned: one entry per response token."""

    prompt_ids: npt.NDArray[np.int32]
    response_ids: npt.NDArray[np.int32] = field(default_factory=lambda: np.zeros(0, I32))
    loss_mask: npt.NDArray[np.uint8] = field(default_factory=lambda: np.zeros(0, U8))
    logprobs: npt.NDArray[np.float32] = field(default_factory=lambda: np.zeros(0, F32))
    versions: npt.NDArray[np.int32] = field(default_factory=lambda: np.zeros(0, I32))
    routed_experts: ExpertArray | None = None
    num_turns: int = 0
    cancelled: bool = False
    # The chat conversation (OpenAI messages, last assistant reply included) and tools these ids render:
    # what the next turn of the session must extend to continue this sample.
    conversation: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    # The chat template's extra arguments these ids were rendered with (`chat_template_kwargs`; None: none): a later
    # turn continues this sample only with the same ones.
    chat_template_kwargs: dict[str, Any] | None = None
    # The turn that wrote the sample last (None: unknown, or written without one), which lets turns of one session
    # on several processes see each other's writes (`TrajectoryStore.save_sample`). Not training data, and never
    # part of `to_redis`: each write names its own.
    writer: str | None = None
    # The hash this sample extends holds its conversation and tools already (a partial write of a turn in flight:
    # the conversation changes only when the turn ends): an extending write leaves them out. Not part of the data.
    conversation_stored: bool = False
    # How many times its model spans were resumed (weight updates, replica failures), and where each run of them
    # was sampled; defaults for a sample stored before these were recorded.
    num_resumes: int = 0
    segments: list[SampleSegment] = field(default_factory=list)
    # The index of the session's earlier sample whose conversation this sample's prompt renders again, rewritten:
    # the prompt does not extend that sample's ids (the chat template drops or changes earlier turns, as Qwen3's
    # does with their reasoning, or the agent edited its history). None: the sample starts a conversation.
    rewritten_from: int | None = None
    # The session's earlier sample this one branches from (a fork: an edited history, a retried turn, a sub-agent
    # that starts from an earlier point), and how many leading ids the two share (`input_ids[:branch_point]`, all
    # within this sample's prompt). Redis stores the shared ids once, in the parent: this sample's hash holds its
    # prompt from `branch_point` on, and reading the session joins them back (`gateway.sample_tree.joined`).
    # None and 0: a root.
    parent: int | None = None
    branch_point: int = 0
    # This sample retries its parent's last turn (the same request again, prompted with the same ids): the parent's
    # last turn is abandoned, and the parent is delivered `superseded` (set when the session is read, not stored).
    retry: bool = False
    superseded: bool = False
    # Cut for staleness by the gateway's budget (docs/architecture.md §5): its first sampled token is older than the
    # version then served minus `weights.max_staleness`. Its tokens are kept; no later turn extends it.
    stale: bool = False
    # A teacher's scores of the response (on-policy distillation, `gateway.teacher`): each response token's
    # log-probability under the teacher given every id before it, and its `k` best tokens at each position (shape
    # (n, k)). Written once, whole, after the session finished; None where no teacher scored the sample.
    teacher_logprobs: npt.NDArray[np.float32] | None = None
    teacher_top_ids: npt.NDArray[np.int32] | None = None
    teacher_top_logprobs: npt.NDArray[np.float32] | None = None

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        if not (len(self.loss_mask) == len(self.logprobs) == len(self.versions) == n):
            raise TrajectoryFormatError(
                f"response arrays disagree: ids {n}, mask {len(self.loss_mask)}, "
                f"logprobs {len(self.logprobs)}, versions {len(self.versions)}"
            )

    @property
    def input_ids(self) -> npt.NDArray[np.int32]:
        return np.concatenate([self.prompt_ids, self.response_ids])

    @property
    def model_versions(self) -> npt.NDArray[np.int32]:
        """Versions of the sampled tokens only."""
        chosen: npt.NDArray[np.int32] = self.versions[self.loss_mask.astype(bool)]
        return chosen

    @property
    def min_version(self) -> int | None:
        v = self.model_versions
        return int(v.min()) if v.size else None

    @property
    def max_version(self) -> int | None:
        v = self.model_versions
        return int(v.max()) if v.size else None

    def to_redis(self) -> dict[str, bytes | int | str]:
        """The fields of the sample's Redis hash, as one chunk."""
        return self.to_redis_whole()[0]

    def to_redis_whole(self) -> tuple[dict[str, bytes | int | str], StoredChunks]:
        """The fields of the sample's Redis hash, as one chunk, and what the hash holds then."""
        fields = self._scalar_fields()
        fields["prompt_ids"] = self.prompt_ids[self.branch_point :].astype(I32).tobytes()
        experts = None if self.routed_experts is None else smallest_unsigned(self.routed_experts)
        if experts is not None:
            fields["experts_dtype"] = experts.dtype.str
            fields["experts_shape"] = ",".join(str(d) for d in experts.shape)
        fields.update(self._chunk(0, 0, experts))
        rows = 0 if experts is None else len(experts)
        dtype = None if experts is None else experts.dtype.str
        stored = StoredChunks(((len(self.response_ids), rows),), dtype, _messages(self.conversation))
        fields["chunk_ends"] = stored.ends_field
        return fields, stored

    def to_redis_extending(self, stored: StoredChunks) -> tuple[dict[str, bytes | int | str], StoredChunks] | None:
        """The fields of a write over a hash that holds `stored` of this sample, sending what came after it as one
        more chunk (and not `prompt_ids`, which never change), and what the hash holds then. None when the sample
        does not extend `stored`: fewer tokens or rows, experts gained or lost, or new ids their dtype cannot
        hold. The caller vouches that what is stored is this sample's beginning."""
        experts, tokens, rows = self.routed_experts, stored.response_tokens, stored.experts_rows
        if (experts is None) != (stored.experts_dtype is None) or len(self.response_ids) < tokens:
            return None
        new = None
        if experts is not None and stored.experts_dtype is not None:
            if len(experts) < rows:
                return None
            new, dtype = experts[rows:], np.dtype(stored.experts_dtype)
            if new.size and (int(new.min()) < 0 or int(new.max()) > np.iinfo(dtype).max):
                return None
            new = new.astype(dtype, copy=False)
        chunk = len(stored.ends)
        fields = self._scalar_fields(conversation=False)
        messages = stored.messages
        if self.conversation_stored:  # the hash keeps its conversation; a chunk of this index from elsewhere goes
            fields[chunk_field("conversation", chunk)] = b"[]"
        else:
            fields["tools"] = orjson.dumps(self.tools) if self.tools is not None else b"null"
            fields["chat_template_kwargs"] = orjson.dumps(self.chat_template_kwargs)
            fields.update(_conversation_fields(self.conversation, messages, chunk))
            messages = _messages(self.conversation)
        fields.update(self._chunk(chunk, tokens, new))
        if experts is not None:
            fields["experts_shape"] = ",".join(str(d) for d in experts.shape)
        after = StoredChunks(
            (*stored.ends, (len(self.response_ids), len(experts) if experts is not None else 0)),
            stored.experts_dtype,
            messages,
        )
        fields["chunk_ends"] = after.ends_field
        return fields, after

    def _chunk(self, chunk: int, tokens: int, experts: ExpertArray | None) -> dict[str, bytes | int | str]:
        """Chunk `chunk`: the response arrays from token `tokens` on, and `experts` (the rows it holds, typed)."""
        fields: dict[str, bytes | int | str] = {
            chunk_field("response_ids", chunk): self.response_ids[tokens:].astype(I32).tobytes(),
            chunk_field("loss_mask", chunk): self.loss_mask[tokens:].astype(U8).tobytes(),
            chunk_field("logprobs", chunk): self.logprobs[tokens:].astype(F32).tobytes(),
            chunk_field("versions", chunk): self.versions[tokens:].astype(I32).tobytes(),
        }
        if experts is not None:
            fields[chunk_field("experts", chunk)] = experts.tobytes()
        return fields

    def _scalar_fields(self, conversation: bool = True) -> dict[str, bytes | int | str]:
        """The scalars, and (`conversation`) the conversation and tools that are not None."""
        sampled = self.model_versions  # once: min and max of one boolean selection
        table, replicas = _encode_segments(self.segments)
        fields: dict[str, bytes | int | str] = {
            "num_turns": self.num_turns,
            "cancelled": int(self.cancelled),
            "stale": int(self.stale),
            "min_version": int(sampled.min()) if sampled.size else "",
            "max_version": int(sampled.max()) if sampled.size else "",
            "num_resumes": self.num_resumes,
            "rewritten_from": "" if self.rewritten_from is None else self.rewritten_from,
            "parent": "" if self.parent is None else self.parent,
            "branch_point": self.branch_point,
            "retry": int(self.retry),
            "segments": table,
            "segment_replicas": replicas,
            "segment_sampling": _encode_segment_sampling(self.segments),
        }
        if conversation and self.conversation is not None:
            fields["conversation"] = orjson.dumps(self.conversation)
        if conversation and self.tools is not None:
            fields["tools"] = orjson.dumps(self.tools)
        if conversation and self.chat_template_kwargs is not None:
            fields["chat_template_kwargs"] = orjson.dumps(self.chat_template_kwargs)
        return fields

    @classmethod
    def from_redis(cls, raw: Mapping[bytes | str, bytes | str]) -> Sample:
        fields = {_text(k): v for k, v in raw.items()}
        try:
            chunks = len(_text(fields["chunk_ends"]).split(",")) if "chunk_ends" in fields else 1

            def joined(name: str) -> bytes:
                if chunks == 1:
                    return _bytes(fields[name])
                return b"".join(_bytes(fields[chunk_field(name, k)]) for k in range(chunks))

            experts = None
            if "experts" in fields:
                shape = tuple(int(d) for d in _text(fields["experts_shape"]).split(","))
                experts = np.frombuffer(joined("experts"), dtype=np.dtype(_text(fields["experts_dtype"])))
                experts = experts.reshape(shape)
            response = np.frombuffer(joined("response_ids"), I32)
            return cls(
                prompt_ids=np.frombuffer(_bytes(fields["prompt_ids"]), I32),
                response_ids=response,
                loss_mask=np.frombuffer(joined("loss_mask"), U8),
                logprobs=np.frombuffer(joined("logprobs"), F32),
                versions=np.frombuffer(joined("versions"), I32),
                routed_experts=experts,
                num_turns=int(fields.get("num_turns", 0)),
                cancelled=_text(fields.get("cancelled", "0")) == "1",
                stale=_text(fields.get("stale", "0")) == "1",
                conversation=_stored_conversation(fields, chunks),
                tools=orjson.loads(fields["tools"]) if "tools" in fields else None,
                chat_template_kwargs=(
                    orjson.loads(fields["chat_template_kwargs"]) if "chat_template_kwargs" in fields else None
                ),
                writer=_text(fields["writer"]) if "writer" in fields else None,
                num_resumes=int(fields.get("num_resumes", 0)),
                segments=_decode_segments(fields),
                rewritten_from=int(_text(fields["rewritten_from"])) if fields.get("rewritten_from") else None,
                parent=int(_text(fields["parent"])) if fields.get("parent") else None,
                branch_point=int(fields.get("branch_point", 0)),
                retry=_text(fields.get("retry", "0")) == "1",
                **_teacher_scores(fields, response.size),
            )
        except (KeyError, ValueError, TypeError, IndexError) as exc:
            raise TrajectoryFormatError(f"stored sample does not decode: {exc!r}") from exc


def _teacher_scores(fields: Mapping[str, bytes | str], tokens: int) -> dict[str, Any]:
    """A stored sample's teacher fields (`Sample.teacher_logprobs`) for its `tokens` response tokens: none where no
    teacher scored it, or scored it shorter (on demand, before later turns extended it: scores of another sample)."""
    if "teacher_logprobs" not in fields:
        return {}
    own = np.frombuffer(_bytes(fields["teacher_logprobs"]), F32)
    if own.size != tokens:
        return {}
    k = int(fields.get("teacher_top_k", 0))
    top_ids = np.frombuffer(_bytes(fields.get("teacher_top_ids", b"")), I32).reshape(own.size, k)
    top_logprobs = np.frombuffer(_bytes(fields.get("teacher_top_logprobs", b"")), F32).reshape(own.size, k)
    return {"teacher_logprobs": own, "teacher_top_ids": top_ids, "teacher_top_logprobs": top_logprobs}


def _encode_segments(segments: list[SampleSegment]) -> tuple[bytes, str]:
    """`segments` as the `segments` and `segment_replicas` fields (see the module docstring)."""
    replicas: dict[str, int] = {}
    table = [(s.start, s.end, s.version, replicas.setdefault(s.replica, len(replicas))) for s in segments]
    return np.asarray(table, I32).reshape(-1, 4).tobytes(), "\n".join(replicas)


def _decode_segments(fields: Mapping[str, bytes | str]) -> list[SampleSegment]:
    raw = fields.get("segments")
    if not raw:
        return []
    table = np.frombuffer(_bytes(raw), I32).reshape(-1, 4).tolist()
    replicas = _text(fields.get("segment_replicas", "")).split("\n")
    if any(not 0 <= row[3] < len(replicas) for row in table):
        raise ValueError("a segment names a replica that segment_replicas does not list")
    sampling = _decode_segment_sampling(fields, len(table))
    return [
        SampleSegment(start, end, replicas[replica], version, used)
        for (start, end, version, replica), used in zip(table, sampling, strict=True)
    ]


def _encode_segment_sampling(segments: list[SampleSegment]) -> bytes:
    """The segments' sampling as the `segment_sampling` field (see the module docstring)."""
    distinct: dict[bytes, int] = {}
    of = []
    for segment in segments:
        if segment.sampling is None:
            of.append(-1)
            continue
        of.append(distinct.setdefault(orjson.dumps(segment.sampling, option=orjson.OPT_SORT_KEYS), len(distinct)))
    return b"[" + orjson.dumps(of) + b",[" + b",".join(distinct) + b"]]"


def _decode_segment_sampling(fields: Mapping[str, bytes | str], count: int) -> list[dict[str, Any] | None]:
    raw = fields.get("segment_sampling")
    if not raw:
        return [None] * count
    of, settings = orjson.loads(raw)
    if len(of) != count or any(not isinstance(i, int) or not -1 <= i < len(settings) for i in of):
        raise ValueError("segment_sampling does not match the segments")
    if any(not isinstance(entry, dict) for entry in settings):
        raise ValueError("segment_sampling holds settings that are not objects")
    return [None if i == -1 else settings[i] for i in of]


def _messages(conversation: list[dict[str, Any]] | None) -> tuple[dict[str, Any], ...] | None:
    return None if conversation is None else tuple(conversation)


def _conversation_fields(
    conversation: list[dict[str, Any]] | None, stored: tuple[dict[str, Any], ...] | None, chunk: int
) -> dict[str, bytes | int | str]:
    """The conversation's fields in write `chunk` over a hash that holds `stored`: the messages after those as
    chunk `chunk` where `conversation` begins with them; otherwise the whole conversation as chunk 0 (null: none)
    and every later chunk emptied."""
    if conversation is None and stored is None:
        return {chunk_field("conversation", chunk): b"[]"}
    if conversation is not None and stored is not None and tuple(conversation[: len(stored)]) == stored:
        return {chunk_field("conversation", chunk): orjson.dumps(conversation[len(stored) :])}
    fields: dict[str, bytes | int | str] = {"conversation": orjson.dumps(conversation)}
    fields.update((chunk_field("conversation", k), b"[]") for k in range(1, chunk + 1))
    return fields


def stored_conversation(raw: Mapping[bytes | str, bytes | str]) -> list[dict[str, Any]] | None:
    """The chat conversation a sample's hash holds (its `conversation` fields and `chunk_ends`; the other fields are
    not needed), None if it holds none."""
    fields = {_text(k): v for k, v in raw.items()}
    chunks = len(_text(fields["chunk_ends"]).split(",")) if "chunk_ends" in fields else 1
    try:
        return _stored_conversation(fields, chunks)
    except ValueError as exc:  # orjson's decode error is a ValueError
        raise TrajectoryFormatError(f"stored conversation does not decode: {exc!r}") from exc


def _stored_conversation(fields: Mapping[str, Any], chunks: int) -> list[dict[str, Any]] | None:
    """The conversation of a sample's hash: chunk 0's messages, then each later chunk's (None: none stored)."""
    if "conversation" not in fields:
        return None
    conversation = orjson.loads(fields["conversation"])
    if conversation is None:
        return None
    for chunk in range(1, chunks):
        more = fields.get(chunk_field("conversation", chunk))
        if more is not None:
            conversation.extend(orjson.loads(more))
    return cast("list[dict[str, Any]]", conversation)


@dataclass
class SessionMeta:
    """What the gateway knows about a session besides its samples."""

    id: str
    status: SessionStatus = "active"
    metadata: dict[str, Any] = field(default_factory=dict)
    reward: float | None = None
    sample_count: int = 0
    created_at: float = 0.0
    updated_at: float = 0.0
    finished_at: float | None = None
    replica: str | None = None
    stream_id: str | None = None
    # Sample writes so far: every write bumps it in Redis (never set from here), so a process that remembers a
    # session's samples at revision r knows them current exactly when the stored revision is still r.
    revision: int = 0
    # One reward per sample, in index order, where the finish gave them (`POST /v1/sessions/{id}/finish {rewards}`);
    # stored as their reprs joined by commas.
    rewards: list[float] | None = None
    # The API key that created the session (its `gateway.session.quotas.key_id`, never the key): only that key may read,
    # extend or finish it. None: made on a gateway without API keys, open to all.
    owner: str | None = None
    # A policy with a teacher (`pools[i].teacher`): "scored" once the teacher scored every sample, "unscored" where
    # its deadline passed first; and the teacher that scored it, `model@version`. Written by `gateway.teacher`.
    scoring: Literal["scored", "unscored"] | None = None
    teacher: str | None = None

    @property
    def group_id(self) -> str | None:
        group = self.metadata.get("group_id")
        return None if group is None else str(group)

    def to_redis(self) -> dict[str, bytes | int | float | str]:
        """The fields a meta write sets: neither `stream_id` (set once, by delivery), `revision` (counted by the
        sample writes themselves) nor `scoring` and `teacher` (a teacher's scorer's), which a write of these must
        leave as they are."""
        return {
            "status": self.status,
            "metadata": orjson.dumps(self.metadata),
            "reward": "" if self.reward is None else repr(self.reward),
            "sample_count": self.sample_count,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "finished_at": "" if self.finished_at is None else self.finished_at,
            "replica": self.replica or "",
            "rewards": "" if self.rewards is None else ",".join(repr(r) for r in self.rewards),
            "owner": self.owner or "",
        }

    @classmethod
    def from_redis(cls, session_id: str, raw: Mapping[bytes | str, bytes | str]) -> SessionMeta:
        fields = {_text(k): _text(v) for k, v in raw.items()}
        try:
            return cls(
                id=session_id,
                status=fields.get("status", "active"),  # type: ignore[arg-type]
                metadata=orjson.loads(fields.get("metadata") or "{}"),
                reward=float(fields["reward"]) if fields.get("reward") else None,
                sample_count=int(fields.get("sample_count") or 0),
                created_at=float(fields.get("created_at") or 0),
                updated_at=float(fields.get("updated_at") or 0),
                finished_at=float(fields["finished_at"]) if fields.get("finished_at") else None,
                replica=fields.get("replica") or None,
                stream_id=fields.get("stream_id") or None,
                revision=int(fields.get("revision") or 0),
                rewards=[float(r) for r in fields["rewards"].split(",")] if fields.get("rewards") else None,
                owner=fields.get("owner") or None,
                scoring=fields.get("scoring") or None,  # type: ignore[arg-type]
                teacher=fields.get("teacher") or None,
            )
        except (ValueError, orjson.JSONDecodeError) as exc:
            raise TrajectoryFormatError(f"session {session_id}: meta does not decode: {exc!r}") from exc


@dataclass
class Trajectory:
    """A finished session as the trainer receives it."""

    meta: SessionMeta
    samples: list[Sample]
    entry_id: str = ""

    @property
    def session_id(self) -> str:
        return self.meta.id

    @property
    def reward(self) -> float | None:
        """The session's reward (`finish {reward}`)."""
        return self.meta.reward

    @property
    def rewards(self) -> list[float | None]:
        """One reward per sample: those the finish gave per sample (`finish {rewards}`), else the session's reward
        for every sample."""
        if self.meta.rewards is not None:
            return list(self.meta.rewards)
        return [self.meta.reward] * len(self.samples)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode("latin-1")
