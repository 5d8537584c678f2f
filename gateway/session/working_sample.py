"""A session's sample while this process serves it: compact typed arrays (`array.array`), cheap to extend turn after
turn, and the read-only numpy arrays of a `Sample` copied from them at each write (`WorkingSample.arrays`).

Typed arrays, not python lists: a list of token ids costs a pointer and an int object a token (about 40 bytes), a
typed array 4, and this process holds every open session's samples between its turns (docs/scaling.md)."""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from backends.routed_experts import ExpertArray
from gateway.tokenization import Rendering
from gateway.trajectory import F32, I32, U8, Sample, SampleSegment, StoredChunks

Message = dict[str, Any]
Tool = dict[str, Any]


@dataclass(frozen=True, slots=True)
class SampleArrays:
    """A working sample's token lists as the arrays a `Sample` holds (read-only: samples share them)."""

    prompt_ids: npt.NDArray[np.int32]
    response_ids: npt.NDArray[np.int32]
    loss_mask: npt.NDArray[np.uint8]
    logprobs: npt.NDArray[np.float32]
    versions: npt.NDArray[np.int32]

    @classmethod
    def of(
        cls,
        prompt_ids: Sequence[int],
        response_ids: Sequence[int],
        loss_mask: Sequence[int],
        logprobs: Sequence[float],
        versions: Sequence[int],
    ) -> SampleArrays:
        return cls(
            _frozen(np.asarray(prompt_ids, I32)),
            _frozen(np.asarray(response_ids, I32)),
            _frozen(np.asarray(loss_mask, U8)),
            _frozen(np.asarray(logprobs, F32)),
            _frozen(np.asarray(versions, I32)),
        )

    def extended(
        self, response_ids: Sequence[int], loss_mask: Sequence[int], logprobs: Sequence[float], versions: Sequence[int]
    ) -> SampleArrays:
        """These arrays with the given response entries appended: only those are converted."""
        if not response_ids:
            return self
        return SampleArrays(
            self.prompt_ids,
            _appended(self.response_ids, response_ids),
            _appended(self.loss_mask, loss_mask),
            _appended(self.logprobs, logprobs),
            _appended(self.versions, versions),
        )

    def sample(
        self,
        routed_experts: ExpertArray | None,
        num_turns: int,
        cancelled: bool,
        conversation: list[Message],
        tools: list[Tool] | None,
        num_resumes: int = 0,
        segments: list[SampleSegment] | None = None,
        rewritten_from: int | None = None,
        template_kwargs: dict[str, Any] | None = None,
        branch: Branch | None = None,
        stale: bool = False,
    ) -> Sample:
        """The sample these arrays are the token arrays of (`branch`: where it branches from another; None: a
        root)."""
        return Sample(
            prompt_ids=self.prompt_ids,
            response_ids=self.response_ids,
            loss_mask=self.loss_mask,
            logprobs=self.logprobs,
            versions=self.versions,
            routed_experts=routed_experts,
            num_turns=num_turns,
            cancelled=cancelled,
            conversation=conversation,
            tools=tools,
            chat_template_kwargs=template_kwargs,
            num_resumes=num_resumes,
            segments=list(segments or ()),
            rewritten_from=rewritten_from,
            parent=branch.parent if branch is not None else None,
            branch_point=branch.point if branch is not None else 0,
            retry=branch.retry if branch is not None else False,
            stale=stale,
        )


@dataclass(frozen=True, slots=True)
class Branch:
    """Where a sample branches from an earlier one of its session (`Sample.parent`, `branch_point`, `retry`)."""

    parent: int
    point: int
    retry: bool = False


def _frozen(values: npt.NDArray[Any]) -> npt.NDArray[Any]:
    values.flags.writeable = False
    return values


def _appended(values: npt.NDArray[Any], tail: Sequence[Any]) -> npt.NDArray[Any]:
    return _frozen(np.concatenate([values, np.asarray(tail, values.dtype)]))


# The typed arrays' codes, each the item of its `Sample` array's dtype: ids and versions int32, the loss mask a byte,
# logprobs float32 (what a `Sample` stores them as: nothing is lost that a write would keep).
IDS, MASK, LOGPROBS = "i", "B", "f"
assert array(IDS).itemsize == I32.itemsize and array(LOGPROBS).itemsize == F32.itemsize


def ids_array(ids: Iterable[int] = ()) -> array[int]:
    """Token ids (or versions) as a typed array."""
    return array(IDS, ids)


def _typed(values: Iterable[Any], code: str) -> array[Any]:
    return values if isinstance(values, array) and values.typecode == code else array(code, values)


def _from_numpy(values: npt.NDArray[Any], dtype: np.dtype[Any], code: str) -> array[Any]:
    return array(code, np.ascontiguousarray(values, dtype).tobytes())


