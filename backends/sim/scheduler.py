"""One data-parallel rank of the simulated engine: its running batch, waiting queue, KV blocks and prefix cache,
and the step loop that decodes the batch.

Two modes, chosen once from `EngineSettings.scheduled`:

- unbounded (no capacity setting): a request joins the batch once its own prefill delay has passed (in
  `SimEngine.submit`), every running request decodes each step, and a step takes `token_delay_s`;
- scheduled (`max_num_seqs`, `num_gpu_blocks` or `per_seq_delay_s` set): requests wait first come, first served
  in the rank's queue; each step admits from the head of the queue while the batch has room and the request's KV
  blocks fit, and takes `token_delay_s + per_seq_delay_s × batch + prefill_delay_s_per_token × tokens prefilled in
  the step`. The prefill is the batch's: a long prompt stalls every running request, as on a real engine.

With `num_gpu_blocks`, a running request holds ceil((prompt + output + 1) / block_size) blocks (room for the token
its next step writes); blocks it found in the prefix cache are shared (pinned) rather than copied. Cached blocks no
running request holds are free for the taking, least recently used first. When a running request needs a block and
none is left, the newest running request is preempted (vLLM) / retracted (SGLang): its KV is dropped and it goes
back to the head of the queue, to be recomputed at the prefill rate when it is admitted again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter, OrderedDict, deque
from typing import TYPE_CHECKING

from common.hashing import mix64

if TYPE_CHECKING:
    from backends.sim.engine import SimEngine, SimRequest


class Rank:
    """One scheduler behind the engine's server. The engine owns requests, pauses and weights; a rank owns where
    its requests are (waiting or running), their KV, its prefix cache and its step loop."""

    def __init__(self, engine: SimEngine, index: int, counters: Counter[str]) -> None:
        settings = engine.settings
        self.engine = engine
        self.index = index
        self.counters = counters
        self.scheduled = settings.scheduled
        self.kv = settings.num_gpu_blocks > 0
        self.running: dict[str, SimRequest] = {}  # in admission order: the last is the newest
        self.waiting: deque[SimRequest] = deque()  # scheduled mode only
        self.inflight = 0  # requests submitted to this rank and not yet retired
        self.cache: OrderedDict[int, int] = OrderedDict()  # block key -> weights key it was computed under
        self.pins: dict[int, int] = {}  # cached blocks running requests share -> how many (never evicted)
        self.private_blocks = 0  # blocks running requests hold outside the cache
        self.retracted: set[str] = set()  # unbounded mode: retracted by a pause or a flush, still in `running`
        self.recompute_tokens = 0  # unbounded mode: KV to recompute before the next step
        self.busy_s = 0.0  # scheduled mode: the modelled time of the steps run (counters: steps, batched_seqs)
        self.work = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    # -- load ------------------------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        """Requests in the decode batch (frozen ones too: they keep their KV)."""
        return len(self.running) - len(self.retracted)

    @property
    def num_waiting(self) -> int:
        """Requests queued, prefilling or retracted (not those held at admission by a pause)."""
        return self.inflight - self.num_running

    @property
    def num_preempted(self) -> int:
        """Requests that lost their KV and wait to recompute it."""
        return len(self.retracted) + sum(1 for r in self.waiting if r.preempted)

    @property
    def total_blocks(self) -> int:
        """KV capacity: `num_gpu_blocks`, or (unbounded) the prefix cache's bound."""
        settings = self.engine.settings
        return settings.num_gpu_blocks or settings.cache_blocks

    def used_blocks(self) -> int:
        """Blocks running requests hold (cached blocks nobody holds are free, as vLLM and SGLang count them)."""
        if self.kv:
            return self.private_blocks + len(self.pins)
        size = self.engine.settings.block_size
        return sum(-(-len(r.hashes) // size) for r in self.running.values() if r.engine_id not in self.retracted)

    def kv_usage(self) -> float:
        """Used blocks ÷ total, 0..1 (vLLM `kv_cache_usage_perc`, SGLang `token_usage`)."""
        return min(1.0, self.used_blocks() / self.total_blocks)

    def waiting_tokens(self) -> tuple[int, int]:
        """(tokens of the queued requests, of them not in the prefix cache)."""
        size = self.engine.settings.block_size
        total = uncached = 0
        for request in self.waiting:
            if request.preempted:
                total += len(request.hashes)
                uncached += len(request.hashes)
            else:
                total += len(request.prompt)
                uncached += len(request.prompt) - len(self.match(request)) * size
        return total, uncached

    # -- prefix cache ----------------------------------------------------------------------------------------

    def match(self, request: SimRequest) -> list[int]:
        """Keys of the leading full prompt blocks found in the cache; a real engine always recomputes the last
        prompt token. No side effects (a queued request is matched again when it is admitted)."""
        size = self.engine.settings.block_size
        keys: list[int] = []
        for block in range((len(request.prompt) - 1) // size):
            key = cache_key(request, (block + 1) * size - 1)
            if key not in self.cache:
                break
            keys.append(key)
        return keys

    def take_hits(self, request: SimRequest, keys: list[int]) -> int:
        """Use the matched blocks: sets `cached_tokens` and `stale_key`, counts the lookup; returns cached tokens."""
        wkey = self.engine.wkey
        stale = 0
        for key in keys:
            stored = self.cache[key]
            self.cache.move_to_end(key)
            if stored != wkey and not (request.salt_key and request.kept_through_pause):
                # KV computed under other weights and never flushed: outputs differ from a clean run. Except for a
                # salted request that was on its way when a `keep` pause began: its salt's KV is its own to keep,
                # as a kept request keeps its KV (the simulator draws a kept request's tokens as a clean run's).
                stale = mix64(stale ^ stored)
        request.cached_tokens = len(keys) * self.engine.settings.block_size
        request.stale_key = stale
        self.counters["prefix_cache_queries"] += len(request.prompt)
        self.counters["prefix_cache_hits"] += request.cached_tokens
        return request.cached_tokens

    def prefill_wkeys(self, request: SimRequest, cached: int) -> list[int]:
        size = self.engine.settings.block_size
        wkey = self.engine.wkey
        wkeys = [self.cache.get(cache_key(request, (p // size + 1) * size - 1), wkey) for p in range(cached)]
        wkeys.extend([wkey] * (len(request.prompt) - cached))
        return wkeys

    def store(self, request: SimRequest) -> None:
        """Cache the full blocks of what went through the model (prompt and output)."""
        size = self.engine.settings.block_size
        forwarded = len(request.forward_wkeys)
        for end in range(size, forwarded + 1, size):
            key = cache_key(request, end - 1)
            if key in self.cache:
                self.cache.move_to_end(key)
            else:
                self.cache[key] = request.forward_wkeys[end - 1]
        limit = self.engine.settings.cache_blocks
        if not self.kv:
            while len(self.cache) > limit:
                self.cache.popitem(last=False)
            return
        while len(self.cache) > limit or self.free_blocks < 0:
            self.evict_one()

    def clear_cache(self) -> None:
        """Drop every cached block nobody holds (all of them once nothing runs)."""
        if not self.pins:
            self.cache.clear()
            return
        for key in [key for key in self.cache if key not in self.pins]:
            del self.cache[key]

    # -- KV blocks (scheduled mode with `num_gpu_blocks`) ----------------------------------------------------

    @property
    def free_blocks(self) -> int:
        return self.engine.settings.num_gpu_blocks - self.private_blocks - len(self.cache)

    def room(self, blocks: int, pinning: int = 0) -> bool:
        """Whether `blocks` more fit, evicting unheld cached blocks (less the `pinning` that are about to be held)."""
        return self.free_blocks + len(self.cache) - len(self.pins) - pinning >= blocks

    def evict_one(self) -> None:
        """Drop the least recently used cached block nobody holds."""
        for key in self.cache:
            if key not in self.pins:
                del self.cache[key]
                self.counters["evicted_blocks"] += 1
                return
        raise RuntimeError("no evictable KV block (the simulator's block accounting is broken)")

    def take(self, blocks: int) -> None:
        while self.free_blocks < blocks:
            self.evict_one()
        self.private_blocks += blocks

    def hold(self, request: SimRequest, keys: list[int], blocks: int) -> None:
        for key in keys:
            self.pins[key] = self.pins.get(key, 0) + 1
        self.take(blocks - len(keys))
        request.shared_blocks = keys
        request.kv_blocks = blocks

    def release(self, request: SimRequest) -> None:
        """Give back the request's blocks (its shared ones stay cached, unheld if nobody else holds them)."""
        if not request.kv_blocks:
            return
        for key in request.shared_blocks:
            left = self.pins[key] - 1
            if left:
                self.pins[key] = left
            else:
                del self.pins[key]
        self.private_blocks -= request.kv_blocks - len(request.shared_blocks)
        request.shared_blocks = []
        request.kv_blocks = 0

    # -- scheduling (scheduled mode) -------------------------------------------------------------------------

    def blocks_for(self, tokens: int) -> int:
        size = self.engine.settings.block_size
        return -(-tokens // size)

    def schedule(self) -> int:
        """Reserve the next token's KV of every running request (preempting the newest when short), then admit
        from the head of the queue while there is room; returns the tokens prefilled in this step. Like vLLM, a
        step that preempted admits nothing."""
        if self.kv and self._reserve_running() and self.running:
            return 0
        cap = self.engine.settings.max_num_seqs
        prefill = 0
        while self.waiting and (not cap or len(self.running) < cap):
            tokens = self._admit(self.waiting[0])
            if tokens is None:
                break  # first come, first served: nothing overtakes the head of the queue
            self.waiting.popleft()
            prefill += tokens
        return prefill

    def _reserve_running(self) -> bool:
        preempted = False
        for request in list(self.running.values()):
            if request.engine_id not in self.running:
                continue  # preempted for an older request's block
            if self.blocks_for(len(request.hashes) + 1) <= request.kv_blocks:
                continue
            while not self.room(1):
                victim = next(reversed(self.running.values()))
                self.preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                self.take(1)
                request.kv_blocks += 1
        return preempted

    def _admit(self, request: SimRequest) -> int | None:
        """Move `request` into the batch if its KV fits; returns the tokens it prefills (None: it does not fit)."""
        if request.preempted:
            keys: list[int] = []
            blocks = self.blocks_for(len(request.hashes) + 1)
        else:
            keys = self.match(request)
            blocks = self.blocks_for(len(request.prompt) + 1)
        if self.kv:
            pinning = sum(1 for key in keys if key not in self.pins)
            if not self.room(blocks - len(keys), pinning):
                return None
        recompute = request.preempted
        if recompute:
            request.preempted = False
            tokens = self.engine.forget_kv(request)  # recomputed under the weights loaded now
        else:
            cached = self.take_hits(request, keys)
            request.forward_wkeys = self.prefill_wkeys(request, cached)
            tokens = len(request.prompt) - cached
        if self.kv:
            self.hold(request, keys, blocks)
            if not recompute:
                self.publish(request)
        self.running[request.engine_id] = request
        return tokens

    def publish(self, request: SimRequest) -> None:
        """Cache the full prompt blocks a request prefills once they are allocated, as vLLM does (it hashes a block
        when it allocates it; the KV is written before any attention reads it in the step): a request admitted
        after it, in the same step too, shares them instead of prefilling them again (GRPO siblings sent at once).
        They move from the request's private blocks to the cache, held (pinned) by it while it runs."""
        size = self.engine.settings.block_size
        shared = request.shared_blocks
        for block in range(len(shared), len(request.prompt) // size):
            end = (block + 1) * size - 1
            key = cache_key(request, end)
            if key in self.cache:
                continue  # cached after a gap: this request's copy stays private
            self.cache[key] = request.forward_wkeys[end]
            self.pins[key] = 1
            shared.append(key)
            self.private_blocks -= 1

    def preempt(self, request: SimRequest) -> None:
        """Drop the request's KV and put it back at the head of the queue (recomputed when admitted again)."""
        self.release(request)
        del self.running[request.engine_id]
        request.preempted = True
        request.num_retractions += 1
        self.waiting.appendleft(request)
        self.counters["retractions"] += 1

    def preempt_all(self) -> int:
        """Preempt every running request (a retract pause, a flush that resets running requests)."""
        running = list(self.running.values())
        for request in reversed(running):  # newest first, so the queue keeps their order
            self.preempt(request)
        return len(running)

    # -- the step loop ---------------------------------------------------------------------------------------

    def wake(self) -> None:
        engine = self.engine
        if (self.running or self.waiting) and not engine.frozen and not engine.stalled:
            self.work.set()

    def start(self) -> None:
        if self.task is None:
            # Hard reference: a task only referenced by the loop may be garbage-collected mid-flight.
            self.task = asyncio.create_task(self._loop(), name=f"sim-step-loop-{self.index}")

    async def _loop(self) -> None:
        engine = self.engine
        while True:
            await self.work.wait()
            if engine.frozen or engine.stalled or not (self.running or self.waiting):
                self.work.clear()
                continue
            if self.scheduled:
                await self._scheduled_step()
                continue
            if self.recompute_tokens:
                # Requests that lost their KV recompute it before the batch steps on: a prefill that stalls every
                # request of the batch, at the prefill rate.
                tokens, self.recompute_tokens = self.recompute_tokens, 0
                await asyncio.sleep(tokens * engine.settings.prefill_delay_s_per_token)
                continue
            self.step()
            delay = engine.settings.token_delay_s
            await asyncio.sleep(delay if delay > 0 else 0)

    async def _scheduled_step(self) -> None:
        prefill = self.schedule()
        if not self.running:
            self.work.clear()  # nothing fits until a request leaves (its retirement wakes the loop)
            return
        settings = self.engine.settings
        batch = len(self.running)
        seconds = (
            settings.token_delay_s + settings.per_seq_delay_s * batch + settings.prefill_delay_s_per_token * prefill
        )
        await asyncio.sleep(seconds if seconds > 0 else 0)
        if self.engine.frozen or self.engine.stalled:
            return  # paused mid-step: the batch keeps its KV and decodes once resumed
        counters = self.counters
        counters["batched_seqs"] += batch
        counters["prefill_tokens"] += prefill
        self.busy_s += seconds
        self.step()

    def step(self) -> None:
        engine = self.engine
        wkey = engine.wkey
        version = engine.version
        retracted = self.retracted
        for request in list(self.running.values()):
            if retracted and request.engine_id in retracted:
                continue
            engine.decode_one(request, wkey, version, self.counters)
            if request.finished:
                self.retire(request)
        self.counters["steps"] += 1

    def retire(self, request: SimRequest) -> None:
        """The request left (finished or aborted): free its KV, cache what it computed, tell the engine."""
        if self.running.pop(request.engine_id, None) is None and self.waiting:
            with contextlib.suppress(ValueError):  # aborted while queued
                self.waiting.remove(request)
        self.retracted.discard(request.engine_id)
        if request.preempted:
            request.preempted = False  # its KV is gone: nothing to cache
        else:
            self.release(request)
            self.store(request)
        self.inflight -= 1
        self.counters[f"finished_{request.finish_reason}"] += 1
        self.engine.forget(request)
        self.wake()  # its blocks and its batch slot may admit a queued request


def cache_key(request: SimRequest, position: int) -> int:
    """The prefix-cache key of `request`'s prefix up to `position`: its hash, in the request's salt partition."""
    prefix = request.hashes[position]
    return prefix if not request.salt_key else mix64(prefix ^ request.salt_key)
