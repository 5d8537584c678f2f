"""One agent turn end to end: session → prompt ids → n generations (resume loop) → text, tool calls → Redis.

Every protocol's adapter maps its request to a `TurnRequest` (`gateway.turns.request`) and shapes the answer;
everything between lives here. The session side of a turn (lock, load, create, save, finish) is
`gateway.session.lifecycle`'s: `prepare` begins the turn (`SessionLifecycle.begin`, an `OpenTurn` that holds the
session's lock and the caller's slot), and closing it records the turn (`PreparedTurn.close`), so the turns of one
session never interleave in this process.

Session metadata. A request's metadata (str → str) reaches its session: the turn that creates the session stores it
as the session's metadata; a later turn adds the keys the session does not have yet, and a key the session holds
with another value is refused (400, `param` "metadata"), nothing stored (`metadata_additions`).

A group request's choices become the first turns of new sessions (`gateway.turns.group`).
"""

from __future__ import annotations

import random
from collections.abc import AsyncGenerator, Mapping
from typing import Any

from backends.base import SamplingParams
from gateway.errors import ConfigError, InvalidRequest, NotFound
from gateway.generation import GenerationRequest, GenerationState, Generator
from gateway.parsers import ReasoningParser, ToolParser
from gateway.request_ids import new_name
from gateway.session.lifecycle import SessionLifecycle, group_members, new_session_id
from gateway.session.open_turn import OpenTurn
from gateway.session.samples import Turn
from gateway.session.working_sample import WorkingSample, ids_array
from gateway.tokenization import ChatTokenizer, IncrementalDetokenizer, make_stop_checker
from gateway.tokenization.chat_template import template_arguments
from gateway.tokenization.token_ids import first_outside
from gateway.turns import choices as generating
from gateway.turns.group import group_metadata
from gateway.turns.prepared import Choice, ChoiceEvent, PreparedTurn
from gateway.turns.prompts import PromptEncoder, conversation_texts, text_prompt
from gateway.turns.request import Conversation, TextPrompt, TokenPrompt, TurnRequest, wrapped_seed

__all__ = ["MAX_RANDOM_SEED", "PROMPT_TAIL_TOKENS", "TurnRunner"]

MAX_RANDOM_SEED = 2**31 - 1
PROMPT_TAIL_TOKENS = 4  # the prompt's last tokens a reasoning parser sees (did the template open the reasoning?)


