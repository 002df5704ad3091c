"""AsyncEngine: the engine's public face for the HTTP layer (and anything else on asyncio)."""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path
from typing import Any, AsyncIterator

import torch

from .. import native, telemetry
from ..config import FULL, PAGE_SIZE, ModelConfig
from ..default_model import default_model_path
from ..tokenizer import IncrementalDetokenizer, Tokenizer
from .config import EngineConfig
from .gpu_sampling import GpuSampler
from .metrics import EngineMetrics
from .mk_runner import MegakernelRunner, megakernel_unavailable
from .output import ChoiceOutput
from .runner import TorchRunner
from .sampling import RowSampler
from .scheduler import Scheduler
from .sequence import RequestState, Sequence
from .types import EngineDead, EngineOverloaded, GenerationRequest, RequestOutput, RequestRejected
from .validate import validate_request

log = telemetry.get_logger("northmk.engine")


class AsyncEngine:
    def __init__(self, config: EngineConfig, model_path: Path, runner: TorchRunner, tokenizer: Tokenizer):
        self.config = config
        self.model_path = model_path
        self.runner = runner
        self.tokenizer = tokenizer
        self.model_config: ModelConfig = runner.config
        self.backend = runner.backend
        # The megakernel's logits stay on the GPU: rows whose sampling the GPU implements draw there.
        self.device_sampler = GpuSampler(runner.kv.pages[0].device) if runner.backend == "megakernel" else None
        limit = min(config.max_model_len or self.model_config.max_position_embeddings,
                    self.model_config.max_position_embeddings)
        # A sequence longer than the full-attention pages could never finish: cap the context there.
        self._full_pages = runner.kv.num_pages[0] if FULL in self.model_config.attention_groups else None
        if self._full_pages is not None:
            limit = min(limit, self._full_pages * PAGE_SIZE)
        self.max_model_len = limit
        self.served_model_name = config.served_model_name or model_path.name
        self.eos_ids = _eos_ids(self.model_config, tokenizer)
        self.metrics = EngineMetrics(self.served_model_name)
        self.pool = native.KVPool.for_model(
            self.model_config, runner.kv.num_pages, page_size=PAGE_SIZE, max_seq_len=self.max_model_len,
            max_rows=config.max_batch, model_key=_model_key(model_path, config.dtype),
            prefix_cache=config.enable_prefix_caching,
        )
        self.scheduler: Scheduler | None = None
        self._task: asyncio.Task | None = None
        self._accepting = False

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncEngine":
        """Load the checkpoint and tokenizer (blocking; call before serving). ValueError, with
        the reason in one line, when backend "megakernel" cannot run here."""
        path = Path(config.model) if config.model is not None else default_model_path()
        model_config = ModelConfig.from_file(path)
        limit = min(config.max_model_len or model_config.max_position_embeddings, model_config.max_position_embeddings)
        return cls(config, path, _load_runner(config, model_config, path, limit), Tokenizer.from_pretrained(path))

    # ---- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        if self.scheduler is not None:
            raise RuntimeError("engine already started")
        self.scheduler = Scheduler(self.config, self.runner, self.pool, self.metrics, self.eos_ids,
                                   device_sampler=self.device_sampler)
        self.runner.prepare_schedules(self.config.max_batch, self.max_model_len)
        asyncio.get_running_loop().add_reader(self.scheduler.fd, self.scheduler.on_loop_fd)
        self._task = asyncio.create_task(self.scheduler.run(), name="northmk-scheduler")
        self._accepting = True

    async def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Stop accepting; let running requests finish for up to drain_timeout s; abort the rest."""
        self._accepting = False
        s = self.scheduler
        if s is None:
            return
        deadline = time.monotonic() + drain_timeout
        while s.requests and time.monotonic() < deadline and s.dead is None:
            await asyncio.sleep(0.01)
        s.end_all(EngineDead("the engine shut down before the request finished"))
        for _ in range(100):  # let the scheduler free the aborted rows
            if not s.rows and not s.by_kv or s.dead is not None:
                break
            await asyncio.sleep(0.01)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await s.close()
        await asyncio.to_thread(self.runner.close)  # waits for a schedule being built, if any
        self.pool.close()

    # ---- health and numbers ----------------------------------------------------------------
    @property
    def is_healthy(self) -> bool:
        return self.scheduler is not None and self.scheduler.dead is None and self._accepting

    @property
    def dead_error(self) -> BaseException | None:
        return None if self.scheduler is None else self.scheduler.dead

    def stats(self) -> dict[str, Any]:
        s = self.scheduler
        if s is None:
            return {}
        s.update_gauges()
        prefix = self.pool.prefix_stats()
        return {
            "num_requests_running": len({q.request.request_id for q in s.by_kv.values()}),
            "num_requests_waiting": len({q.request.request_id for q in s.waiting}),
            "num_rows": len(s.rows),
            "kv_cache_usage": s.kv_usage(),
            "kv_pages_used": sum(self.pool.usage(g).used for g in s.groups),
            "prefix_cache_query_tokens": prefix.query_tokens,
            "prefix_cache_hit_tokens": prefix.hit_tokens,
        }

    # ---- requests -----------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as the engine produces them; closing the iterator aborts it."""
        s = self._admission_check()
        validate_request(request, self.model_config.vocab_size, self.max_model_len, self.config, self._full_pages)
        if request.request_id in s.requests:
            raise RequestRejected(f"request id {request.request_id!r} is already running", "request_id")
        req = self._new_request(request)
        s.add(req)
        try:
            while True:
                item = await req.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if req.done and req.queue.empty():
                    return
        finally:
            if not req.all_finished and s.dead is None:
                s.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        if self.scheduler is not None:
            self.scheduler.abort(request_id)

    def _admission_check(self) -> Scheduler:
        s = self.scheduler
        if s is None:
            raise EngineDead("engine not started")
        if s.dead is not None:
            raise EngineDead(str(s.dead))
        if not self._accepting:
            raise EngineDead("engine is shutting down")
        if len(s.waiting) >= self.config.max_waiting:
            raise EngineOverloaded(f"{len(s.waiting)} requests are waiting (max_waiting={self.config.max_waiting})")
        return s

    def _new_request(self, request: GenerationRequest) -> RequestState:
        req = RequestState(request)
        p, prompt = request.params, request.prompt_token_ids
        for i in range(p.n):
            output_ids: list[int] = []
            detok = IncrementalDetokenizer(self.tokenizer, p.skip_special_tokens, prompt)
            req.seqs.append(Sequence(
                request=req, index=i,
                sampler=RowSampler.create(p, prompt, output_ids, self.eos_ids, i),
                output=ChoiceOutput(i, p, detok, self.eos_ids, len(prompt), self.max_model_len),
                output_ids=output_ids,
            ))
        return req


