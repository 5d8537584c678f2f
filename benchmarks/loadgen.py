"""The load generator of `benchmarks.compare`: a separate process, loopback only, bounded in requests and time.

    python -m benchmarks.loadgen < spec.json      # one JSON spec on the first line of stdin

Protocol (line-delimited JSON on stdin/stdout, so the parent can read the proxy's CPU around the timed part only):

1. the parent writes the spec (one line);
2. this process opens one keep-alive connection per agent and warms up (every connection used at least once),
   then prints `{"event": "warm"}`;
3. the parent reads the proxy's CPU time and writes `go`;
4. this process runs the timed part (`requests`, or `turns` per session; no new request after `duration_s`) and
   prints `{"event": "result", ...}` (latencies, tokens, errors, its own CPU seconds), then exits.

Requests (`api` in the spec):

* `completions` (default): `POST /v1/completions` with a text prompt, `temperature 0`, `ignore_eos` and a token budget
  (text, not token ids: sglang-router 0.3.2 refuses token-id prompts on this route, "data did not match any variant
  of untagged enum StringOrArray"), so each answer must carry exactly that many tokens (`usage.completion_tokens`,
  `finish_reason == "length"`); `generate`: this gateway's token-in/token-out `POST /generate`, checked the same way;
* `chat`, `messages`, `responses`: an agent's session on OpenAI chat completions, Anthropic Messages or OpenAI
  Responses (`benchmarks.agent_protocols`: the request shapes and answer checks): every turn sends the conversation
  so far, the previous replies included, and a new user message (`chained` Responses: only the new message and the
  previous response's id); a session whose turn failed ends there.

An answer that fails its check, any non-200 answer or I/O error, is counted as an error (with a sample of messages),
never dropped. Every request carries the session both as `X-Session-ID` (this gateway on every route, vllm-router)
and as `X-SMG-Routing-Key` (sglang-router's `manual` policy), unless the spec says `one_turn` (no session at all: this
gateway makes each request a one-turn session and delivers it as a trajectory). With `echo` (the agent-shaped
workloads), a `completions` turn's prompt also carries the previous reply, so a relay sees the same growing
conversation as the agent protocols.

Shapes for `benchmarks.routing`: an agent's sessions can open with one system prompt shared by the run
(`system_words`), last a random number of turns (`episode_turns` to `episode_turns_max`), start part-way (`aged`: the
first session joins at a random turn, the earlier turns already in its prompt), wait between turns (`think_s`, a tool
call) and start spread out (`start_spread_s`). With `group_size`, the process sends GRPO groups instead of sessions
(`LoadGen.run_groups`): bursts of `sessions` groups, each `group_size` requests with one prompt, all at once, each
group named by the path (this gateway) or by the session headers (the routers; `group_route`); every group's time,
its burst to its last answer, is in the result's `group_times`. `warmup: 0` skips the warm-up.

The HTTP client is a minimal HTTP/1.1 keep-alive client over asyncio streams (content-length and chunked bodies):
on a 2-core machine the load generator shares a core with the simulator replicas, and httpx costs several
times more CPU per request, which would cap every target at the load generator's speed.

Prompts (and an agent session's first user message) start with the session id (`bench-<run tag>-<n> `), so the
replicas' prompt logs (`/sim/prompt_log`, decoded with the same tokenizer; `session_of` finds it after a chat
template's preamble) tell which session each request belonged to, and runs never share prefix-cache blocks.
"""

from __future__ import annotations

import asyncio
import math
import random
import re
import sys
import time
import zlib
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import orjson
import uvloop

from benchmarks.agent_protocols import AGENT_APIS, HEADERS, PATHS, AnswerError, Conversation, Pieces, Reply
from benchmarks.agent_protocols import read_answer as read_agent_answer
from benchmarks.agent_protocols import request_body as agent_body
from benchmarks.agent_protocols import sse_events as sse_data

WORDS = (
    "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river stone cloud forest ember harbor "
    "signal vector matrix tensor kernel buffer socket thread packet router engine replica session rollout"
).split()
SESSION_PATTERN = re.compile(r"bench-(\d+)-(\d+) ")


def session_name(tag: int, session: int) -> str:
    """The session id of agent `session` in run `tag`; every prompt starts with it (see `session_of`)."""
    return f"bench-{tag}-{session}"


def session_of(prompt_head: str) -> tuple[int, int] | None:
    """(run tag, session number) from the decoded start of a prompt, as the replicas logged it (after a chat
    template's preamble, where there is one)."""
    match = SESSION_PATTERN.search(prompt_head)
    return (int(match[1]), int(match[2])) if match else None


