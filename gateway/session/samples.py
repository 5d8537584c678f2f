"""A session's samples in this process: exact multi-turn tokens (docs/architecture.md §3, §7). The steps of a
turn (lock, load, turn, save, finish) are put in order by `gateway.session.lifecycle`; this module does the sample
side of them: which sample a turn extends, what it appends, what is written.

Turn N+1 of a session reuses turn N's exact ids (prompt + sampled tokens) and tokenizes only what the new
messages add (`ChatTokenizer.render_delta`); sampled tokens get loss mask 1, everything else 0, and what the
model produced is never re-tokenized. When the new messages do not extend any sample of the session (history
rewritten, system prompt or tools changed) a new sample starts, and the session counts it.

A session's samples live in Redis (`TrajectoryStore`); this process keeps a cache of the ones it served, bounded
by count and by an estimate of its bytes (`_footprint`), least recently used out first, and a finished session
leaves it at once (`forget`). Any process can serve the next turn of a session it does not hold by reading it
back. The cache is trusted only at
the session's revision it was read or written at: every sample write bumps the stored revision, so a turn that
finds it moved (another process served the session meanwhile, or a write of ours did not land) reads the
samples back first (`SessionManager.open`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from backends.routed_experts import ExpertArray
from gateway.generation import STALE, GenerationState, sampling_used
from gateway.history import ReplayMatch, TokenHistory, replayed
from gateway.request_ids import new_name
from gateway.session.forks import branch_of, last_turn_start, retried, rewritten_from
from gateway.session.working_sample import Branch, WorkingSample, ids_array
from gateway.store.locks import SessionLocks
from gateway.tokenization import ChatTokenizer, ConversationMatch, NotAPrefix, Rendering, TextCheck
from gateway.trajectory import (
    ENV_VERSION,
    Sample,
    SampleSaved,
    SampleSegment,
    SessionMeta,
    StoredChunks,
)

logger = logging.getLogger(__name__)

Message = dict[str, Any]
Tool = dict[str, Any]


class SampleStore(Protocol):
    """What sessions need of the trajectory store."""

    async def load_samples(self, session_id: str) -> list[Sample]: ...

    async def save_sample(
        self,
        session_id: str,
        index: int,
        sample: Sample,
        *,
        replica: str | None = None,
        stored: StoredChunks | None = None,
        writer: str | None = None,
        base: str | None = None,
    ) -> SampleSaved | None: ...

    async def touch_session(self, session_id: str) -> SessionMeta | None: ...


@dataclass
class Turn:
    """One prepared turn: the ids to send and the sample they extend."""

    session_id: str
    sample: WorkingSample
    prompt_ids: list[int]
    env_ids: list[int]
    messages: list[Message]
    new_sample: bool
    # What was stored of `sample` when the turn began, which the turn's writes extend (None: they write it whole).
    stored_base: StoredChunks | None = None
    # The turn that wrote `sample` last when this one began (None: a new sample), and this turn's own id: its
    # writes replace only what one of the two wrote (`TrajectoryStore.save_sample`).
    base_writer: str | None = None
    writer: str = field(default_factory=new_name)
    # Where the sample went instead of `sample.index`, that index having been taken by another process's turn.
    moved_to: int | None = None

    @property
    def stored_index(self) -> int:
        """The index the turn's sample is stored at (as its last write that reached Redis answered)."""
        return self.sample.index if self.moved_to is None else self.moved_to

    @property
    def experts_start(self) -> int:
        """The first position whose routed experts this turn must fetch (earlier ones are in the sample)."""
        return max(0, len(self.sample.ids) - 1) if self.sample.routed_experts is not None else 0


_UNKNOWN = -1  # the revision of a cache entry that must not be trusted (never a stored revision)

# What a cached session costs this process, estimated from its token counts: per prompt token, its typed array's
# item (`WorkingSample`: 4 bytes), its rendering's (`Rendering`: 4 bytes of ids and the text the template wrote) and
# its conversation's text (a few characters a token each); per response token, the items of ids, loss mask, logprobs
# and versions (13 bytes) and the same; per session, the entry's objects (messages, segments, the sample itself).
# The routed experts' array is counted as it is. `benchmarks/session_memory.py` measures what a session really
# holds (docs/scaling.md).
PROMPT_TOKEN_BYTES = 24
RESPONSE_TOKEN_BYTES = 32
SESSION_BYTES = 2048


