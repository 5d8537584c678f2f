"""One agent turn end to end: session → prompt ids → n generations (resume loop) → text, tool calls → Redis.

The OpenAI routes and `POST /generate` in a session shape requests and responses; everything between lives here.
The session side of a turn (lock, load, create, save, finish) is `gateway.session.lifecycle`'s: a turn holds its
session's lock from `prepare_*` until `SessionLifecycle.close`, so the turns of one session never interleave in
this process.

Session metadata. A request's OpenAI `metadata` (str → str) reaches its session: the turn that creates the session
stores it as the session's metadata; a later turn adds the keys the session does not have yet, and a key the
session holds with another value is refused (400, `param` "metadata"), nothing stored (`metadata_additions`).

A group (`group: true`, GRPO): the n choices of one request become n new sessions `<session>-<i>` (the session
named by the request, or a generated one, names only them: no session of that id is created), each holding one
sample of the shared prompt, with the request's metadata plus `group_id` (the metadata's, else the session id),
`group_size` n and `group_index` i. Each member is finished with its own reward and continued as a session of its
own; `TrajectoryConsumer(group_by="group_id")` delivers the n of them together. A member session that exists
already is a 409: a group's members are new.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
from collections import OrderedDict
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass, field
from typing import Any

from backends.base import SamplingParams
from gateway.api.bounds import wrapped_seed
from gateway.api.openai.models import ChatCompletionRequest, ChatSettings, CompletionRequest, _Sampling
from gateway.errors import ConfigError, InvalidRequest, NotFound
from gateway.generation import Delta, GenerationRequest, GenerationState, Generator, StopChecker
from gateway.parsers import (
    ContentDelta,
    ReasoningDelta,
    ReasoningParser,
    ReasoningStreamDelta,
    StreamingReasoningParser,
    StreamingToolParser,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    ToolStreamDelta,
    collect_deltas,
    collect_reasoning,
)
from gateway.request_ids import new_name
from gateway.session.lifecycle import SessionLifecycle
from gateway.session.quotas import SessionLease
from gateway.session.samples import Turn
from gateway.session.working_sample import WorkingSample
from gateway.tokenization import ChatTokenizer, EncodedPrefix, IncrementalDetokenizer, make_stop_checker
from gateway.tokenization.token_ids import first_outside

MAX_RANDOM_SEED = 2**31 - 1
# Beyond this many characters a token of the context, a prompt is counted in chunks before it is tokenized whole:
# natural text and code run at 2-5 characters a token, so a text that long almost never fits.
LIKELY_MAX_CHARS_PER_TOKEN = 8
PROMPT_TAIL_TOKENS = 4  # the prompt's last tokens a reasoning parser sees (did the template open the reasoning?)


@dataclass
class Choice:
    """One of the n generations of a turn, with its text decoded as it streams and split, for a chat turn, into
    reasoning (`reasoning_stream`), then content and tool calls (`tool_stream`)."""

    index: int
    turn: Turn
    request: GenerationRequest
    state: GenerationState
    detokenizer: IncrementalDetokenizer
    tool_stream: StreamingToolParser | None
    reasoning_stream: StreamingReasoningParser | None = None
    prompt_tail: str = ""
    text: str = ""
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    cut_in_tool_call: bool = False  # max_tokens ended the reply inside a tool call, which was dropped
    # What `tool_stream` made: the reply's content and calls are these collected, so that the ids a streamed reply
    # sent are the ids its recorded message holds (the chat templates of some families write them back).
    tool_deltas: list[ToolStreamDelta] = field(default_factory=list)
    reasoning_deltas: list[ReasoningStreamDelta] = field(default_factory=list)  # what `reasoning_stream` made

    @property
    def finish_reason(self) -> str:
        """OpenAI's: `length` when cut by max_tokens inside a tool call, else `tool_calls` when it made calls, else
        the engine's (`stop`, `length`, `abort`)."""
        if self.cut_in_tool_call:
            return "length"
        if self.tool_calls:
            return "tool_calls"
        return self.state.finish_reason or "stop"


@dataclass
class ChoiceEvent:
    """What changed in one choice: new content (`text`), reasoning or tool-call deltas, new token logprobs, or its
    end."""

    choice: Choice
    text: str = ""
    tool_deltas: list[ToolCallDelta] = field(default_factory=list)
    delta: Delta | None = None
    finished: bool = False
    reasoning: str = ""