def _to_numpy(values: array[Any], dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    """A read-only copy (never a view: a view would pin the typed array's buffer, and it grows in place)."""
    return _frozen(np.array(values, dtype))


@dataclass(slots=True)
class WorkingSample:
    """A sample as typed arrays (`IDS`...), cheap to extend turn after turn: they only ever grow at their end
    (`record`). Lists given to the constructor are converted."""

    index: int
    prompt_ids: array[int]
    response_ids: array[int] = field(default_factory=ids_array)
    loss_mask: array[int] = field(default_factory=lambda: array(MASK))
    logprobs: array[float] = field(default_factory=lambda: array(LOGPROBS))
    versions: array[int] = field(default_factory=ids_array)
    routed_experts: ExpertArray | None = None
    conversation: list[Message] = field(default_factory=list)
    tools: list[Tool] | None = None
    template_kwargs: dict[str, Any] | None = None  # `Sample.chat_template_kwargs`
    num_turns: int = 0
    cancelled: bool = False
    stale: bool = False  # `Sample.stale`: cut for staleness, never extended again
    num_resumes: int = 0
    segments: list[SampleSegment] = field(default_factory=list)
    rewritten_from: int | None = None  # `Sample.rewritten_from`
    branch: Branch | None = None  # `Sample.parent`, `branch_point`, `retry`
    # The template's rendering of `conversation`, kept for matching later turns against it (a new one whenever
    # `conversation` changes).
    rendering: Rendering = field(default_factory=Rendering, repr=False, compare=False)
    # What this sample's hash in Redis holds, as the last write of it answered (None: unknown).
    stored: StoredChunks | None = field(default=None, repr=False, compare=False)
    # The turn that wrote it last, as far as this process knows (None: a new sample, or written without one).
    writer: str | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.prompt_ids = _typed(self.prompt_ids, IDS)
        self.response_ids = _typed(self.response_ids, IDS)
        self.loss_mask = _typed(self.loss_mask, MASK)
        self.logprobs = _typed(self.logprobs, LOGPROBS)
        self.versions = _typed(self.versions, IDS)

    @property
    def ids(self) -> list[int]:
        """The sample's ids (prompt, then response) as a list: what a turn's prompt is made of."""
        return self.prompt_ids.tolist() + self.response_ids.tolist()

    @property
    def length(self) -> int:
        """len(ids), without building them."""
        return len(self.prompt_ids) + len(self.response_ids)

    def arrays(self) -> SampleArrays:
        """The typed arrays as read-only numpy copies (a copy of a few bytes a token, made at each write: keeping
        them would hold every token twice)."""
        return SampleArrays(
            _to_numpy(self.prompt_ids, I32),
            _to_numpy(self.response_ids, I32),
            _to_numpy(self.loss_mask, U8),
            _to_numpy(self.logprobs, F32),
            _to_numpy(self.versions, I32),
        )

    def to_sample(self) -> Sample:
        return self.arrays().sample(
            self.routed_experts,
            self.num_turns,
            self.cancelled,
            self.conversation,
            self.tools,
            self.num_resumes,
            self.segments,
            self.rewritten_from,
            self.template_kwargs,
            self.branch,
            self.stale,
        )

    @property
    def first_version(self) -> int | None:
        """The weight version of the sample's first sampled token (None: none sampled yet): what its staleness is
        measured by."""
        try:
            return self.versions[self.loss_mask.index(1)]  # a scan in C: asked once per turn
        except ValueError:
            return None

    @classmethod
    def from_sample(cls, index: int, sample: Sample) -> WorkingSample:
        return cls(
            index=index,
            prompt_ids=_from_numpy(sample.prompt_ids, I32, IDS),
            response_ids=_from_numpy(sample.response_ids, I32, IDS),
            loss_mask=_from_numpy(sample.loss_mask, U8, MASK),
            logprobs=_from_numpy(sample.logprobs, F32, LOGPROBS),
            versions=_from_numpy(sample.versions, I32, IDS),
            routed_experts=sample.routed_experts,
            conversation=list(sample.conversation or []),
            tools=sample.tools,
            template_kwargs=sample.chat_template_kwargs,
            num_turns=sample.num_turns,
            cancelled=sample.cancelled,
            stale=sample.stale,
            num_resumes=sample.num_resumes,
            segments=list(sample.segments),
            rewritten_from=sample.rewritten_from,
            branch=Branch(sample.parent, sample.branch_point, sample.retry) if sample.parent is not None else None,
            writer=sample.writer,
        )

    def copy_as(self, index: int) -> WorkingSample:
        """A branch of this sample under another index (n > 1 choices of one turn)."""
        return replace(
            self,
            index=index,
            prompt_ids=self.prompt_ids[:],
            response_ids=self.response_ids[:],
            loss_mask=self.loss_mask[:],
            logprobs=self.logprobs[:],
            versions=self.versions[:],
            conversation=list(self.conversation),
            segments=list(self.segments),
            rendering=Rendering(),
            stored=None,
            writer=None,
        )