@dataclass(slots=True)
class _Known:
    """What this process knows of a session: its samples in index order, as of the stored `revision`.

    Raw completions find the sample a prompt extends through `ends`: the samples filed by where their ids end
    (length, then last id), so a turn makes one probe per distinct sample length instead of one check per sample (a
    session id shared by unrelated prompts gathers thousands). It is built at the first lookup, and `record` moves a
    sample it extends to its new end (`file`).
    """

    samples: list[WorkingSample]
    revision: int
    ends: dict[int, dict[int, list[WorkingSample]]] | None = None
    size: int = 0  # `_footprint` when last counted into the cache's total

    def file(self, sample: WorkingSample, was: tuple[int, int] | None = None) -> None:
        """File `sample` under its end, out of `was` (the end it had), if the index is built."""
        if self.ends is None:
            return
        if was is not None:
            self._unfile(sample, *was)
        length, last = _end(sample)
        self.ends.setdefault(length, {}).setdefault(last, []).append(sample)

    def extended_by(self, prompt_ids: list[int]) -> WorkingSample | None:
        """The most recent sample with turns, not cancelled, whose ids are a proper prefix of `prompt_ids`."""
        if self.ends is None:
            self.ends = {}
            for sample in self.samples:
                self.file(sample)
        size, found = len(prompt_ids), []
        for length, by_last in self.ends.items():
            if length < size:
                for sample in by_last.get(prompt_ids[length - 1] if length else _NO_ID, ()):
                    if sample.num_turns and not sample.cancelled and _repeats(prompt_ids, sample):
                        found.append(sample)
        if len(found) > 1:  # nested prefixes: the latest in the session's order, as a scan from the end would find
            order = {id(sample): position for position, sample in enumerate(self.samples)}
            found.sort(key=lambda sample: order.get(id(sample), -1))
        return found[-1] if found else None

    def _unfile(self, sample: WorkingSample, length: int, last: int) -> None:
        assert self.ends is not None
        by_last = self.ends.get(length, {})
        bucket = [filed for filed in by_last.get(last, ()) if filed is not sample]
        if bucket:
            by_last[last] = bucket
        elif by_last.pop(last, None) is not None and not by_last:
            del self.ends[length]  # no length is probed that no sample ends at


_NO_ID = -1  # the "last id" of an empty sample


def _last_id(sample: WorkingSample) -> int:
    ids = sample.response_ids or sample.prompt_ids
    return ids[-1] if ids else _NO_ID


def _footprint(known: _Known) -> int:
    """The estimated bytes of a cache entry (`PROMPT_TOKEN_BYTES`...), from its token counts, never its tokens."""
    return SESSION_BYTES + sum(_sample_bytes(sample) for sample in known.samples)


def _sample_bytes(sample: WorkingSample) -> int:
    experts = sample.routed_experts
    tokens = len(sample.prompt_ids) * PROMPT_TOKEN_BYTES + len(sample.response_ids) * RESPONSE_TOKEN_BYTES
    return tokens + (experts.nbytes if experts is not None else 0)


def _end(sample: WorkingSample) -> tuple[int, int]:
    return sample.length, _last_id(sample)


def _repeats(prompt_ids: list[int], sample: WorkingSample) -> bool:
    """Whether `prompt_ids` begins with every id of `sample` (compared in place, without building its ids)."""
    start, end = len(sample.prompt_ids), sample.length
    return prompt_ids[:start] == sample.prompt_ids.tolist() and prompt_ids[start:end] == sample.response_ids.tolist()