@dataclass
class PreparedTurn:
    """A turn ready to generate. `session_id`: the session named (or made up) for the request; the choices' turns
    are in it, or in the sessions of its group (`group_id` set). `locks`: the sessions' locks the turn holds.
    `conversation`: record the reply as a chat message in the sample (not for token-in/token-out turns)."""

    session_id: str
    one_turn: bool
    choices: list[Choice]
    prompt_ids: list[int]
    locks: list[asyncio.Lock]
    closed: bool = False
    leases: list[SessionLease] = field(default_factory=list)
    group_id: str | None = None
    conversation: bool = True

    def replies(self) -> Iterator[tuple[Turn, GenerationState, dict[str, Any] | None]]:
        """Per choice, what its sample records: its turn, its generation, and the reply to keep as the sample's
        conversation (None: a token-in/token-out turn, or a cancelled one)."""
        for choice in self.choices:
            recorded = self.conversation and choice.state.finished
            yield choice.turn, choice.state, assistant_message(choice) if recorded else None


class TurnRunner:
    """Runs turns for the OpenAI routes and `POST /generate`; `lifecycle` begins and closes them as turns of
    sessions."""

    def __init__(
        self,
        generator: Generator,
        lifecycle: SessionLifecycle,
        tokenizer: ChatTokenizer,
        tool_parser: ToolParser,
        reasoning_parser: ReasoningParser | None = None,
        *,
        model_name: str,
        max_model_len: int,
        want_routed_experts: bool,
    ) -> None:
        self.generator = generator
        self.lifecycle = lifecycle
        self.sessions = lifecycle.sessions
        self.tokenizer = tokenizer
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        # The parsers' turn-ending tokens (harmony's `<|call|>`), as ids: a chat turn's engine request stops at them.
        ends = {*tool_parser.turn_end_tokens, *(reasoning_parser.turn_end_tokens if reasoning_parser else ())}
        self._format_stop_ids = tuple(sorted(_token_id(tokenizer, token) for token in ends))
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.want_routed_experts = want_routed_experts
        # Per session, the beginning of its last raw completion prompt and its ids (`_encode_prompt`), as many
        # sessions as the session cache holds.
        self._prefixes: OrderedDict[str, EncodedPrefix] = OrderedDict()

    def forget(self, session_id: str) -> None:
        """Drop what this process keeps of a finished session: its samples and its last raw prompt."""
        self.sessions.forget(session_id)
        self._prefixes.pop(session_id, None)

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise NotFound(
                f"The model `{model}` does not exist; this gateway serves `{self.model_name}`", param="model"
            )

    async def prepare_chat(
        self, body: ChatSettings, inputs: ChatInputs, session_id: str | None, owner: str | None = None
    ) -> PreparedTurn:
        """A chat turn of `session_id` (None: a one-turn session), for the API key `owner` (its key id: a session
        another key created is a 404, `SessionLifecycle.begin`). `inputs`: what the template renders, as
        `chat_inputs` gives them (template-form messages, the tools offered)."""
        self.check_model(body.model)
        messages, tools = inputs
        await self._check_fits([text for m in messages for text in _texts(m.get("content"))], "messages")
        top = body.top_logprobs or 0
        if body.group:
            base = session_id or f"chat-{secrets.token_hex(16)}"
            prompt = await self.tokenizer.render_async(messages, tools)
            return await self._prepare_group(base, prompt, messages, tools, body, body.budget, top, owner)
        one_turn = session_id is None
        sid = session_id or f"chat-{secrets.token_hex(16)}"
        lock, meta = await self.lifecycle.begin(sid, new=one_turn, owner=owner)
        try:
            turn = await self.sessions.begin_chat_turn(sid, messages, tools)
            turns = self.sessions.branch(turn, body.n)
            prepared = self._prepare(sid, one_turn, turns, body, body.budget, top, tools, [lock], chat=True)
            await self.lifecycle.create(sid, one_turn, meta, body.metadata, owner)
            return prepared
        except BaseException:
            self.lifecycle.refused(sid, one_turn, lock)
            raise

    async def _check_fits(self, texts: list[str], param: str) -> None:
        """Refuse a text the context cannot hold before tokenizing it whole (a 15 MB prompt cost seconds of CPU and a
        GB of memory to learn it was too long): by its length alone where that says so (`ChatTokenizer.fits_in`);
        else, for a text longer than `LIKELY_MAX_CHARS_PER_TOKEN` characters a token of the context, by counting its
        tokens a chunk at a time up to the context (`ChatTokenizer.count_at_least`). A shorter text is tokenized
        whole, a cost bounded by the context's size."""
        characters = sum(map(len, texts))
        if not self.tokenizer.fits_in(characters, self.max_model_len):
            raise InvalidRequest(
                f"{characters} characters of prompt text cannot fit the context length of {self.max_model_len} tokens",
                param=param,
            )
        if characters > self.max_model_len * LIKELY_MAX_CHARS_PER_TOKEN:
            counted = await self.tokenizer.count_at_least(texts, self.max_model_len)
            if counted > self.max_model_len:
                raise InvalidRequest(
                    f"the prompt text is more than {counted} tokens (counted up to the context length of "
                    f"{self.max_model_len} tokens)",
                    param=param,
                )

    async def _encode_prompt(self, text: str, session_id: str | None) -> list[int]:
        """The ids of a raw completion's text prompt; in a session, reusing those of the beginning it shares with the
        session's previous prompt in this process (`ChatTokenizer.encode_continuing`). A pure cache: a prefix is
        used only where the text begins with its text, so a concurrent turn of the session cannot mislead it."""
        if session_id is None:
            return await self.tokenizer.encode_async(text)
        ids, prefix = await self.tokenizer.encode_continuing(text, self._prefixes.get(session_id))
        if prefix is None:
            self._prefixes.pop(session_id, None)
        else:
            self._prefixes[session_id] = prefix
            self._prefixes.move_to_end(session_id)
            while len(self._prefixes) > self.sessions.cache_size:
                self._prefixes.popitem(last=False)
        return ids

    async def prepare_completion(
        self, body: CompletionRequest, session_id: str | None, owner: str | None = None
    ) -> PreparedTurn:
        """A raw completion turn; `owner` as `prepare_chat`'s."""
        self.check_model(body.model)
        if isinstance(body.prompt, str):
            await self._check_fits([body.prompt], "prompt")
            prompt = await self._encode_prompt(body.prompt, None if body.group else session_id)
        else:
            prompt = list(body.prompt)
        if not prompt:
            raise InvalidRequest("the prompt encodes to no tokens", param="prompt")
        bad = first_outside(prompt, self.tokenizer.vocab_size)
        if bad is not None:
            raise InvalidRequest(f"token id {prompt[bad]} is outside the vocabulary", param="prompt")
        budget, top = body.max_tokens or 16, body.logprobs or 0
        if body.group:
            return await self._prepare_group(
                session_id or f"cmpl-{secrets.token_hex(16)}", prompt, [], None, body, budget, top, owner
            )
        one_turn = session_id is None
        sid = session_id or f"cmpl-{secrets.token_hex(16)}"
        lock, meta = await self.lifecycle.begin(sid, new=one_turn, owner=owner)
        try:
            turn = await self.sessions.begin_completion_turn(sid, prompt)
            turns = self.sessions.branch(turn, body.n)
            prepared = self._prepare(sid, one_turn, turns, body, budget, top, None, [lock])
            await self.lifecycle.create(sid, one_turn, meta, body.metadata, owner)
            return prepared
        except BaseException:
            self.lifecycle.refused(sid, one_turn, lock)
            raise

    async def prepare_tokens(
        self,
        session_id: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        *,
        stream: bool,
        want_routed_experts: bool,
        metadata: dict[str, str] | None = None,
        owner: str | None = None,
    ) -> PreparedTurn:
        """A token-in/token-out turn of a session (`POST /generate` with `session_id`): `prompt_ids` are the caller's,
        taken as they are. Where they extend one of the session's samples (its prompt and response ids, then more),
        the turn continues that sample, the extension an environment span (loss mask 0), as a raw completion does
        (`SessionManager.begin_completion_turn`); else a new sample starts in the session. The session is created on
        first use; a finished one is a 409. The caller checked the ids and the context length."""
        lock, meta = await self.lifecycle.begin(session_id, owner=owner)
        try:
            turn = await self.sessions.begin_completion_turn(session_id, prompt_ids)
            want = want_routed_experts or self.want_routed_experts
            request = self._generation_request(session_id, turn, sampling, None, stream, want)
            detokenizer = IncrementalDetokenizer(self.tokenizer)  # unused: the caller decodes, if at all
            choice = Choice(0, turn, request, GenerationState(request), detokenizer, None)
            prepared = PreparedTurn(session_id, False, [choice], turn.prompt_ids, [lock], conversation=False)
            await self.lifecycle.create(session_id, False, meta, metadata, owner)
            return prepared
        except BaseException:
            self.lifecycle.refused(session_id, False, lock)
            raise

    async def _prepare_group(
        self,
        base: str,
        prompt: list[int],
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        body: _Sampling,
        budget: int | None,
        top_logprobs: int,
        owner: str | None,
    ) -> PreparedTurn:
        """The n choices of a group request as the first turns of n new sessions (see the module docstring)."""
        group_id = (body.metadata or {}).get("group_id", base)
        members = [f"{base}-{i}" for i in range(body.n)]
        metadata = _group_metadata(body.metadata or {}, group_id, body.n)
        locks = await self.lifecycle.begin_group(base, members)
        try:
            turns = [
                Turn(member, WorkingSample(0, list(prompt), tools=tools), list(prompt), [], messages, new_sample=True)
                for member in members
            ]
            chat = bool(messages)  # a raw completion's group has none
            prepared = self._prepare(base, False, turns, body, budget, top_logprobs, tools, locks, chat=chat)
            prepared.group_id = group_id
            await self.lifecycle.create_group(members, metadata, owner)
            return prepared
        except BaseException:
            for lock in locks:
                self.lifecycle.release(lock)
            raise

    def _prepare(
        self,
        session_id: str,
        one_turn: bool,
        turns: list[Turn],
        body: _Sampling,
        budget: int | None,
        top_logprobs: int,
        tools: list[dict[str, Any]] | None,
        locks: list[asyncio.Lock],
        *,
        chat: bool = False,
    ) -> PreparedTurn:
        """The choices of `turns` (one per choice, all of one prompt), checked against the context length. A `chat`
        turn's text is split into reasoning and content (with a reasoning parser), and tool calls (with `tools`, the
        request's: the parser types text arguments by their schemas)."""
        prompt_ids = turns[0].prompt_ids
        room = self.max_model_len - len(prompt_ids)
        max_tokens = budget if budget is not None else room
        if max_tokens > room or room <= 0:
            raise InvalidRequest(
                f"{len(prompt_ids)} prompt tokens + max_tokens {max_tokens} exceed the context length "
                f"{self.max_model_len}",
                param="max_tokens",
            )
        reasoning = self.reasoning_parser if chat else None
        # Special tokens kept: `<think>` is one in most families' tokenizers.
        prompt_tail = self.tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:]) if reasoning is not None else ""
        parse_tools = tools is not None
        keep_special = (parse_tools and self.tool_parser.reads_special_tokens) or (
            reasoning is not None and reasoning.reads_special_tokens
        )
        format_stops = self._format_stop_ids if chat else ()
        silent = (*self.tokenizer.stop_token_ids, *(body.stop_token_ids or ()), *format_stops) if keep_special else ()
        choices = []
        for index, turn in enumerate(turns):
            request = self._request(session_id, turn, body, max_tokens, top_logprobs, index, format_stops)
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, skip_special_tokens=not keep_special, stop=body.stops, silent_ids=silent
            )
            tool_stream = self.tool_parser.streaming(tools=tools) if parse_tools else None
            reasoning_stream = reasoning.streaming(prompt_tail) if reasoning is not None else None
            state = GenerationState(request)
            choices.append(Choice(index, turn, request, state, detokenizer, tool_stream, reasoning_stream, prompt_tail))
        return PreparedTurn(session_id, one_turn, choices, prompt_ids, locks)

    def _request(
        self,
        session_id: str,
        turn: Turn,
        body: _Sampling,
        max_tokens: int,
        top_logprobs: int,
        index: int,
        format_stops: tuple[int, ...] = (),
    ) -> GenerationRequest:
        seed = wrapped_seed(body.seed + index) if body.seed is not None else None
        if seed is None and body.n > 1:
            seed = random.randint(0, MAX_RANDOM_SEED)  # distinct samples of one prompt, even on deterministic engines
        stop_ids = tuple(dict.fromkeys((*(body.stop_token_ids or ()), *format_stops)))
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            seed=seed,
            stop_token_ids=stop_ids,
            ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens,
            top_logprobs=top_logprobs,
        )
        stop = make_stop_checker(self.tokenizer, body.stops)
        return self._generation_request(session_id, turn, sampling, stop, body.stream, self.want_routed_experts)

    def _generation_request(
        self,
        session_id: str,
        turn: Turn,
        sampling: SamplingParams,
        stop: StopChecker | None,
        stream: bool,
        want_routed_experts: bool,
    ) -> GenerationRequest:
        """The generation of `turn`, placed as `session_id` (a group's members all as the group's session, so that
        their shared prompt lands on one replica's prefix cache), its sample written at every segment boundary."""

        async def on_partial(state: GenerationState) -> None:
            await self.sessions.save(turn, self.sessions.partial(turn, state), final=False)

        return GenerationRequest(
            request_id=f"{turn.session_id}-{turn.sample.index}-{new_name()}",
            prompt_ids=turn.prompt_ids,
            sampling=sampling,
            session_id=session_id,
            want_routed_experts=want_routed_experts,
            stop=stop,
            experts_start=turn.experts_start if want_routed_experts else 0,
            routed_experts=turn.sample.routed_experts if want_routed_experts else None,
            on_partial=on_partial,
            stream=stream,
        )

    # -- running ---------------------------------------------------------------------------------

    async def run(self, prepared: PreparedTurn) -> None:
        """Generate every choice to the end (non-streaming). One choice without stop strings is generated in whole
        engine answers (`Generator.complete`) and decoded once at the end: the detokenizer turns ids into the same
        text in one feed as in one feed per delta (only its stop-string matching looks across feeds)."""
        if len(prepared.choices) == 1 and prepared.choices[0].request.stop is None:
            choice = prepared.choices[0]
            await self.generator.complete(choice.request, choice.state)
            self._decoded(choice, choice.detokenizer.feed(choice.state.output_ids), None)
            self._finish(choice)
            return
        async for _ in self.events(prepared):
            pass

    def events(self, prepared: PreparedTurn) -> AsyncGenerator[ChoiceEvent, None]:
        """Text and tool-call deltas of all choices as they arrive, then one `finished` event per choice."""
        if len(prepared.choices) == 1:
            return self._choice_events(prepared.choices[0])  # no merging layer on the common path
        return self._merged_events(prepared)

    async def _merged_events(self, prepared: PreparedTurn) -> AsyncGenerator[ChoiceEvent, None]:
        queue: asyncio.Queue[ChoiceEvent | BaseException | None] = asyncio.Queue()

        async def pump(choice: Choice) -> None:
            try:
                async for event in self._choice_events(choice):
                    await queue.put(event)
                await queue.put(None)
            except BaseException as exc:  # handed to the consumer, which re-raises it
                await queue.put(exc)

        tasks = [asyncio.create_task(pump(c)) for c in prepared.choices]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # results were consumed above

    async def _choice_events(self, choice: Choice) -> AsyncGenerator[ChoiceEvent, None]:
        stream = self.generator.stream(choice.request, choice.state)
        async with contextlib.aclosing(stream):
            async for delta in stream:
                yield self._decoded(choice, choice.detokenizer.feed(delta.token_ids), delta)
        yield self._finish(choice)

    def _decoded(self, choice: Choice, text: str, delta: Delta | None) -> ChoiceEvent:
        choice.text += text
        if choice.reasoning_stream is None and choice.tool_stream is None:
            return ChoiceEvent(choice, text=text, delta=delta)
        event = ChoiceEvent(choice, delta=delta)
        if text:
            self._split(choice, event, choice.reasoning_stream.feed(text) if choice.reasoning_stream else None, text)
        return event

    def _split(
        self, choice: Choice, event: ChoiceEvent, reasoned: list[ReasoningStreamDelta] | None, text: str
    ) -> None:
        """Add to `event` the reasoning the reasoning parser made of new text (`reasoned`; None: no such parser, the
        text is all content), and the content and tool calls the tool parser made of the rest."""
        if reasoned is not None:
            choice.reasoning_deltas += reasoned
            event.reasoning += "".join(d.text for d in reasoned if isinstance(d, ReasoningDelta))
            text = "".join(d.text for d in reasoned if isinstance(d, ContentDelta))
        if choice.tool_stream is None:
            event.text += text
        elif text:
            self._add_tool_deltas(event, choice.tool_stream.feed(text))

    @staticmethod
    def _add_tool_deltas(event: ChoiceEvent, deltas: list[ToolStreamDelta]) -> None:
        event.choice.tool_deltas += deltas
        event.text += "".join(d.text for d in deltas if isinstance(d, ContentDelta))
        event.tool_deltas += [d for d in deltas if isinstance(d, ToolCallDelta)]

    def _finish(self, choice: Choice) -> ChoiceEvent:
        tail = self._decoded(choice, choice.detokenizer.flush(), None)
        cut = choice.state.finish_reason == "length"
        if choice.reasoning_stream is not None:
            self._split(choice, tail, choice.reasoning_stream.finish(), "")
        if choice.tool_stream is not None:
            self._add_tool_deltas(tail, choice.tool_stream.finish(cut=cut))
        content = choice.text
        if choice.reasoning_stream is not None:  # the streamed deltas are what `parse(text)` gives
            split = collect_reasoning(choice.reasoning_deltas)
            choice.reasoning, content = split.reasoning, split.content
        if choice.tool_stream is not None:  # the streamed deltas are what `parse(content)` gives, ids kept
            parsed = collect_deltas(choice.tool_deltas, unfinished=choice.tool_stream.unfinished)
            choice.content, choice.tool_calls = parsed.content, parsed.tool_calls
            choice.cut_in_tool_call = cut and parsed.unfinished
        else:
            choice.content = content
        tail.finished = True
        return tail