@dataclass
class Spec:
    """What one load-generator process runs (the JSON spec's fields)."""

    urls: list[str]  # one: a proxy; several: direct, each session on urls[crc32(session) % len]
    tag: int  # run tag: part of every prompt head and session name
    sessions: int  # agents, each one session, all running at once
    turns: int  # requests per session in the timed part (0: as many as `requests` allows)
    requests: int  # total requests in the timed part when turns == 0
    min_tokens: int
    max_tokens: int
    stream: bool
    prompt_words: int = 16  # first turn's prompt length (after the session id); later turns append `append_words`
    append_words: int = 16
    grow: bool = False  # multi-turn: each turn's prompt extends the previous turn's prompt
    warmup: int = 1  # requests per agent before "warm" (on separate sessions: tag + 1)
    timeout_s: float = 120.0
    seed: int = 0
    api: str = "completions"  # or "generate" (this gateway's token-in/token-out route), or one of AGENT_APIS
    duration_s: float = 0.0  # > 0: no new request starts after this long (the bound in time besides `requests`)
    one_turn: bool = False  # name no session: every request is a one-turn session of its own in this gateway
    echo: bool = False  # `completions` with `grow`: each prompt also carries the previous reply (agent-shaped)
    chained: bool = False  # `responses`: a turn sends only its new message and the previous response's id
    episode_turns: int = 0  # > 0 (with `turns == 0`): an agent's session ends after this many turns and a new one
    # (another session number, a new conversation) goes on: an RL rollout's episodes, a context that stays bounded
    episode_turns_max: int = 0  # > episode_turns: each episode's length is drawn in [episode_turns, this]
    aged: bool = False  # an agent's first episode starts at a random turn of its length, the earlier turns' history
    # (filler words for the replies) already in its prompt: the run sees the mix of a steady state from its start
    system_words: int = 0  # every session's conversation opens with one system prompt of this many words (per run)
    think_s: tuple[float, float] = (0.0, 0.0)  # an agent's wait between its turns (a tool call), drawn in this range
    start_spread_s: float = 0.0  # each agent starts after a random delay in [0, this)
    group_size: int = 0  # > 0: GRPO groups instead of sessions (`LoadGen.run_groups`)
    bursts: int = 1  # groups: how many bursts of `sessions` groups, ...
    burst_interval_s: float = 1.0  # ... one this long after the other (open loop: none waits for the previous)
    group_route: str = "path"  # how a group member names its group: "path" (this gateway: `/sessions/grp-<group>-
    # <i>of<n>/v1/completions`, each member a session of the group) or "key" (the routers: the group id as the
    # session headers, `X-Session-ID` and `X-SMG-Routing-Key`; they see no groups)

    def __post_init__(self) -> None:
        if self.api not in ("completions", "generate", *AGENT_APIS):
            raise ValueError(f"unknown api {self.api!r}")
        if self.echo and self.api == "generate":
            raise ValueError("echo needs a text route (generate sends token ids)")
        if self.chained and self.api != "responses":
            raise ValueError("chained turns are the Responses API's (previous_response_id)")
        if self.group_size and (self.api != "completions" or self.group_route not in ("path", "key")):
            raise ValueError("groups are sent on /v1/completions, named by the path or by the session headers")
        self.think_s = (float(self.think_s[0]), float(self.think_s[1]))