class SessionManager:
    """Prepares and records the turns of sessions."""

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        store: SampleStore,
        *,
        cache_size: int = 100_000,
        cache_bytes: int = 256 * 1024 * 1024,
        locks: SessionLocks | None = None,
        token_history: TokenHistory | None = None,
        replay_match: ReplayMatch = "loose",
    ) -> None:
        """`cache_size`, `cache_bytes`: the bounds of the cache of sessions (count, and estimated bytes: `_footprint`).
        `locks`: the process's session locks (the store's, `TrajectoryStore.locks`); new ones if None (a manager
        standing for a process of its own). `token_history`: how a turn that replays its session's conversation goes
        on from the sample's ids (`sessions.history: tokens`); None: the template renders every turn whole.
        `replay_match`: what a replay may change of the conversation (`gateway.history.replayed`)."""
        self.tokenizer = tokenizer
        self.token_history = token_history
        self.replay_match: ReplayMatch = replay_match
        # Chat turns by how their prompt was made (tokens: from a sample's ids; template: the template's rendering
        # extends a sample; rewritten: a new sample in a session that had one), and the replay differences forgiven.
        self.turns_by_history: Counter[str] = Counter()
        self.replays_forgiven: Counter[str] = Counter()
        self.store = store
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes
        self.cached_bytes = 0  # the estimated bytes of the cached sessions (`_footprint`), at most `cache_bytes`
        self.evictions = 0
        self.reloads = 0  # sessions read back because the stored revision had moved past this process's copy
        self._cache: OrderedDict[str, _Known] = OrderedDict()
        # A session's lock lives while a turn holds it or waits for it (they keep the reference), whether or not
        # the session's samples are still cached.
        self.locks = locks if locks is not None else SessionLocks()

    def lock(self, session_id: str) -> asyncio.Lock:
        """Turns of one session run one at a time in this process (a turn keeps the lock until it is recorded):
        the session's `turn` lock (`SessionLocks.turn`)."""
        return self.locks.turn(session_id)

    async def open(self, session_id: str, *, new: bool = False) -> SessionMeta | None:
        """Begin a turn of the session (under its lock): its stored meta, with activity recorded, or None if it has
        none yet; a finished or abandoned session is a `Conflict`. `new`: the id was just made up, so there is
        nothing to read. The samples this process remembers are checked against the stored revision here, and
        read back if it moved."""
        if new:
            self._remember(session_id, _Known([], 0))
            return None
        meta = await self.store.touch_session(session_id)
        revision = meta.revision if meta is not None else 0
        known = self._cache.get(session_id)
        if known is None or known.revision != revision:
            if known is not None:
                self.reloads += 1
                logger.debug("session %s: changed since this process served it; reading it back", session_id)
            samples = await self._read(session_id) if meta is not None else []
            self._remember(session_id, _Known(samples, revision))
        return meta

    async def samples(self, session_id: str) -> list[WorkingSample]:
        """The session's samples in index order: this process's copy, read from the store if it has none."""
        return (await self._known(session_id)).samples

    async def _known(self, session_id: str) -> _Known:
        known = self._cache.get(session_id)
        if known is None:
            known = _Known(await self._read(session_id), _UNKNOWN)
            self._remember(session_id, known)
        self._cache.move_to_end(session_id)
        return known

    async def _read(self, session_id: str) -> list[WorkingSample]:
        return [WorkingSample.from_sample(i, s) for i, s in enumerate(await self.store.load_samples(session_id))]

    async def save(self, turn: Turn, sample: Sample, *, replica: str | None = None, final: bool = True) -> None:
        """Store the turn's sample (`SampleStore.save_sample`): `final`, as `record` made it; else `partial`.
        Only what the turn added is sent. The copy here stays trusted only while the writes of the session are all
        this process's, each one revision after the last."""
        if final:
            turn.sample.stored = None  # unknown until this write answers
        try:
            saved = await self.store.save_sample(
                turn.session_id,
                turn.sample.index,
                sample,
                replica=replica,
                stored=turn.stored_base,
                writer=turn.writer,
                base=turn.base_writer,
            )
        except BaseException:
            self._distrust(turn.session_id)
            raise
        if final and saved is not None:
            turn.sample.stored = saved.stored
            turn.sample.writer = turn.writer
        if saved is not None and saved.index != turn.sample.index:
            turn.moved_to = saved.index  # the copy here no longer says where the sample is: read it back next turn
        known = self._cache.get(turn.session_id)
        if known is not None:
            next_one = turn.moved_to is None and saved is not None and saved.revision == known.revision + 1
            known.revision = known.revision + 1 if next_one else _UNKNOWN

    def forget(self, session_id: str) -> None:
        """Drop the session from the cache: it is finished (a one-turn session with its turn), no turn extends it."""
        known = self._cache.pop(session_id, None)
        if known is not None:
            self.cached_bytes -= known.size

    def cached(self, session_id: str) -> bool:
        """Whether this process holds the session's samples (else its next turn reads them from Redis)."""
        return session_id in self._cache

    @property
    def cached_sessions(self) -> int:
        return len(self._cache)

    def _distrust(self, session_id: str) -> None:
        known = self._cache.get(session_id)
        if known is not None:
            known.revision = _UNKNOWN

    def _remember(self, session_id: str, known: _Known) -> None:
        self.forget(session_id)
        self._cache[session_id] = known
        known.size = 0
        self._grow(known, _footprint(known))

    def _grow(self, known: _Known, added: int) -> None:
        """Count `added` bytes more for the entry, then evict the least recently used sessions past either bound. A
        turn in flight keeps its sample and its lock, and once recorded the store has all: an evicted session's next
        turn reads it back. The entry just used may go too, if it alone is past the byte bound."""
        known.size += added
        self.cached_bytes += added
        while self._cache and (len(self._cache) > self.cache_size or self.cached_bytes > self.cache_bytes):
            _, evicted = self._cache.popitem(last=False)
            self.cached_bytes -= evicted.size
            self.evictions += 1

    async def begin_chat_turn(
        self,
        session_id: str,
        messages: list[Message],
        tools: list[Tool] | None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> Turn:
        """Find the sample these messages extend (most recent first) or start a new one. A sample extends only with
        the tools and the chat template's arguments (`template_kwargs`) it was rendered with.

        With a token history, messages that replay a sample's conversation (`replayed`) go on from its exact ids:
        only what the template writes after a reply is new (`TokenHistory`), whatever it would write of the earlier
        turns. Otherwise, and for messages that do not replay one, the template's rendering of the whole
        conversation must extend the sample's:

        A session can hold many samples (n > 1 branches, rewritten histories, a session id shared by unrelated
        conversations), so the candidates are first compared by the templates' texts, which is cheap; tokenizing
        whole conversations (`ConversationMatch.by_ids`) is left for those the text cannot decide, and for those
        whose text differs only if no other sample matched and the tokenizer could give two different texts the
        same ids (one that normalizes, say; not byte-level BPE without a normalizer: `texts_decide`).
        """
        samples = await self.samples(session_id)
        match = self.tokenizer.extension_of(messages, tools, chat_template_kwargs=template_kwargs)
        different: list[WorkingSample] = []
        for sample in reversed(samples):  # the cached list is in index order
            if not sample.num_turns or sample.cancelled or sample.tools != tools:
                continue
            if sample.template_kwargs != template_kwargs:
                continue
            history = self.token_history
            if history is not None and (replay := replayed(sample.conversation, messages, self.replay_match)):
                suffix = await history.suffix_ids(sample.conversation, replay.added, tools, template_kwargs)
                if suffix is not None:
                    self.turns_by_history["tokens"] += 1
                    self.replays_forgiven.update(replay.forgiven)
                    return self._extend(session_id, sample, suffix, messages)
            tail = match.tail(sample.conversation, sample.tools, sample.rendering)
            if tail is TextCheck.DIFFERENT:
                different.append(sample)
                continue
            if isinstance(tail, str):
                delta: list[int] | None = await self.tokenizer.encode_tail_async(tail)
            else:
                delta = self._delta_by_ids(match, sample)
            if delta is not None:
                self.turns_by_history["template"] += 1
                return self._extend(session_id, sample, delta, messages)
        if not match.texts_decide:  # a tokenizer that normalizes can give two different texts the same ids
            for sample in different:
                if (delta := self._delta_by_ids(match, sample)) is not None:
                    self.turns_by_history["template"] += 1
                    return self._extend(session_id, sample, delta, messages)
        return await self._fork(session_id, samples, messages, tools, template_kwargs)

    async def _fork(
        self,
        session_id: str,
        samples: list[WorkingSample],
        messages: list[Message],
        tools: list[Tool] | None,
        template_kwargs: dict[str, Any] | None,
    ) -> Turn:
        """A new sample for messages that extend none: a retry of a sample's last turn goes on from the ids that
        turn was prompted with (`forks.retried`); else the template renders the messages, and the sample branches from
        the one it shares the most leading ids with (`forks.branch_of`)."""
        if any(s.num_turns for s in samples):
            self.turns_by_history["rewritten"] += 1
            logger.info("session %s: history rewritten; sample %d starts", session_id, len(samples))
        asked_again = retried(samples, messages, tools, template_kwargs, self.replay_match)
        if asked_again is not None:
            prompt = asked_again.ids[: last_turn_start(asked_again)]
            branch = Branch(asked_again.index, len(prompt), retry=True)
            fresh = WorkingSample(
                len(samples), ids_array(prompt), tools=tools, template_kwargs=template_kwargs, branch=branch
            )
            return Turn(session_id, fresh, prompt, [], messages, new_sample=True)
        prompt = await self.tokenizer.render_async(messages, tools, chat_template_kwargs=template_kwargs)
        fresh = WorkingSample(
            len(samples),
            ids_array(prompt),
            tools=tools,
            template_kwargs=template_kwargs,
            rewritten_from=rewritten_from(samples, messages, tools, self.replay_match),
            branch=branch_of(samples, prompt),
        )
        return Turn(session_id, fresh, prompt, [], messages, new_sample=True)

    @staticmethod
    def _delta_by_ids(match: ConversationMatch, sample: WorkingSample) -> list[int] | None:
        try:
            return match.by_ids(sample.conversation, sample.tools, sample.rendering)
        except NotAPrefix:
            return None

    def _extend(self, session_id: str, sample: WorkingSample, delta: list[int], messages: list[Message]) -> Turn:
        env = self.tokenizer.between_turns(sample.response_ids, delta)
        return Turn(session_id, sample, sample.ids + env, env, messages, False, sample.stored, sample.writer)

    async def begin_completion_turn(self, session_id: str, prompt_ids: list[int]) -> Turn:
        """Raw completions: the new prompt extends the most recent sample whose ids are its prefix (`_Known`)."""
        known = await self._known(session_id)
        sample = known.extended_by(prompt_ids)
        if sample is not None:
            env = prompt_ids[sample.length :]
            return Turn(session_id, sample, list(prompt_ids), env, [], False, sample.stored, sample.writer)
        fresh = WorkingSample(index=len(known.samples), prompt_ids=ids_array(prompt_ids))
        return Turn(session_id, fresh, list(prompt_ids), [], [], new_sample=True)

    def branch(self, turn: Turn, count: int) -> list[Turn]:
        """`count` turns from one prompt (n > 1): the first extends the sample, the others are new samples."""
        turns = [turn]
        known = self._cache.get(turn.session_id)
        base = (len(known.samples) if known is not None else 0) + (1 if turn.new_sample else 0)
        for i in range(1, count):
            sample = turn.sample.copy_as(base + i - 1)
            turns.append(replace(turn, sample=sample, new_sample=True, stored_base=None, base_writer=None))
        return turns

    def record(self, turn: Turn, state: GenerationState, assistant: Message | None) -> Sample:
        """Append the turn to its sample (env ids mask 0, sampled ids mask 1) and return the sample to store."""
        sample = turn.sample
        was = None if turn.new_sample else _end(sample)
        counted = 0 if turn.new_sample else _sample_bytes(sample)
        sample.segments += _turn_segments(turn, state, len(sample.response_ids))
        sample.num_resumes += state.num_resumes
        ids, mask, logprobs, versions = _turn_entries(turn, state)
        sample.response_ids.extend(ids)
        sample.loss_mask.extend(mask)
        sample.logprobs.extend(logprobs)
        sample.versions.extend(versions)
        sample.routed_experts = self._merge_experts(sample, turn, state)
        sample.num_turns += 1
        sample.cancelled = not state.finished  # the client left, or an error ended it: its tokens kept, not extended
        sample.stale = sample.stale or state.finish_reason == STALE  # cut by the staleness budget: kept, marked
        if assistant is not None:
            sample.conversation = [*turn.messages, assistant]
            sample.rendering = Rendering()
        known = self._cache.get(turn.session_id)
        if known is not None:  # evicted during the turn: the next one reads the store
            if turn.new_sample:
                known.samples.append(sample)
            known.file(sample, was)
            self._grow(known, _sample_bytes(sample) - counted)
        return sample.to_sample()

    @staticmethod
    def _merge_experts(sample: WorkingSample, turn: Turn, state: GenerationState) -> ExpertArray | None:
        """The sample's experts after the turn: the turn's appended to the sample's, or the turn's alone when they
        cover every position (the sample had none, or the engine's whole view replaces them), or none if the
        turn's are incomplete. Only an append keeps what `turn.stored_base` says is stored."""
        new = state.routed_experts if state.routed_experts_complete else None
        if new is None:
            return None
        if sample.routed_experts is None or state.routed_experts_start == 0:
            turn.stored_base = None
            return new
        return np.concatenate([sample.routed_experts, new.astype(sample.routed_experts.dtype)])

    def partial(self, turn: Turn, state: GenerationState) -> Sample:
        """The sample as it would be stored if the turn ended now (written at segment boundaries): the sample's
        arrays with the turn's tokens so far appended, the sample itself unchanged."""
        sample = turn.sample
        arrays = sample.arrays().extended(*_turn_entries(turn, state))
        experts = self._merge_experts(sample, turn, state)
        segments = sample.segments + _turn_segments(turn, state, len(sample.response_ids))
        resumes = sample.num_resumes + state.num_resumes
        turns, conversation, rewritten_from = sample.num_turns, sample.conversation, sample.rewritten_from
        written = arrays.sample(
            experts,
            turns,
            False,
            conversation,
            sample.tools,
            resumes,
            segments,
            rewritten_from,
            sample.template_kwargs,
            sample.branch,
        )
        # The last write of the sample stored this conversation: the turn changes it only once it ends.
        written.conversation_stored = True
        return written


def _turn_entries(turn: Turn, state: GenerationState) -> tuple[list[int], list[int], list[float], list[int]]:
    """The response entries a turn appends to its sample: ids, loss mask, logprobs and versions (env ids mask 0,
    logprob 0, `ENV_VERSION`; sampled ids mask 1)."""
    env, out = turn.env_ids, state.output_ids
    return (
        env + out,
        [0] * len(env) + [1] * len(out),
        [0.0] * len(env) + state.logprobs,
        [ENV_VERSION] * len(env) + state.versions,
    )


def _turn_segments(turn: Turn, state: GenerationState, response_tokens: int) -> list[SampleSegment]:
    """The segments of the turn's model span, as positions of the sample's response (it had `response_tokens` before
    the turn; the turn's environment ids come first). An engine request that went on across a weight update (pause
    mode `keep`) is split where the version changes; one that produced no token is left out."""
    offset = response_tokens + len(turn.env_ids)
    versions = state.versions
    used = sampling_used(state.request)
    out: list[SampleSegment] = []
    for segment in state.segments:
        start, end = segment.start, min(segment.end, len(versions))
        while start < end:
            version = versions[start]
            # Versions never decrease along a sample: one version throughout when the first and last agree.
            stop = end if versions[end - 1] == version else _version_ends(versions, start, end)
            out.append(SampleSegment(offset + start, offset + stop, segment.replica, version, used))
            start = stop
    return out


def _version_ends(versions: list[int], start: int, end: int) -> int:
    """The first position in (start, end) whose version differs from `versions[start]` (`end` if none)."""
    first = versions[start]
    return next((i for i in range(start + 1, end) if versions[i] != first), end)
