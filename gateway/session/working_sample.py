"""A session's sample while this process serves it: python lists, cheap to extend turn after turn, and the
read-only arrays of a `Sample` made from them once per entry (`WorkingSample.arrays`)."""

from __future__ import annotations

from collections.abc import Sequence
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


def _frozen(array: npt.NDArray[Any]) -> npt.NDArray[Any]:
    array.flags.writeable = False
    return array


def _read_only(array: npt.NDArray[Any], dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    """`array` itself when it is read-only already (a sample read from Redis), else a read-only copy."""
    if array.dtype == dtype and not array.flags.writeable:
        return array
    return _frozen(array.astype(dtype))


def _appended(array: npt.NDArray[Any], tail: Sequence[Any]) -> npt.NDArray[Any]:
    return _frozen(np.concatenate([array, np.asarray(tail, array.dtype)]))


@dataclass
class WorkingSample:
    """A sample as python lists, cheap to extend turn after turn. The lists only ever grow at their end (`record`),
    so their arrays are converted once per entry (`arrays`), not at every write of the sample."""

    index: int
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
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
    # The lists as arrays, up to the length they had when last converted (`arrays`).
    converted: SampleArrays | None = field(default=None, repr=False, compare=False)

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def length(self) -> int:
        """len(ids), without building them."""
        return len(self.prompt_ids) + len(self.response_ids)

    def arrays(self) -> SampleArrays:
        """The lists as arrays, converting only what was appended since the last call."""
        done, size = self.converted, len(self.response_ids)
        if done is None or len(done.prompt_ids) != len(self.prompt_ids) or len(done.response_ids) > size:
            done = SampleArrays.of(self.prompt_ids, self.response_ids, self.loss_mask, self.logprobs, self.versions)
        elif len(done.response_ids) < size:
            start = len(done.response_ids)
            done = done.extended(
                self.response_ids[start:], self.loss_mask[start:], self.logprobs[start:], self.versions[start:]
            )
        self.converted = done
        return done

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
            prompt_ids=sample.prompt_ids.tolist(),
            response_ids=sample.response_ids.tolist(),
            loss_mask=sample.loss_mask.tolist(),
            logprobs=sample.logprobs.tolist(),
            versions=sample.versions.tolist(),
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
            converted=SampleArrays(
                _read_only(sample.prompt_ids, I32),
                _read_only(sample.response_ids, I32),
                _read_only(sample.loss_mask, U8),
                _read_only(sample.logprobs, F32),
                _read_only(sample.versions, I32),
            ),
        )

    def copy_as(self, index: int) -> WorkingSample:
        """A branch of this sample under another index (n > 1 choices of one turn)."""
        return replace(
            self,
            index=index,
            prompt_ids=list(self.prompt_ids),
            response_ids=list(self.response_ids),
            loss_mask=list(self.loss_mask),
            logprobs=list(self.logprobs),
            versions=list(self.versions),
            conversation=list(self.conversation),
            segments=list(self.segments),
            rendering=Rendering(),
            stored=None,
            writer=None,
        )