@dataclass
class Result:
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    tokens: int = 0
    ok: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    group_times: list[float] = field(default_factory=list)  # groups: each group's burst → its last member's answer

    def error(self, message: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 5:
            self.error_samples.append(message[:300])


class Connection:
    """One keep-alive HTTP/1.1 connection (reopened after the server closes it)."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.reader is None or self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port, limit=1 << 20)
        return self.reader, self.writer

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, Pieces]:
        """Send one POST; return (status, [(arrival time, body piece)]): one piece per chunk (or the whole body)."""
        reader, writer = await self._open()
        head = [f"POST {path} HTTP/1.1", f"Host: {self.host}:{self.port}", f"Content-Length: {len(body)}"]
        head += ["Content-Type: application/json", *(f"{k}: {v}" for k, v in headers.items())]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        try:
            status_line = await reader.readuntil(b"\r\n")
        except asyncio.IncompleteReadError:  # a stale keep-alive connection: reopen once
            self.close()
            reader, writer = await self._open()
            writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
            status_line = await reader.readuntil(b"\r\n")
        status = int(status_line.split(b" ", 2)[1])
        length, chunked, close = None, False, False
        while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
            elif name == b"connection" and b"close" in value.lower():
                close = True
        pieces: Pieces = []
        if chunked:
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    await reader.readuntil(b"\r\n")
                    break
                data = await reader.readexactly(size + 2)
                pieces.append((time.perf_counter(), data[:-2]))
        elif length is not None:
            pieces.append((time.perf_counter(), await reader.readexactly(length)))
        else:
            pieces.append((time.perf_counter(), await reader.read()))
            close = True
        if close:
            self.close()
        return status, pieces


def check_generate(pieces: Pieces, stream: bool, budget: int) -> tuple[int, float | None]:
    """`POST /generate` answers: `output_ids` (in one body, or in stream events) and `finish_reason`."""
    if not stream:
        answer = orjson.loads(b"".join(p for _, p in pieces))
        tokens, finish, first = len(answer["output_ids"]), answer["finish_reason"], None
    else:
        tokens, finish, first = 0, None, None
        for now, data in sse_data(pieces):
            if "error" in data:
                raise AnswerError(f"stream error: {str(data['error'])[:200]}")
            if "finish_reason" in data:
                finish = data["finish_reason"]
            elif data.get("output_ids"):
                first = first or now
                tokens += len(data["output_ids"])
    if finish != "length" or tokens != budget:
        raise AnswerError(f"asked {budget} tokens, got {tokens} (finish_reason {finish!r})")
    return tokens, first


def check_answer(status: int, pieces: Pieces, stream: bool, budget: int, api: str = "completions") -> Reply:
    """The reply of a valid answer (tokens, first-token time, text); raises AnswerError saying what is wrong."""
    if api in AGENT_APIS:
        return read_agent_answer(api, status, pieces, stream, budget)
    if status != 200:
        raise AnswerError(f"HTTP {status}: {b''.join(p for _, p in pieces)[:200]!r}")
    if api == "generate":
        return Reply(*check_generate(pieces, stream, budget), text="")
    if not stream:
        answer = orjson.loads(pieces[0][1] if len(pieces) == 1 else b"".join(p for _, p in pieces))
        choice = answer["choices"][0]
        tokens = int(answer["usage"]["completion_tokens"])
        if choice["finish_reason"] != "length" or tokens != budget:
            raise AnswerError(f"asked {budget} tokens, got {tokens} (finish_reason {choice['finish_reason']!r})")
        return Reply(tokens, None, choice["text"])
    first, finish, usage, text = None, None, None, []
    for now, data in sse_data(pieces):
        if "error" in data:
            raise AnswerError(f"stream error: {str(data['error'])[:200]}")
        if data.get("choices"):
            first = first or now
            finish = data["choices"][0].get("finish_reason") or finish
            text.append(data["choices"][0]["text"])
        if data.get("usage"):
            usage = int(data["usage"]["completion_tokens"])
    if finish != "length" or usage != budget:
        raise AnswerError(f"asked {budget} tokens, streamed usage {usage} (finish_reason {finish!r})")
    return Reply(budget, first, "".join(text))


class LoadGen:
    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.rng = random.Random(spec.seed)
        self.filler = [self.rng.choice(WORDS) for _ in range(4096)]
        self.tokenizer: Any = None
        if spec.api == "generate":  # token ids in: the gateway's own tiny tokenizer, as the replicas use
            from tokenizers import Tokenizer

            from gateway.config import DEFAULT_TOKENIZER

            self.tokenizer = Tokenizer.from_file(str(DEFAULT_TOKENIZER / "tokenizer.json"))
        self.path = PATHS.get(spec.api) or ("/generate" if spec.api == "generate" else "/v1/completions")

    def url_of(self, session: str) -> str:
        urls = self.spec.urls
        return urls[zlib.crc32(session.encode()) % len(urls)]

    def headers(self, session: str) -> dict[str, str]:
        """The session as this gateway and the routers read it, from a header (none with `one_turn`), and the
        protocol's own headers (an agent protocol's API key and version)."""
        session_headers = {} if self.spec.one_turn else {"X-Session-ID": session, "X-SMG-Routing-Key": session}
        return session_headers | HEADERS.get(self.spec.api, {})

    def body(self, session: str, conversation: Conversation, budget: int, previous: str | None = None) -> bytes:
        """An agent protocol's turn (`previous`: the response a chained Responses turn follows), or (`completions`,
        `generate`) the conversation's texts as one prompt."""
        if self.spec.api in AGENT_APIS:
            return orjson.dumps(agent_body(self.spec.api, conversation, budget, self.spec.stream, previous))
        prompt = "\n".join(text for _, text in conversation)
        if self.spec.api == "generate":
            ids = self.tokenizer.encode(prompt, add_special_tokens=False).ids
            sampling = {"max_tokens": budget, "temperature": 0, "ignore_eos": True}
            tokens: dict[str, Any] = {"input_ids": ids, "sampling_params": sampling, "stream": self.spec.stream}
            if not self.spec.one_turn:
                tokens["session_id"] = session
            return orjson.dumps(tokens)
        body: dict[str, Any] = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": budget,
            "temperature": 0,
            "ignore_eos": True,
            "stream": self.spec.stream,
        }
        if self.spec.stream:
            body["stream_options"] = {"include_usage": True}
        return orjson.dumps(body)

    async def one(
        self,
        conn: Connection,
        session: str,
        conversation: Conversation,
        budget: int,
        result: Result,
        previous: str | None = None,
        path: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> Reply | None:
        """One request, counted in `result`: the reply, or None where it failed. `path` and `headers` replace the
        route's and the session's (a group member's)."""
        started = time.perf_counter()
        try:
            body = self.body(session, conversation, budget, previous)
            status, pieces = await conn.post(
                path or self.path, body, self.headers(session) if headers is None else headers
            )
            reply = check_answer(status, pieces, self.spec.stream, budget, self.spec.api)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, KeyError) as exc:
            conn.close()
            result.error(f"{type(exc).__name__}: {exc}")
            return None
        except AnswerError as exc:
            result.error(str(exc))
            return None
        result.latencies.append(time.perf_counter() - started)
        if reply.first is not None:
            result.ttfts.append(reply.first - started)
        result.tokens += reply.tokens
        result.ok += 1
        return reply

    def budget(self) -> int:
        return self.rng.randint(self.spec.min_tokens, self.spec.max_tokens)

    def words(self, start: int, count: int) -> str:
        return " ".join(self.filler[(start + i) % len(self.filler)] for i in range(count))

    def episode_length(self) -> int:
        low, high = self.spec.episode_turns, self.spec.episode_turns_max
        return self.rng.randint(low, high) if high > low else low

    async def agent(
        self, tag: int, number: int, turns: int, remaining: list[int], result: Result, until: float
    ) -> None:
        """One session (with `episode_turns`, one after another): its turns one after the other; with `grow`, each
        turn's conversation is the previous one, its reply (agent protocols, `echo`) and `append_words` more words
        from the user."""
        spec = self.spec
        session = session_name(tag, number)
        conn = Connection(self.url_of(session))
        offset = (number * 7919) % 2048
        system = [("system", f"system {tag} " + self.words(0, spec.system_words))] if spec.system_words else []

        def opening(session: str) -> Conversation:
            return [*system, ("user", f"{session} " + " ".join(self.filler[offset : offset + spec.prompt_words]))]

        conversation = opening(session)
        with_replies = spec.api in AGENT_APIS or spec.echo
        previous: str | None = None  # the response a chained turn follows
        episode, ends = 0, self.episode_length()
        if spec.aged and ends > 1:  # the first episode joins at a random turn, its history so far in the prompt
            done = self.rng.randrange(ends)
            for step in range(done):
                conversation.append(("assistant", self.words(offset + 97 * step, spec.max_tokens // 3)))
                conversation.append(("user", self.words(offset + 89 * step, spec.append_words)))
            ends -= done
        if spec.start_spread_s > 0:
            await asyncio.sleep(self.rng.uniform(0, spec.start_spread_s))
        try:
            turn = 0
            while ((turns and turn < turns) or (not turns and remaining[0] > 0)) and time.perf_counter() < until:
                if turn and spec.think_s[1] > 0:  # the agent's tool call between two turns
                    await asyncio.sleep(self.rng.uniform(*spec.think_s))
                    if time.perf_counter() >= until:
                        break
                if not turns:
                    remaining[0] -= 1
                    if spec.episode_turns and turn and turn == ends:  # the next episode
                        episode += 1
                        session = session_name(tag, number + episode * spec.sessions)
                        conversation, previous = opening(session), None
                        ends = turn + self.episode_length()
                reply = await self.one(conn, session, conversation, self.budget(), result, previous)
                turn += 1
                if reply is None and with_replies:
                    break  # the conversation cannot go on without its reply
                if spec.grow:
                    start = (offset + spec.prompt_words + turn * spec.append_words) % 2048
                    previous = reply.response_id if reply is not None and spec.chained else None
                    if with_replies:
                        conversation.append(("assistant", reply.text if reply is not None else ""))
                    conversation.append(("user", " ".join(self.filler[start : start + spec.append_words])))
        finally:
            conn.close()

    async def run(self, tag: int, turns: int, requests: int, duration_s: float = 0.0) -> Result:
        result = Result()
        remaining = [requests]
        started = time.perf_counter()
        until = started + duration_s if duration_s > 0 else math.inf
        try:
            async with asyncio.timeout(self.spec.timeout_s):
                async with asyncio.TaskGroup() as group:
                    for number in range(self.spec.sessions):
                        group.create_task(self.agent(tag, number, turns, remaining, result, until))
        except TimeoutError:  # the bound in time: what finished is kept, the cut-off is an error
            result.error(f"deadline: the run passed {self.spec.timeout_s:g} s and was cut off")
        result.wall_s = time.perf_counter() - started
        return result

    async def run_groups(self, tag: int, bursts: int, groups: int) -> Result:
        """GRPO-shaped load: `bursts` bursts of `groups` groups, `burst_interval_s` apart; each group is
        `group_size` requests with one prompt (`prompt_words` words, its own per group), all sent at its burst.
        Each group's time (its burst → its last member's answer) goes to `group_times` where every member answered."""
        spec = self.spec
        result = Result()
        started = time.perf_counter()

        async def member(group: str, prompt: Conversation, index: int) -> bool:
            session = f"grp-{group}-{index}of{spec.group_size}"
            if spec.group_route == "path":
                url, path, headers = spec.urls[0], f"/sessions/{session}/v1/completions", {}
            else:
                key = f"grp-{group}"
                url, path, headers = self.url_of(key), None, {"X-Session-ID": key, "X-SMG-Routing-Key": key}
            conn = Connection(url)
            try:
                return (
                    await self.one(conn, session, prompt, self.budget(), result, path=path, headers=headers) is not None
                )
            finally:
                conn.close()

        async def group(number: int, at: float) -> None:
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            name = f"{tag}x{number}"
            prompt: Conversation = [("user", f"group {name} " + self.words(number * 7919, spec.prompt_words))]
            sent = time.perf_counter()
            answered = await asyncio.gather(*(member(name, prompt, i) for i in range(spec.group_size)))
            if all(answered):
                result.group_times.append(time.perf_counter() - sent)

        try:
            async with asyncio.timeout(spec.timeout_s), asyncio.TaskGroup() as tasks:
                for burst in range(bursts):
                    at = started + burst * spec.burst_interval_s
                    for index in range(groups):
                        tasks.create_task(group(burst * groups + index, at))
        except TimeoutError:
            result.error(f"deadline: the run passed {spec.timeout_s:g} s and was cut off")
        result.wall_s = time.perf_counter() - started
        return result


async def main_async() -> int:
    spec = Spec(**orjson.loads(sys.stdin.readline()))
    gen = LoadGen(spec)
    loop = asyncio.get_running_loop()
    if not spec.warmup:
        warm = Result()
    elif spec.group_size:  # one group (its own prompt) opens the way
        warm = await gen.run_groups(spec.tag + 1, 1, 1)
    else:
        warm = await gen.run(spec.tag + 1, spec.warmup, 0)  # other sessions, so the timed turns start fresh
    print(orjson.dumps({"event": "warm", "errors": warm.errors, "error_samples": warm.error_samples}).decode())
    sys.stdout.flush()
    if (await loop.run_in_executor(None, sys.stdin.readline)).strip() != "go":
        return 1
    cpu0 = time.process_time()
    if spec.group_size:
        result = await gen.run_groups(spec.tag, spec.bursts, spec.sessions)
    else:
        result = await gen.run(spec.tag, spec.turns, spec.requests, spec.duration_s)
    # Its own CPU time of the timed part (all threads): read from /proc by the parent, it would race this exit.
    out = {"event": "result", **result.__dict__, "cpu_loadgen_s": time.process_time() - cpu0}
    sys.stdout.write(orjson.dumps(out).decode() + "\n")
    sys.stdout.flush()
    return 0


def main() -> int:
    return uvloop.run(main_async())


if __name__ == "__main__":
    sys.exit(main())