ChatInputs = tuple[list[dict[str, Any]], list[dict[str, Any]] | None]
"""What a chat turn's template renders: its messages (`ChatMessage.to_template`'s form) and the tools it offers."""


def chat_inputs(body: ChatCompletionRequest) -> ChatInputs:
    """What a chat request's template renders: its messages, and its tools unless `tool_choice` is none."""
    return [m.to_template() for m in body.messages], offered_tools(body)


def offered_tools(body: ChatSettings) -> list[dict[str, Any]] | None:
    """The tools a request's template renders: its tools, unless `tool_choice` is none."""
    if body.tools and body.tool_choice != "none":
        return [t.model_dump(exclude_none=True) for t in body.tools]
    return None


def _texts(content: Any) -> list[str]:
    """The texts of a message's content (string content, or its text parts): part of what its rendering holds."""
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        texts = (part.get("text") for part in content if isinstance(part, dict))
        return [text for text in texts if isinstance(text, str)]
    return []


def _token_id(tokenizer: ChatTokenizer, token: str) -> int:
    """The id of a parser's turn-ending token; a tokenizer without it as one token is a `ConfigError`."""
    ids = tokenizer.encode(token)
    if len(ids) != 1:
        raise ConfigError(f"the model's tokenizer has no token {token!r}, which its parsers need to end a turn")
    return ids[0]


def assistant_message(choice: Choice) -> dict[str, Any]:
    """The reply as the agent receives it (and echoes back next turn)."""
    message: dict[str, Any] = {"role": "assistant", "content": choice.content}
    if choice.reasoning is not None:
        message["reasoning_content"] = choice.reasoning
    if choice.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in choice.tool_calls
        ]
    return message


def _group_metadata(metadata: dict[str, str], group_id: str, size: int) -> dict[str, Any]:
    """The metadata every member of a group gets (its `group_index` besides): the request's, with the group's id and
    size. A `group_size` or `group_index` in the request that says otherwise is refused."""
    if metadata.get("group_size", str(size)) != str(size):
        raise InvalidRequest(
            f"metadata.group_size {metadata['group_size']!r} disagrees with the group's n = {size}", param="metadata"
        )
    if "group_index" in metadata:
        raise InvalidRequest("metadata.group_index is set per member of a group; leave it out", param="metadata")
    return {**metadata, "group_id": group_id, "group_size": size}


__all__ = [
    "ChatInputs",
    "Choice",
    "ChoiceEvent",
    "PreparedTurn",
    "TurnRunner",
    "assistant_message",
    "chat_inputs",
    "offered_tools",
]
