"""The scheduler coroutine: waiting queue -> prefill -> decode rows of the native loop -> finish.

Threads: the event loop runs this scheduler and the loop-fd reader; the native loop thread
calls `decode_step`; prefill chunks run on a one-thread executor. The batch (rows, and the
Sequence <-> pool-id map the step reads) changes only while the loop is parked.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from .. import native, telemetry
from ..config import PAGE_SIZE
from ..megakernel import copy_to_host
from .config import EngineConfig
from .gpu_sampling import DrawParams, GpuSampler, draw_params
from .metrics import EngineMetrics
from .prompt_logprobs import PromptScorer
from .runner import TorchRunner
from .sampling import sample_rows
from .sequence import RequestState, Sequence, SeqStatus
from .types import EngineDead, TokenLogprob

log = telemetry.get_logger("northmk.engine")


class Scheduler:
    close_park_timeout_s = 30.0  # close() destroys a loop that has not parked by then

    def __init__(self, config: EngineConfig, runner: TorchRunner, pool: native.KVPool,
                 metrics: EngineMetrics, eos_ids: tuple[int, ...], device_sampler: GpuSampler | None = None):
        self.config = config
        self.runner = runner
        self.device_sampler = device_sampler  # None: every step samples on the host
        self.pool = pool
        self.metrics = metrics
        self.eos_ids = eos_ids
        self.groups = range(len(runner.config.attention_groups))
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.rows: dict[int, Sequence] = {}  # slot -> running sequence
        self.by_kv: dict[int, Sequence] = {}  # pool id -> sequence holding KV
        self.requests: dict[str, RequestState] = {}
        self.free_slots = list(range(config.max_batch))
        self.loop = native.DecodeLoop(pool, self.decode_step, max_rows=config.max_batch)
        self.fd = self.loop.fileno()
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="northmk-prefill")
        self.wake = asyncio.Event()
        self.dead: BaseException | None = None
        self.stopping = False
        self._loop_running = False
        self._park_waiters: list[asyncio.Future] = []
        self._loop_no_space = False
        self._ahead: _DeviceStep | None = None  # the step enqueued ahead by the last decode_step
        self._epoch = 0  # parks so far: a step enqueued before a park is not used after it
        self._park_wanted = False  # park() asked the loop to park: a step enqueued ahead now would be dropped
        # The request at the head of the queue that found no pages, and the pages then available:
        # it is tried again once more are (each try parks the loop, which then makes no progress).
        self._blocked: tuple[Sequence, int] | None = None
        # _host_buffer's, allocated once before the first step rather than a pinned tensor per step
        self._host_buffers = [torch.empty(2 * config.max_batch, dtype=torch.int32, pin_memory=True)
                              for _ in range(2)] if device_sampler is not None and runner.kv.pages[0].is_cuda else []
        self._enqueued = 0
        self._copies: torch.cuda.Stream | None = None  # the stream of the tokens' copies to the host
        self.ahead_steps_taken = 0  # steps enqueued ahead whose tokens were used
        self.ahead_rows_dropped = 0  # rows of steps enqueued ahead whose tokens were not used
        self.ahead_pages_reserved = 0  # rows of steps enqueued ahead whose next position started a page
        self.greedy_rows_undrawn = 0  # rows of device steps whose tokens were the step's own greedy ones

    # ---- the loop thread ----------------------------------------------------------------
    def decode_step(self, batch: native.StepInput) -> tuple[list[int], list[float]]:
        """One decode step for the loop's rows: the model, then sampling (on the device when
        every row can draw there, else per row on the host).

        On the device the step after this one is enqueued before this one's tokens are waited
        for (when every row can draw it there and has a page for its next position, which the
        pool gives ahead where it starts a page): its input is this step's
        sampled tokens, already on the device, so the device runs the steps back to back while
        the host publishes. The next call uses it when its batch is those rows at those
        positions, and drops it otherwise."""
        seqs = [self.by_kv[int(s)] for s in batch.seqs]
        params = self._device_draw_params(seqs)
        if params is None:
            if self._ahead is not None:  # enqueued before a park that brought a row needing the host
                self._ahead = self._dropped(self._ahead)
            logits = self.runner.decode(batch.tokens.tolist(), batch.positions.tolist(), self._tables_of(batch.slots))
            results = sample_rows(logits, [s.sampler for s in seqs])
        else:
            step = self._take_ahead(batch)
            if step is None:
                positions = batch.positions.tolist()
                tables = self.runner.device_tables(self._tables_of(batch.slots), positions)
                step = self._enqueue(seqs, batch.seqs.tolist(), positions, params,
                                     torch.from_numpy(batch.tokens.astype(np.int32)), tables)
            ahead = self.config.decode_ahead and not self._park_wanted
            self._ahead = self._enqueue_ahead(step, seqs, batch.slots) if ahead else None
            results = step.results()
        for seq, (token, lp) in zip(seqs, results):
            seq.output_ids.append(token)
            seq.pending_logprobs.append(lp)
        return [t for t, _ in results], [lp.logprob if lp else math.nan for _, lp in results]

    def _tables_of(self, slots: np.ndarray) -> list[torch.Tensor]:
        """The block tables of the loop's rows at `slots`, copied out of the pool's."""
        index = torch.from_numpy(slots.astype(np.int64))
        return [torch.from_numpy(self.pool.block_table(g))[index] for g in self.groups]

    def _device_draw_params(self, seqs: list[Sequence], ahead: int = 0) -> list[DrawParams] | None:
        """Every row's device draw, or None when there is no device sampler or a row needs the
        host (a processor the device lacks, or top-logprob alternatives)."""
        if self.device_sampler is None:
            return None
        params = [draw_params(s.sampler, ahead) for s in seqs]
        return None if None in params else params

    def _enqueue(self, seqs: list[Sequence], ids: list[int], positions: list[int], params: list[DrawParams],
                 tokens: torch.Tensor, tables: list[torch.Tensor]) -> "_DeviceStep":
        """The model and the draw on the device, and the tokens' copy to the host; nothing waits.
        tokens int32 [B] (host, or the device's from the step before), tables on the device.
        When every row is greedy and none wants its logprob, the tokens are the ones the step
        itself reduced from the logits where the backend computes them (the megakernel's), and
        no sampler runs."""
        want = [s.sampler.params.logprobs is not None for s in seqs]
        if all(p.temperature <= 0 for p in params) and not any(want):
            logits, drawn = self.runner.decode_greedy_on_device(tokens, positions, tables)
        else:
            logits, drawn = self.runner.decode_on_device(tokens, positions, tables), None
        if drawn is None:
            drawn, logprobs = self.device_sampler.draw(logits, params)
        else:
            self.greedy_rows_undrawn += len(seqs)
        both = torch.cat((drawn, logprobs.view(torch.int32))) if any(want) else drawn
        host, done = both, None
        if both.is_cuda:  # on a stream of its own, so that nothing sits between two steps' kernels
            if self._copies is None:
                self._copies = torch.cuda.Stream(both.device)
            host = self._host_buffer()[:len(both)]
            done = copy_to_host(both, host, self._copies)
        return _DeviceStep(ids, positions, tables, drawn, host, done, want, self._epoch)

    def _host_buffer(self) -> torch.Tensor:
        """Pinned memory for an enqueued step's tokens and logprobs, two buffers in turn: when a
        step is enqueued, the step enqueued two before it has been waited for and read (or
        dropped, its copy ordered before this one's on the copy stream)."""
        self._enqueued += 1
        return self._host_buffers[self._enqueued % 2]

    def _enqueue_ahead(self, step: "_DeviceStep", seqs: list[Sequence], slots: np.ndarray) -> "_DeviceStep | None":
        """The step after `step` for the same rows (at the loop's `slots`), fed its sampled tokens;
        None when a row's next draw needs the host, or its next position starts a page that the
        pool cannot give now (pool.reserve: the loop's append for that position then takes none)."""
        if all(s.remaining <= 1 for s in seqs):
            return None  # every row ends with this step (its length)
        params = self._device_draw_params(seqs, ahead=1)
        if params is None:
            return None
        positions, tables = [p + 1 for p in step.positions], step.tables
        starting = [seq for seq, p in zip(step.ids, positions) if p % PAGE_SIZE == 0]
        if starting:
            try:
                for seq in starting:
                    self.pool.reserve(seq)
            except native.NativeError:  # no page free, or the row ends at max_seq_len with this step
                return None
            tables = self.runner.device_tables(self._tables_of(slots), positions)
            self.ahead_pages_reserved += len(starting)
        return self._enqueue(seqs, step.ids, positions, params, step.tokens, tables)

    def _take_ahead(self, batch: native.StepInput) -> "_DeviceStep | None":
        """The step enqueued ahead, when this batch's rows are among its rows at its positions and
        the loop has not parked since (the batch and the pool may have changed then)."""
        step, self._ahead = self._ahead, None
        if step is None:
            return None
        if step.epoch != self._epoch:
            return self._dropped(step)
        where = {s: i for i, s in enumerate(step.ids)}
        rows = [where.get(s) for s in batch.seqs.tolist()]
        if None in rows or [step.positions[r] for r in rows] != batch.positions.tolist():
            return self._dropped(step)
        self.ahead_rows_dropped += len(step.ids) - len(rows)
        self.ahead_steps_taken += 1
        return step.subset(rows)

    def _dropped(self, step: "_DeviceStep") -> None:
        self.ahead_rows_dropped += len(step.ids)
        return None

    # ---- events from the loop (event-loop thread) ----------------------------------------
    def on_loop_fd(self) -> None:
        try:
            # State first: once parked, the drain that follows holds every token published.
            parked = self.loop.state == native.LoopState.PARKED
            touched: set[RequestState] = set()
            for event in self.loop.drain():
                self._on_token(event, touched)
            for req in touched:
                req.publish()
            if parked and self._loop_running:
                self._on_parked(self.loop.park_status)
        except Exception as exc:  # a broken invariant: stop serving rather than hang
            self.die(exc)

    def _on_token(self, event: native.Event, touched: set[RequestState]) -> None:
        seq = self.by_kv.get(event.seq)
        if seq is None or seq.output.finished:
            return  # decoded past a stop string, or aborted: dropped
        logprob = seq.pending_logprobs.popleft()
        now = time.monotonic()
        self.metrics.generation_tokens.inc()
        if seq.last_token_time is not None:
            self.metrics.itl.observe(now - seq.last_token_time)
        seq.last_token_time = now
        if seq.output.accept(event.token, logprob):
            self.wake.set()
        assert seq.output.finished or not event.finished, f"loop finished seq {event.seq} the engine did not"
        touched.add(seq.request)

    def _on_parked(self, status: native.Status) -> None:
        self._parked()  # a failed step's park too: close() and a prefill may wait on it
        if status == native.Status.ERR_NO_SPACE:
            self._loop_no_space = True
        elif status != native.Status.OK:
            cause = self.loop.step_error
            self.die(EngineDead(f"decode step failed: {self.loop.park_message} ({cause!r})"))
            return
        self.wake.set()

    def _parked(self) -> None:
        """The loop is parked: release whoever awaits park()."""
        self._loop_running = False
        self._park_wanted = False
        self._epoch += 1
        for fut in self._park_waiters:
            if not fut.done():
                fut.set_result(None)
        self._park_waiters.clear()

    # ---- park / resume --------------------------------------------------------------------
    async def park(self) -> None:
        if not self._loop_running:
            return
        fut = asyncio.get_running_loop().create_future()
        self._park_waiters.append(fut)
        self._park_wanted = True  # the loop parks after its current step: enqueue nothing ahead of it
        self.loop.request_park()
        await fut

    def resume(self) -> None:
        if self._loop_running or self.dead or not any(not s.output.finished for s in self.rows.values()):
            return
        self._loop_no_space = False
        self.loop.resume()
        self._loop_running = True

    # ---- the scheduler coroutine ----------------------------------------------------------
    async def run(self) -> None:
        try:
            while not self.stopping:
                await self.wake.wait()
                self.wake.clear()
                await self.schedule()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.die(exc)

    async def schedule(self) -> None:
        await self.reap()
        if self._loop_no_space:
            await self.preempt_lowest()
        await self.admit()
        self.resume()
        self.update_gauges()

    async def reap(self) -> None:
        """Remove finished (or aborted) rows and free their pages."""
        done = [s for s in self.rows.values() if s.output.finished]
        if not done:
            return
        await self.park()
        for seq in done:
            self._release(seq, SeqStatus.FINISHED)
        self._retire_requests()

    async def preempt_lowest(self) -> bool:
        """Free the KV of the most recently admitted running sequence; it will recompute."""
        running = [s for s in self.rows.values() if not s.output.finished]
        if not running:
            self._loop_no_space = False
            return False
        await self.park()
        victim = max(running, key=lambda s: s.order)
        self._release(victim, SeqStatus.WAITING)
        # Pages are free now: a prefill before the loop resumes must not read the flag as the loop
        # being out of them (the loop parks again if the rest still lack a page).
        self._loop_no_space = False
        victim.num_preemptions += 1
        self.metrics.num_preemptions.inc()
        self.waiting.appendleft(victim)
        return True

    def _release(self, seq: Sequence, status: SeqStatus) -> None:
        if seq.slot is not None:
            self.loop.remove_row(seq.slot)
            del self.rows[seq.slot]
            self.free_slots.append(seq.slot)
            seq.slot = None
        if seq.kv_seq is not None:
            self.pool.free(seq.kv_seq)
            self.by_kv.pop(seq.kv_seq, None)
            seq.kv_seq = None
        if status == SeqStatus.WAITING:
            # Tokens sampled past the last one processed cannot exist: the loop is parked and drained.
            assert len(seq.output_ids) == seq.output.num_generated and not seq.pending_logprobs
        seq.pending_logprobs.clear()
        seq.status = status

    def _retire_requests(self) -> None:
        for rid, req in list(self.requests.items()):
            if req.all_finished and not any(s.kv_seq is not None for s in req.seqs):
                req.publish()
                del self.requests[rid]
                reason = req.seqs[0].output.finish_reason
                self.metrics.request_finished(reason.value if reason else "abort", time.monotonic() - req.arrival)

    # ---- admission and prefill ------------------------------------------------------------
    async def admit(self) -> None:
        while self.waiting and not self.dead and not self.stopping:
            lead = self.waiting[0]
            group = [lead] if lead.request.prefilled else lead.request.seqs
            if len(self.free_slots) < len(group):
                return
            if (self._blocked is not None and self._blocked[0] is lead and self.rows
                    and self._available_pages() <= self._blocked[1]):
                return  # only a row that finishes, or is preempted, gives pages back
            self.waiting.popleft()
            if not await self.prefill(lead, group):
                self.waiting.appendleft(lead)
                self._blocked = (lead, self._available_pages())
                return
            self._blocked = None
            await self.reap()
            if self._loop_no_space:
                await self.preempt_lowest()

    def _available_pages(self) -> int:
        """Pages free or held only by the prefix cache (which gives them up), every group."""
        return sum(u.free + u.cached for u in map(self.pool.usage, self.groups))

    async def prefill(self, lead: Sequence, group: list[Sequence]) -> bool:
        """Compute the KV of the lead's tokens, start its (forked) choices as loop rows.

        False: no pages even after preempting every lower-priority row; nothing is held.
        """
        req = lead.request
        tokens = lead.recompute_ids if req.prefilled else req.request.prompt_token_ids
        scorer = self._prompt_scorer(req)
        for seq in group:
            seq.status = SeqStatus.PREFILLING
        await self.park()  # a prefix-cache hit must not see pages whose KV a step is writing
        # Cached pages hold KV but no logits: a scored prompt is computed whole, and it is not
        # a prefix-cache query (the pool counts no lookup either), so hit rates stay comparable.
        kv, cached = self.pool.create_sequence(None if scorer else tokens)
        lead.kv_seq = kv
        self.by_kv[kv] = lead
        self.resume()
        if not req.prefilled:
            req.num_cached_tokens = cached
            if req.scheduled_time is None:
                req.scheduled_time = time.monotonic()
            if scorer is None:
                self.metrics.prefix_cache_queries.inc(len(tokens))
                self.metrics.prefix_cache_hits.inc(cached)
        logits, pos = None, cached
        while pos < len(tokens):
            if lead.output.finished:  # aborted while prefilling
                break
            chunk = tokens[pos: pos + self.config.prefill_chunk]
            try:
                self.pool.append(kv, chunk)
            except native.NoSpace:
                if not await self._make_room(lead):
                    self._release(lead, SeqStatus.WAITING)
                    return False
                continue
            tables = [torch.as_tensor(self.pool.seq_block_table(kv, g)) for g in self.groups]
            logits = await asyncio.get_running_loop().run_in_executor(
                self.executor, self._prefill_chunk, chunk, pos, tables, scorer)
            pos += len(chunk)
            await self.reap()  # between chunks, so finished and cancelled rows leave promptly
            # The loop ran out of pages meanwhile: a row admitted after this one gives way (and the
            # loop goes on), or this one waits (an older running row is never preempted for a
            # newer request's prefill).
            if self._loop_no_space:
                if not await self._make_room(lead):
                    self._release(lead, SeqStatus.WAITING)
                    return False
                self.resume()
        if not lead.output.finished and not await self._room_for_first_step(lead):
            self._release(lead, SeqStatus.WAITING)
            return False
        if not lead.output.finished and not req.prefilled and not await self._fork_choices(lead, group):
            self._release(lead, SeqStatus.WAITING)
            return False
        if lead.output.finished:
            for seq in group:
                self._release(seq, SeqStatus.FINISHED)
            self._retire_requests()
            return True
        if not req.prefilled:
            req.prefilled = True
            self.metrics.prompt_tokens.inc(len(tokens))
            if scorer is not None:
                assert scorer.complete, f"{len(scorer.items)} of {len(tokens)} prompt tokens scored"
                req.prompt_logprobs = scorer.items
            if not await self._start_choices(lead, group, logits):
                return True
        await self._add_rows(group)
        return True

    def _prompt_scorer(self, req: RequestState) -> PromptScorer | None:
        """A fresh scorer for a first prefill that wants prompt logprobs (a recompute after
        preemption does not: they were delivered with the first output)."""
        k = req.request.params.prompt_logprobs
        if req.prefilled or k is None:
            return None
        return PromptScorer(req.request.prompt_token_ids, k)

    def _prefill_chunk(self, chunk: list[int], start: int, tables: list[torch.Tensor],
                       scorer: PromptScorer | None) -> torch.Tensor:
        """One prefill forward (executor thread); logits [V] after the chunk's last token."""
        if scorer is None:
            return self.runner.prefill(chunk, start, tables)
        logits = self.runner.prefill(chunk, start, tables, all_logits=True)  # [n, V]
        scorer.score(logits, start)
        return logits[-1].clone()  # not a view that keeps the chunk's [n, V] alive

    async def _room_for_first_step(self, seq: Sequence) -> bool:
        """Takes the page of the row's first decode position now (pool.reserve), making room as a
        prefill chunk does. A row admitted without it, its KV ending on a page boundary, would
        stop the loop for space at its first step and, the newest row, be preempted at once, to
        be admitted and preempted again at every step of the others. The running rows, admitted
        before it, take the pages of their next positions first: a row admitted into the page
        one of them needs next would stop the loop the same way."""
        while True:
            try:
                for row in list(self.rows.values()):
                    if not row.output.finished and row.kv_seq is not None:
                        self._reserve_next(row)
                self._reserve_next(seq)
                return True
            except native.NoSpace:
                if not await self._make_room(seq):
                    return False

    def _reserve_next(self, seq: Sequence) -> None:
        """The page of the sequence's next position (pool.reserve); raises NoSpace. Nothing for a
        sequence at max_seq_len, which takes no further position."""
        try:
            self.pool.reserve(seq.kv_seq)
        except native.NoSpace:
            raise
        except native.NativeError as exc:
            if exc.status is not native.Status.ERR_INVALID_ARGUMENT:
                raise

    async def _make_room(self, seq: Sequence) -> bool:
        running = [s for s in self.rows.values() if not s.output.finished]
        await self.reap()
        if not running or max(s.order for s in running) < seq.order:
            return False
        return await self.preempt_lowest()

    async def _fork_choices(self, lead: Sequence, group: list[Sequence]) -> bool:
        """Forks the prompt's pages to every other choice (a fresh copy of a partly filled last
        page), each with the page of its first decode position, making room as a prefill chunk
        does. False when no room can be made: no choice holds a page then. Nothing to fork when
        the request decodes no token (max_tokens 0)."""
        if lead.remaining == 0:
            return True
        while True:
            try:
                for seq in group[1:]:
                    if seq.kv_seq is None:
                        child, copies = self.pool.fork(lead.kv_seq)
                        for group_id, src, dst in copies:
                            self.runner.copy_page(group_id, src, dst)
                        seq.kv_seq = child
                        self.by_kv[child] = seq
                    self._reserve_next(seq)
                return True
            except native.NoSpace:
                if not await self._make_room(lead):
                    for seq in group[1:]:
                        self._release(seq, SeqStatus.WAITING)
                    return False

    async def _start_choices(self, lead: Sequence, group: list[Sequence], logits: torch.Tensor) -> bool:
        """Sample each choice's first token (max_tokens 0: finish every choice with none); the
        choices hold their forks of the prompt's pages (_fork_choices)."""
        req = lead.request
        if lead.remaining == 0:
            for seq in group:
                seq.output.finish_empty()
        else:
            self._sample_first_tokens(group, logits)
        req.publish()
        for seq in group:
            if seq.output.finished:
                self._release(seq, SeqStatus.FINISHED)
        self._retire_requests()
        return any(not s.output.finished for s in group)

    def _sample_first_tokens(self, group: list[Sequence], logits: torch.Tensor) -> None:
        req = group[0].request
        req.first_token_time = now = time.monotonic()
        self.metrics.ttft.observe(now - req.arrival)
        for seq in group:
            [(token, lp)] = sample_rows(logits.unsqueeze(0), [seq.sampler])
            seq.output_ids.append(token)
            seq.last_token_time = now
            seq.output.accept(token, lp)
            self.metrics.generation_tokens.inc()

    async def _add_rows(self, group: list[Sequence]) -> None:
        await self.park()
        for seq in group:
            if seq.output.finished:  # aborted while the loop was parking: it never becomes a row
                self._release(seq, SeqStatus.FINISHED)
                continue
            p = seq.sampler.params
            stops = ([] if p.ignore_eos else list(self.eos_ids)) + list(p.stop_token_ids)
            seq.slot = self.free_slots.pop()
            self.loop.add_row(
                slot=seq.slot, seq=seq.kv_seq, last_token=seq.output_ids[-1],
                max_new_tokens=seq.remaining,
                min_new_tokens=max(0, p.min_tokens - len(seq.output_ids)),
                stop_token_ids=stops,
            )
            self.rows[seq.slot] = seq
            seq.status = SeqStatus.RUNNING
        self._retire_requests()
        self.resume()

    # ---- requests in and out ---------------------------------------------------------------
    def add(self, req: RequestState) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req.seqs[0])
        self.wake.set()

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None:
            return
        for seq in req.seqs:
            seq.output.abort()
        req.done = True
        for seq in [s for s in self.waiting if s.request is req]:
            self.waiting.remove(seq)
        for seq in req.seqs:
            if seq.status == SeqStatus.WAITING:
                seq.status = SeqStatus.FINISHED
        self._retire_requests()
        self.wake.set()

    def _fail_unfinished(self, error: EngineDead) -> None:
        """The iterators of requests whose final output is not queued yet end with `error`
        (one whose final output is queued ends normally)."""
        for req in self.requests.values():
            if not req.done:
                req.queue.put_nowait(error)

    def end_all(self, error: EngineDead) -> None:
        """Abort every request; those not finished end with `error`."""
        self._fail_unfinished(error)
        for rid in list(self.requests):
            self.abort(rid)

    def die(self, exc: BaseException) -> None:
        if self.dead is None:
            self.dead = exc if isinstance(exc, EngineDead) else EngineDead(f"engine failed: {exc!r}")
            self.dead.__cause__ = exc if exc is not self.dead else None
            self._fail_unfinished(self.dead)
        # A failure between the loop's park and its handling (on_loop_fd) must not leave park()
        # waiting for a signal already consumed.
        if not self.loop.closed and self.loop.state == native.LoopState.PARKED:
            self._parked()
        self.wake.set()

    async def close(self) -> None:
        """Stop the coroutine's work, park the loop and release the native loop and executor."""
        if self.loop.closed:
            return
        self.stopping = True
        self.wake.set()
        try:
            await asyncio.wait_for(self.park(), self.close_park_timeout_s)
        except TimeoutError:  # destroying the loop below still waits for the step it is in
            log.error("decode loop did not park at shutdown", timeout_s=self.close_park_timeout_s)
            self._parked()
        asyncio.get_running_loop().remove_reader(self.fd)
        self.loop.close()
        self.executor.shutdown(wait=True)

    # ---- numbers ----------------------------------------------------------------------------
    def kv_usage(self) -> float:
        """Fraction of pages referenced by sequences in the fullest group."""
        return self.pool.usage_fraction()

    def update_gauges(self) -> None:
        running = {s.request.request_id for s in self.rows.values()}
        running |= {s.request.request_id for s in self.by_kv.values()}
        self.metrics.num_requests_running.set(len(running))
        self.metrics.num_requests_waiting.set(len({s.request.request_id for s in self.waiting}))
        self.metrics.kv_cache_usage.set(self.kv_usage())


class _DeviceStep:
    """A decode step enqueued on the device: its rows (pool ids, positions, device tables), its
    sampled tokens on the device, and their copy on the way to host memory: the computing step's
    `width` tokens, then their logprobs' bits when a row wants logprobs. A subset of a step
    (_take_ahead) reads its rows' results at `picks` there."""

    def __init__(self, ids: list[int], positions: list[int], tables: list[torch.Tensor], tokens: torch.Tensor,
                 host: torch.Tensor, done: torch.cuda.Event | None, want: list[bool], epoch: int):
        self.ids, self.positions, self.tables, self.tokens = ids, positions, tables, tokens
        self.host, self.done, self.want, self.epoch = host, done, want, epoch
        self.width, self.picks = len(ids), list(range(len(ids)))

    def subset(self, rows: list[int]) -> "_DeviceStep":
        """Its rows `rows` (indices, in order) as a step of their own (of a step _enqueue made)."""
        if rows == list(range(len(self.ids))):
            return self
        index = torch.tensor(rows)
        if self.tokens.is_cuda:  # enqueued, not waited for: nothing here waits for the device
            index = index.pin_memory().to(self.tokens.device, non_blocking=True)
        sub = _DeviceStep([self.ids[r] for r in rows], [self.positions[r] for r in rows],
                          [t[index] for t in self.tables], self.tokens[index], self.host, self.done,
                          [self.want[r] for r in rows], self.epoch)
        sub.width, sub.picks = self.width, [self.picks[r] for r in rows]
        return sub

    def results(self) -> list[tuple[int, TokenLogprob | None]]:
        """Waits for the copy; (token, its logprob when the row asked for logprobs) per row."""
        if self.done is not None:
            self.done.synchronize()
        tokens = self.host[:self.width].tolist()
        values = self.host[self.width:].view(torch.float32).tolist()
        return [(tokens[p], TokenLogprob(tokens[p], values[p]) if want else None)
                for p, want in zip(self.picks, self.want)]