def _load_runner(config: EngineConfig, model: ModelConfig, path: Path, max_model_len: int) -> TorchRunner:
    """The backend config.backend names; "auto": the megakernel where it can run, else torch."""
    runner, reason = None, None
    if config.backend != "torch":
        reason = megakernel_unavailable(config, model)
        if reason is None:
            try:
                runner = MegakernelRunner.load(config, path, max_model_len)
            except native.NativeError as exc:  # nmk_mk_create refused it (e.g. this GPU's limits)
                reason = exc.message
        if reason is not None and config.backend == "megakernel":
            raise ValueError(f"backend 'megakernel' cannot serve {path.name} here: {reason}")
    if runner is None:
        if reason is not None and config.device.startswith("cuda"):
            torch.cuda.empty_cache()  # what a failed megakernel load held goes back for the KV sizing
        runner = TorchRunner.load(config, path, max_model_len)
    log.info("engine backend", backend=runner.backend, requested=config.backend, device=config.device,
             dtype=config.dtype, **({"reason": reason} if reason else {}))
    return runner


def _eos_ids(config: ModelConfig, tokenizer: Tokenizer) -> tuple[int, ...]:
    ids = list(config.eos_token_ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return tuple(ids)


def _model_key(path: Path, dtype: str) -> int:
    digest = hashlib.sha256(f"{path.resolve()}|{dtype}".encode()).digest()
    return int.from_bytes(digest[:8], "little")
