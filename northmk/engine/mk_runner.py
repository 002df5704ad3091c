"""The megakernel backend: TorchRunner's PyTorch prefill, and one megakernel launch per decode step.

Both write the same paged KV arena: prefill through the reference model, decode inside the
kernel (each step's k, v go to its rows' pages). Prefill chunks (executor thread) and decode
steps (loop thread) are enqueued on the device's default stream, so they never overlap; the
kernel's schedules, prepared on a thread of their own, upload on a stream of their own.
"""

from __future__ import annotations

import threading

import torch

from .. import telemetry
from ..config import PAGE_SIZE, ModelConfig
from ..megakernel import MAX_BATCH, Megakernel, Schedule, tiled_bytes, unsupported_reason
from ..model.reference import disable_tiled_gemm, tiled_gemm_available
from ..model.weights import ModelWeights
from ..native._lib import NativeError, load
from .config import EngineConfig
from .runner import TorchRunner

log = telemetry.get_logger("northmk.engine")


def megakernel_unavailable(engine: EngineConfig, model: ModelConfig) -> str | None:
    """Why the megakernel cannot serve `model` with these settings, or None when it can.

    After the device kind, the model and the settings are checked before the machine, so a
    model the kernel does not implement gets the same reason on any machine.
    """
    if not engine.device.startswith("cuda"):
        return f"the megakernel needs a CUDA device, not {engine.device!r}"
    reason = unsupported_reason(model) or _geometry_reason(model)
    if reason:
        return reason
    if not model.tie_word_embeddings:
        return "the megakernel needs tied embeddings (lm_head is embed_tokens)"
    if engine.dtype != "bfloat16":
        return f"the megakernel runs bfloat16 weights, not {engine.dtype}"
    if engine.max_batch > MAX_BATCH:
        return f"the megakernel runs at most {MAX_BATCH} rows per step, max_batch is {engine.max_batch}"
    if not torch.cuda.is_available():
        return "CUDA is not available (torch sees no GPU)"
    index = torch.device(engine.device).index or 0
    if index >= torch.cuda.device_count():
        return f"no CUDA device {engine.device} (torch sees {torch.cuda.device_count()})"
    major, minor = torch.cuda.get_device_capability(index)
    if major != 9:
        return f"the megakernel needs an sm_90 (Hopper) GPU, {engine.device} is sm_{major}{minor}"
    if not load().nmk_has_cuda():
        return "libnorthmk was built without CUDA (rebuild it where nvcc is installed)"
    return None


def _geometry_reason(model: ModelConfig) -> str | None:
    """The schedule builder's geometry check (host code, so it answers on any machine)."""
    try:
        Schedule(model, 1, [1])
    except NativeError as exc:
        return f"the megakernel cannot run this geometry: {exc.message.split(': ', 1)[-1]}"
    return None


class MegakernelRunner(TorchRunner):
    backend = "megakernel"

    def __init__(self, model_config: ModelConfig, weights: ModelWeights, num_pages: list[int]):
        super().__init__(model_config, weights, num_pages)
        self.megakernel = Megakernel(model_config, weights, self.kv)  # tiles the experts in place
        self._warm_up_tiled_experts(weights)
        self._preparing: threading.Thread | None = None
        self._stop = threading.Event()

    @staticmethod
    def _warm_up_tiled_experts(weights: ModelWeights) -> None:
        """Compiles the prefill's expert GEMMs on the tiled layout (model.tiled_moe) now, so that the
        first request does not; where they cannot run, prefill untiles the routed experts instead."""
        sparse = next((lw for lw in weights.layers if lw.experts_tiled), None)
        if sparse is None or not tiled_gemm_available(sparse.experts_gate_up.device):
            return
        try:
            from ..model.tiled_moe import warm_up

            warm_up(sparse.experts_gate_up, sparse.experts_down)
        except Exception as exc:  # Triton's compile or launch: the prefill still runs, slower
            disable_tiled_gemm(f"{type(exc).__name__}: {exc}")
            log.warning("the tiled experts' Triton GEMMs failed; prefill untiles the routed experts per call",
                        error=f"{type(exc).__name__}: {exc}")

    @staticmethod
    def reserved_bytes(weights: ModelWeights) -> int:
        """The kernel's tiled copies of attention's, the router's, the dense MLP's and the embedding's weights."""
        return tiled_bytes(weights)

    def prepare_schedules(self, max_batch: int, max_len: int) -> None:
        """Builds on a background thread the kernel schedule of every batch size up to max_batch
        at every context bucket up to max_len, shortest first: a step would otherwise build its
        own on first use and stall the decode loop (100-190 ms on the H200 at North's geometry before
        the checker's message fix, 40-60 ms of check on the build host after it). The
        native calls release the GIL; close() stops it between schedules."""
        buckets = [64]
        while buckets[-1] < max_len:
            buckets.append(2 * buckets[-1])

        def run() -> None:
            for bucket in buckets:
                for batch in range(1, max_batch + 1):
                    if self._stop.is_set():
                        return
                    try:
                        self.megakernel.prepare(batch, bucket)
                    except NativeError as exc:  # the step that needs it will say why
                        log.warning("schedule preparation stopped", batch=batch, bucket=bucket, error=exc.message)
                        return

        self._preparing = threading.Thread(target=run, name="northmk-schedules", daemon=True)
        self._preparing.start()

    def close(self) -> None:
        self._stop.set()
        if self._preparing is not None:
            self._preparing.join()

    def decode(self, tokens: list[int], positions: list[int], block_tables: list[torch.Tensor]) -> torch.Tensor:
        """One token per row at its position (tables [rows, cols] per group); float32 logits
        [rows, V] on the device, enqueued on its current stream (not synchronized)."""
        return self.decode_on_device(torch.tensor(tokens, dtype=torch.int32), positions, self.device_tables(
            block_tables, positions))

    def device_tables(self, block_tables: list[torch.Tensor], positions: list[int]) -> list[torch.Tensor]:
        """The tables' columns up to the last position's page, int32 on the weights' device."""
        cols = max(positions) // PAGE_SIZE + 1  # the kernel reads no page past the last position
        dev = self.megakernel.weights.device
        return [t[:, :cols].to(dev, torch.int32).contiguous() for t in block_tables]

    def decode_on_device(self, tokens: torch.Tensor, positions: list[int], tables: list[torch.Tensor]) -> torch.Tensor:
        """decode() on tokens and tables (device_tables) that may already be on the device, e.g. the
        previous step's sampled tokens: nothing waits for the device."""
        return self.decode_greedy_on_device(tokens, positions, tables)[0]

    def decode_greedy_on_device(self, tokens: torch.Tensor, positions: list[int], tables: list[torch.Tensor]
                                ) -> tuple[torch.Tensor, torch.Tensor]:
        """decode_on_device, and the greedy tokens the step's kernel reduced from its logits
        (its ARGMAX tasks: the lowest id among equal maxima)."""
        with torch.cuda.device(self.megakernel.weights.device):  # the loop thread's current device may differ
            return self.megakernel.step(tokens, list(positions), tables)