class TurnRunner:
    """Prepares and runs the turns of every protocol; `lifecycle` begins and closes them as turns of sessions."""

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
        chat_template_kwargs: Mapping[str, Any] | None = None,
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
        # The chat template's arguments every chat turn gets (`model.chat_template_kwargs`), a request's over them.
        self.chat_template_kwargs = dict(chat_template_kwargs) if chat_template_kwargs else None
        self.prompts = PromptEncoder(tokenizer, max_model_len, lambda: self.sessions.cache_size)

    def forget(self, session_id: str) -> None:
        """Drop what this process keeps of a finished session: its samples, its last raw prompt, its placement."""
        self.sessions.forget(session_id)
        self.prompts.forget(session_id)
        self.lifecycle.pool.forget(session_id)

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise NotFound(
                f"The model `{model}` does not exist; this gateway serves `{self.model_name}`", param="model"
            )

    # -- preparing -------------------------------------------------------------------------------------------

    async def prepare(self, request: TurnRequest, session_id: str | None, key: str) -> PreparedTurn:
        """Check and prepare a turn of `session_id` (None: a one-turn session) for the API key `key` (its key id: it
        takes a slot of the key, and a session another key created is a 404, `SessionLifecycle.begin`). The turn is
        open: its caller closes it (`PreparedTurn.close`), which records it. A request refused here stores nothing
        and holds nothing."""
        if request.model is not None:
            self.check_model(request.model)
        prompt = request.prompt
        if isinstance(prompt, Conversation):
            await self.prompts.check_fits(conversation_texts(prompt))
            kwargs = self.template_kwargs(prompt)
            if request.group:
                ids = await self.tokenizer.render_async(prompt.messages, prompt.tools, chat_template_kwargs=kwargs)
                return await self._prepare_group(request, session_id, key, ids, kwargs)
            return await self._prepare_one(request, session_id, key, template_kwargs=kwargs)
        ids = await self._prompt_ids(prompt, None if request.group else session_id)
        if request.group:
            return await self._prepare_group(request, session_id, key, ids)
        return await self._prepare_one(request, session_id, key, ids)

    def template_kwargs(self, conversation: Conversation) -> dict[str, Any] | None:
        """The chat template's arguments `conversation` renders with: the configured ones, the request's over them
        (a reserved name: 400)."""
        return template_arguments(self.chat_template_kwargs, conversation.template_kwargs)

    async def render(self, conversation: Conversation) -> list[int]:
        """The ids the chat template renders of `conversation` (with the generation prompt), once its texts are
        checked against the context (`PromptEncoder.check_fits`): what is rendered is bounded by the context's size."""
        await self.prompts.check_fits(conversation_texts(conversation))
        kwargs = self.template_kwargs(conversation)
        return await self.tokenizer.render_async(conversation.messages, conversation.tools, chat_template_kwargs=kwargs)

    async def _prompt_ids(self, prompt: TextPrompt | TokenPrompt, session_id: str | None) -> list[int]:
        """A raw completion's prompt as ids, checked (the caller's checked ids as they are)."""
        if isinstance(prompt, TokenPrompt) and prompt.checked:
            return prompt.ids
        if isinstance(prompt, TextPrompt):
            await self.prompts.check_fits(text_prompt(prompt.text))
            ids = await self.prompts.encode(prompt.text, session_id)
        else:
            ids = list(prompt.ids)
        if not ids:
            raise InvalidRequest("the prompt encodes to no tokens", param="prompt")
        bad = first_outside(ids, self.tokenizer.vocab_size)
        if bad is not None:
            raise InvalidRequest(f"token id {ids[bad]} is outside the vocabulary", param="prompt")
        return ids

    async def _prepare_one(
        self,
        request: TurnRequest,
        session_id: str | None,
        key: str,
        ids: list[int] | None = None,
        *,
        template_kwargs: dict[str, Any] | None = None,
    ) -> PreparedTurn:
        """A turn of one session: of a chat conversation, else of the prompt `ids`. Where these extend one of the
        session's samples (its prompt and response ids, then more), the turn continues that sample, the extension an
        environment span (loss mask 0); else a new sample starts in the session."""
        handle = await self.lifecycle.begin(session_id, key, kind=request.kind)
        async with handle.closed_on_error():
            sid, prompt = handle.session_id, request.prompt
            if isinstance(prompt, Conversation):
                turn = await self.sessions.begin_chat_turn(sid, prompt.messages, prompt.tools, template_kwargs)
            else:
                turn = await self.sessions.begin_completion_turn(sid, ids or [])
            await self.lifecycle.check_fresh(turn)  # a sample the staleness budget cut is not continued (410)
            turns = self.sessions.branch(turn, request.sampling.n)
            group = (request.metadata or {}).get("group_id") or (handle.meta.group_id if handle.meta else None)
            prepared = self._prepare(handle, turns, request, group)
            await self.lifecycle.create(handle, request.metadata)
            if group is not None:
                await self.lifecycle.join_group(handle, group, request.metadata)
            handle.adopt(prepared)
        return prepared

    async def _prepare_group(
        self,
        request: TurnRequest,
        session_id: str | None,
        key: str,
        ids: list[int],
        template_kwargs: dict[str, Any] | None = None,
    ) -> PreparedTurn:
        """The n choices of a group request as the first turns of n new sessions (`gateway.turns.group`)."""
        base = session_id or new_session_id(request.kind)
        size = request.sampling.n
        group_id = (request.metadata or {}).get("group_id", base)
        metadata = group_metadata(request.metadata or {}, group_id, size)
        members = group_members(base, size)
        handle = await self.lifecycle.begin_group(base, key, size, named=session_id is not None)
        async with handle.closed_on_error():
            prompt = request.prompt
            messages, tools = (prompt.messages, prompt.tools) if isinstance(prompt, Conversation) else ([], None)
            turns = [
                Turn(
                    member,
                    WorkingSample(0, ids_array(ids), tools=tools, template_kwargs=template_kwargs),
                    list(ids),
                    [],
                    messages,
                    new_sample=True,
                )
                for member in members
            ]
            prepared = self._prepare(handle, turns, request, group_id)
            prepared.group_id = group_id
            await self.lifecycle.create_group(handle, members, metadata)
            handle.adopt(prepared)
        return prepared

    def _prepare(
        self, handle: OpenTurn, turns: list[Turn], request: TurnRequest, group: str | None = None
    ) -> PreparedTurn:
        """The choices of `turns` (one per choice, all of one prompt), checked against the context length. A chat
        turn's text is split into reasoning and content (with a reasoning parser), and tool calls (with the tools
        it offers: the parser types text arguments by their schemas). `group`: the GRPO group of the session (its
        turns are placed with the group's)."""
        prompt_ids = turns[0].prompt_ids
        sampling = request.sampling
        room = self.max_model_len - len(prompt_ids)
        max_tokens = sampling.max_tokens if sampling.max_tokens is not None else room
        if max_tokens > room or room <= 0:
            raise InvalidRequest(
                f"{len(prompt_ids)} prompt tokens + max_tokens {max_tokens} exceed the context length "
                f"{self.max_model_len}",
                param="max_tokens",
            )
        prompt = request.prompt
        chat = isinstance(prompt, Conversation)
        tools = prompt.tools if isinstance(prompt, Conversation) else None
        reasoning = self.reasoning_parser if chat else None
        # Special tokens kept: `<think>` is one in most families' tokenizers.
        prompt_tail = self.tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:]) if reasoning is not None else ""
        parse_tools = tools is not None
        keep_special = (parse_tools and self.tool_parser.reads_special_tokens) or (
            reasoning is not None and reasoning.reads_special_tokens
        )
        format_stops = self._format_stop_ids if chat else ()
        silent = (*self.tokenizer.stop_token_ids, *sampling.stop_token_ids, *format_stops) if keep_special else ()
        choices = []
        for index, turn in enumerate(turns):
            generation = self._request(handle.session_id, turn, request, max_tokens, index, format_stops, group)
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, skip_special_tokens=not keep_special, stop=sampling.stop, silent_ids=silent
            )
            tool_stream = self.tool_parser.streaming(tools=tools) if parse_tools else None
            reasoning_stream = reasoning.streaming(prompt_tail) if reasoning is not None else None
            state = GenerationState(generation)
            choices.append(
                Choice(index, turn, generation, state, detokenizer, tool_stream, reasoning_stream, prompt_tail)
            )
        decoded = not (isinstance(prompt, TokenPrompt) and prompt.checked)
        return PreparedTurn(handle.session_id, handle.one_turn, choices, prompt_ids, handle, decoded=decoded)

    def _request(
        self,
        session_id: str,
        turn: Turn,
        request: TurnRequest,
        max_tokens: int,
        index: int,
        format_stops: tuple[int, ...] = (),
        group: str | None = None,
    ) -> GenerationRequest:
        """The generation of `turn`, placed as `session_id` (a group's members all as the group's session, so that
        their shared prompt lands on one replica's prefix cache), its sample written at every segment boundary."""
        s = request.sampling
        seed = wrapped_seed(s.seed + index) if s.seed is not None else None
        if seed is None and s.n > 1:
            seed = random.randint(0, MAX_RANDOM_SEED)  # distinct samples of one prompt, even on deterministic engines
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            seed=seed,
            stop_token_ids=tuple(dict.fromkeys((*s.stop_token_ids, *format_stops))),
            ignore_eos=s.ignore_eos,
            min_tokens=s.min_tokens,
            top_logprobs=s.top_logprobs,
            min_p=s.min_p,
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
        )
        want = request.want_routed_experts or self.want_routed_experts

        async def on_partial(state: GenerationState) -> None:
            await self.sessions.save(turn, self.sessions.partial(turn, state), final=False)

        return GenerationRequest(
            request_id=f"{turn.session_id}-{turn.sample.index}-{new_name()}",
            prompt_ids=turn.prompt_ids,
            sampling=sampling,
            session_id=session_id,
            want_routed_experts=want,
            stop=make_stop_checker(self.tokenizer, s.stop),
            stop_strings=s.stop,
            experts_start=turn.experts_start if want else 0,
            routed_experts=turn.sample.routed_experts if want else None,
            on_partial=on_partial,
            stream=request.stream,
            first_version=turn.sample.first_version,
            group_id=group,
        )

    # -- running ---------------------------------------------------------------------------------------------

    async def run(self, prepared: PreparedTurn) -> None:
        """Generate every choice to the end (non-streaming; `gateway.turns.choices.run`)."""
        await generating.run(self.generator, prepared)

    def events(self, prepared: PreparedTurn) -> AsyncGenerator[ChoiceEvent, None]:
        """Text and tool-call deltas of all choices as they arrive, then one `finished` event per choice."""
        return generating.events(self.generator, prepared)


def _token_id(tokenizer: ChatTokenizer, token: str) -> int:
    """The id of a parser's turn-ending token; a tokenizer without it as one token is a `ConfigError`."""
    ids = tokenizer.encode(token)
    if len(ids) != 1:
        raise ConfigError(f"the model's tokenizer has no token {token!r}, which its parsers need to end a turn")
    return ids[0]
