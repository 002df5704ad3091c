"""ctypes bindings of the megakernel and its task schedule (the nmk_mk_* / nmk_schedule_*
section of include/northmk.h); C prototypes beside their argtypes.

    Schedule(config, num_sms, context_lens)   host-built per-SM task lists and work queues, always available
    check_schedule(config, plan, tasks, sm_offsets, queue_offsets)   the checker on any lists and queues
    Megakernel(config, weights, kv)           one decode step per launch (CUDA builds, sm_90)
    tiled_layout(w)                           a matrix in the layout the kernel streams it in
    tiled_copies(weights)                     the matrices Megakernel copies into that layout
"""

from __future__ import annotations

import ctypes
import enum
from dataclasses import dataclass
from ctypes import POINTER, byref, c_float, c_int32, c_uint8, c_uint16, c_uint32, c_uint64, c_void_p

import numpy as np
import torch

from .config import PAGE_SIZE, SLIDING, ModelConfig
from .model.kv import PagedKVCache
from .model.weights import ModelWeights, tile_experts_, to_tiled
from .native._lib import KV_MAX_GROUPS, check, load

MAX_BATCH = 8  # NMK_MK_MAX_BATCH
MAX_SPLITS = 64  # NMK_MK_MAX_SPLITS
MAX_GEMV_INPUT = 4096  # widest [8, K] bf16 input the kernel stages (cuda/schedule/schedule.hpp kMaxGemvInput)
MAX_LAYERS = 128  # layers the kernel's parameters hold (cuda/mk/config.cuh kMaxLayers)
BLOCK_COLS = 256  # NMK_MK_BLOCK_COLS: hidden columns per counter of a layer's input
POST_SCALED_MAX_BATCH = 2  # NMK_MK_POST_SCALED_MAX_BATCH: QKV and ROUTER scale by rms after the GEMV


class Opcode(enum.IntEnum):
    """nmk_opcode, v0.6 semantics (include/northmk.h): layer l - 1's OPROJ and DOWN tasks add
    their outputs into layer l's input sums (layer 0's: the embedding, from the NORM tiles),
    each signalling the counter of the column block its rows fall in; every reader of the
    normed input normalizes those sums itself but the sparse GATE_UP tasks, which read what
    the ROUTER tiles wrote, and waits on all of the input's block counters (wait_spans)."""

    NORM = 1  # layer 0, tile x: hidden cols [x * norm_cols, ...) of the embedding
    QKV = 2
    ROUTER = 3  # tile x: router_logits of experts [x * router_rows, ...); the last one (the routing tile) routes
    ATTN = 4  # row x, kv head y, split z & 0xff of z >> 8; the pair's last split merges
    COMBINE = 5  # retired in v0.3, never emitted: the checker rejects it
    OPROJ = 6
    GATE_UP = 7  # on sparse layers of the expert the routing put in slot y
    DOWN = 8
    FINAL_NORM = 9  # retired in v0.5, never emitted: the checker rejects it
    LM_HEAD = 10
    ARGMAX = 11
    DRAIN = 12  # list entry: claim and run the tasks of queue x until none is left (ABI v3)


class DebugStage(enum.IntEnum):
    """nmk_mk_debug_stage: what the debug capture records per layer l (see MegakernelTrace)."""

    X = 0  # the residual entering layer l
    ATTN = 1  # o-proj output of layer l - 1
    MLP = 2  # mlp output of layer l - 1


DEBUG_STAGES = 3  # NMK_MK_DEBUG_STAGES


class Task(ctypes.Structure):
    _fields_ = [("op", c_uint8), ("layer", c_uint8), ("x", c_uint16), ("y", c_uint16), ("z", c_uint16),
                ("wait", c_int32), ("target", c_uint32), ("signal", c_int32)]


TASK_DTYPE = np.dtype([("op", "u1"), ("layer", "u1"), ("x", "<u2"), ("y", "<u2"), ("z", "<u2"),
                       ("wait", "<i4"), ("target", "<u4"), ("signal", "<i4")], align=True)
assert TASK_DTYPE.itemsize == ctypes.sizeof(Task)


class Plan(ctypes.Structure):
    _fields_ = [(name, c_int32) for name in (
        "batch", "expert_slots", "norm_cols", "norm_tiles", "qkv_rows", "router_rows", "router_tiles", "oproj_rows",
        "moe_cols", "moe_down_rows", "dense_cols", "dense_down_rows", "lm_rows", "lm_tiles", "max_splits",
        "num_counters", "num_queues")]


class Geometry(ctypes.Structure):
    _fields_ = [(name, c_int32) for name in (
        "hidden", "num_layers", "num_heads", "num_kv_heads", "head_dim", "num_experts", "top_k", "moe_inter",
        "dense_inter", "vocab", "sliding_window", "page_size")] + [
        ("rope_theta", c_float), ("norm_eps", c_float), ("logit_scale", c_float),
        ("dense", POINTER(c_uint8)), ("sliding", POINTER(c_uint8)), ("rope", POINTER(c_uint8))]


class Layer(ctypes.Structure):
    _fields_ = [(name, c_void_p) for name in (
        "norm", "qkv", "o", "gate_up", "down", "router", "experts_gate_up", "experts_down")] + [
        ("kv_group", c_int32), ("kv_slot", c_int32)]


class Weights(ctypes.Structure):
    _fields_ = [("embed", c_void_p), ("final_norm", c_void_p), ("layers", POINTER(Layer)),
                ("kv_pages", c_void_p * KV_MAX_GROUPS), ("kv_num_pages", c_uint32 * KV_MAX_GROUPS)]


class StepArgs(ctypes.Structure):
    _fields_ = [("batch", c_uint32), ("host_positions", POINTER(c_int32)), ("tokens", c_void_p),
                ("positions", c_void_p), ("block_tables", c_void_p * KV_MAX_GROUPS), ("table_cols", c_uint32),
                ("logits", c_void_p), ("next_tokens", c_void_p)]


_PROTOTYPES = {
    # nmk_status nmk_schedule_create(const nmk_mk_geometry *, uint32_t num_sms, const int32_t *context_lens,
    #                                uint32_t batch, nmk_schedule **out)
    "nmk_schedule_create": (c_int32, [POINTER(Geometry), c_uint32, POINTER(c_int32), c_uint32, POINTER(c_void_p)]),
    # void nmk_schedule_destroy(nmk_schedule *)
    "nmk_schedule_destroy": (None, [c_void_p]),
    # nmk_status nmk_schedule_plan(const nmk_schedule *, nmk_plan *out)
    "nmk_schedule_plan": (c_int32, [c_void_p, POINTER(Plan)]),
    # nmk_status nmk_schedule_tasks(const nmk_schedule *, const nmk_task **, const uint32_t **, uint32_t *)
    "nmk_schedule_tasks": (c_int32, [c_void_p, POINTER(POINTER(Task)), POINTER(POINTER(c_uint32)), POINTER(c_uint32)]),
    # nmk_status nmk_schedule_queues(const nmk_schedule *, const uint32_t **queue_offsets, uint32_t *num_queues)
    "nmk_schedule_queues": (c_int32, [c_void_p, POINTER(POINTER(c_uint32)), POINTER(c_uint32)]),
    # nmk_status nmk_schedule_check(const nmk_mk_geometry *, const nmk_plan *, const nmk_task *,
    #                               const uint32_t *sm_offsets, uint32_t num_sms, const uint32_t *queue_offsets)
    "nmk_schedule_check": (c_int32, [POINTER(Geometry), POINTER(Plan), c_void_p, c_void_p, c_uint32, c_void_p]),
    # nmk_status nmk_schedule_wait_spans(const nmk_mk_geometry *, const nmk_task *, size_t count, uint32_t *spans)
    "nmk_schedule_wait_spans": (c_int32, [POINTER(Geometry), c_void_p, ctypes.c_size_t, c_void_p]),
    # nmk_status nmk_schedule_waits_in_run(const nmk_mk_geometry *, uint32_t batch, const nmk_task *, size_t count,
    #                                      uint8_t *inside)
    "nmk_schedule_waits_in_run": (c_int32, [POINTER(Geometry), c_uint32, c_void_p, ctypes.c_size_t, c_void_p]),
    # nmk_status nmk_mk_create(const nmk_mk_geometry *, const nmk_mk_weights *, nmk_mk **out)
    "nmk_mk_create": (c_int32, [POINTER(Geometry), POINTER(Weights), POINTER(c_void_p)]),
    # void nmk_mk_destroy(nmk_mk *)
    "nmk_mk_destroy": (None, [c_void_p]),
    # nmk_status nmk_mk_num_sms(const nmk_mk *, uint32_t *out)
    "nmk_mk_num_sms": (c_int32, [c_void_p, POINTER(c_uint32)]),
    # nmk_status nmk_mk_debug_bytes(const nmk_mk *, uint64_t *out)
    "nmk_mk_debug_bytes": (c_int32, [c_void_p, POINTER(c_uint64)]),
    # nmk_status nmk_mk_set_debug(nmk_mk *, void *buffer, uint64_t bytes)
    "nmk_mk_set_debug": (c_int32, [c_void_p, c_void_p, c_uint64]),
    # nmk_status nmk_mk_set_timing(nmk_mk *, uint64_t *buffer, uint32_t capacity)
    "nmk_mk_set_timing": (c_int32, [c_void_p, c_void_p, c_uint32]),
    # nmk_status nmk_mk_step(nmk_mk *, const nmk_mk_step_args *, void *stream)
    "nmk_mk_step": (c_int32, [c_void_p, POINTER(StepArgs), c_void_p]),
    # nmk_status nmk_mk_prepare(nmk_mk *, uint32_t batch, int32_t max_len)
    "nmk_mk_prepare": (c_int32, [c_void_p, c_uint32, c_int32]),
}


def _lib() -> ctypes.CDLL:
    lib = load()
    if not getattr(lib, "_mk_bound", False):
        for name, (restype, argtypes) in _PROTOTYPES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
        lib._mk_bound = True
    return lib


def unsupported_reason(config: ModelConfig) -> str | None:
    """Why the megakernel cannot run this model, or None."""
    if config.norm_kind != "rms":
        return "the megakernel implements RMSNorm only"
    if config.expert_selection != "sigmoid" or config.norm_topk_prob:
        return "the megakernel implements sigmoid routing without renormalization only"
    if config.num_shared_experts:
        return "the megakernel has no shared experts"
    if config.head_dim != 128 or config.gqa_group > 8 or config.top_k > 8:
        return "the megakernel needs head_dim 128, at most 8 query heads per kv head and top_k <= 8"
    if config.num_experts > 128:
        return "the megakernel routes among at most 128 experts"
    if config.hidden_size % 256:
        return "the megakernel needs hidden_size a multiple of 256"
    if config.moe_intermediate_size % 32 or config.dense_intermediate_size % 32:
        return "the megakernel needs intermediate sizes (routed and dense) that are multiples of 32"
    if config.q_size > MAX_GEMV_INPUT:
        return f"the megakernel needs num_heads * head_dim <= {MAX_GEMV_INPUT}, got {config.q_size}"
    widest = max(config.hidden_size, config.moe_intermediate_size, config.dense_intermediate_size)
    if widest > MAX_GEMV_INPUT:
        return f"the megakernel needs hidden_size and intermediate sizes <= {MAX_GEMV_INPUT}, got {widest}"
    if config.num_layers > MAX_LAYERS:
        return f"the megakernel takes at most {MAX_LAYERS} layers, got {config.num_layers}"
    return None


def tiled_layout(w: torch.Tensor) -> torch.Tensor:
    """A copy of the matrix w [R, K] (K % 32 == 0) in the kernel's tiled layout, flat
    (include/northmk.h, nmk_mk_layer; model.weights.to_tiled): R rounded up to 16 with zero rows,
    each band of 16 rows stored as its K / 32 blocks of [16, 32], so that a warp's weight load
    reads 512 contiguous bytes (8 rows' 64 in the row-major layout)."""
    if w.dim() != 2 or w.shape[1] % 32:
        raise ValueError(f"need a [R, K] matrix with K a multiple of 32, got {tuple(w.shape)}")
    rows, k = w.shape
    if rows % 16:
        w = torch.cat((w, w.new_zeros(-rows % 16, k)))
    return to_tiled(w).view(-1)


def tiled_copies(weights: ModelWeights) -> list[torch.Tensor]:
    """The matrices the kernel streams from copies in the tiled layout: each layer's qkv, o, and
    router or dense MLP (None where a layer has none), then the embedding. The experts it
    reads in place, tiled (model.weights.tile_experts_)."""
    return [w for lw in weights.layers for w in (lw.qkv, lw.o, lw.router, lw.gate_up, lw.down) if w is not None] + [
        weights.embed]


def tiled_bytes(weights: ModelWeights) -> int:
    """Device memory of Megakernel's tiled copies of `weights` (rows padded to 16)."""
    return sum(-(-w.shape[0] // 16) * 16 * w.shape[1] * w.element_size() for w in tiled_copies(weights))


class _GeometryRef:
    """A Geometry plus the flag arrays it points into (kept alive together)."""

    def __init__(self, config: ModelConfig):
        n = config.num_layers
        self.dense = (c_uint8 * n)(*[int(t == "dense") for t in config.mlp_types])
        self.sliding = (c_uint8 * n)(*[int(t == SLIDING) for t in config.layer_types])
        self.rope = (c_uint8 * n)(*[int(r) for r in config.rope_layers])
        self.value = Geometry(
            hidden=config.hidden_size, num_layers=n, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim, num_experts=config.num_experts, top_k=config.top_k,
            moe_inter=config.moe_intermediate_size, dense_inter=config.dense_intermediate_size,
            vocab=config.vocab_size, sliding_window=config.sliding_window or 0, page_size=PAGE_SIZE,
            rope_theta=config.rope_theta, norm_eps=config.norm_eps, logit_scale=config.logit_scale,
            dense=self.dense, sliding=self.sliding, rope=self.rope)


def _plan_dict(plan: Plan) -> dict[str, int]:
    return {name: getattr(plan, name) for name, _ in Plan._fields_}


class Schedule:
    """Task array of one decode step of len(context_lens) rows: the per-SM lists, then the
    work queues. SM s runs tasks[sm_offsets[s]:sm_offsets[s + 1]]; queue q is
    tasks[queue_offsets[q]:queue_offsets[q + 1]], drained by every SM at its DRAIN(q) entry."""

    def __init__(self, config: ModelConfig, num_sms: int, context_lens: list[int]):
        lib = _lib()
        self.config = config
        self._geometry = _GeometryRef(config)
        lens = (c_int32 * len(context_lens))(*context_lens)
        handle = c_void_p()
        check(lib.nmk_schedule_create(byref(self._geometry.value), num_sms, lens, len(context_lens), byref(handle)))
        try:
            plan = Plan()
            check(lib.nmk_schedule_plan(handle, byref(plan)))
            tasks, offsets, n = POINTER(Task)(), POINTER(c_uint32)(), c_uint32()
            check(lib.nmk_schedule_tasks(handle, byref(tasks), byref(offsets), byref(n)))
            self.sm_offsets = np.ctypeslib.as_array(offsets, (n.value + 1,)).copy()
            queue_offsets, nq = POINTER(c_uint32)(), c_uint32()
            check(lib.nmk_schedule_queues(handle, byref(queue_offsets), byref(nq)))
            self.queue_offsets = np.ctypeslib.as_array(queue_offsets, (nq.value + 1,)).copy()
            count = int(self.queue_offsets[-1])
            raw = ctypes.string_at(ctypes.cast(tasks, c_void_p), count * ctypes.sizeof(Task))
            self.tasks = np.frombuffer(raw, dtype=TASK_DTYPE).copy()
            self.plan = _plan_dict(plan)
        finally:
            lib.nmk_schedule_destroy(handle)

    @property
    def num_sms(self) -> int:
        return len(self.sm_offsets) - 1

    @property
    def num_queues(self) -> int:
        return len(self.queue_offsets) - 1

    def wait_spans(self) -> np.ndarray:
        """wait_spans of every task (DRAIN entries included: 0)."""
        return wait_spans(self.config, self.tasks)

    def waits_in_run(self) -> np.ndarray:
        """waits_in_run of every task at the schedule's batch (DRAIN entries included: False)."""
        return waits_in_run(self.config, self.plan["batch"], self.tasks)

    def tasks_of(self, sm: int) -> np.ndarray:
        """SM sm's list, DRAIN entries included."""
        return self.tasks[self.sm_offsets[sm]:self.sm_offsets[sm + 1]]

    def queue(self, q: int) -> np.ndarray:
        """The tasks of queue q, in claim order."""
        return self.tasks[self.queue_offsets[q]:self.queue_offsets[q + 1]]


def wait_spans(config: ModelConfig, tasks: np.ndarray) -> np.ndarray:
    """Per task of a TASK_DTYPE array: how many counters it waits on, each until it reaches the
    task's target: counters wait .. wait + span - 1 (task semantics v0.6): hidden / BLOCK_COLS
    for a reader of a layer's input (QKV, ROUTER, a dense layer's GATE_UP, LM_HEAD), 1 for any
    other task with a wait, 0 without one. The library's rule (nmk_schedule_wait_spans), the
    one its builder, checker and kernel follow."""
    tasks = np.ascontiguousarray(tasks, dtype=TASK_DTYPE)
    spans = np.zeros(len(tasks), dtype=np.uint32)
    geometry = _GeometryRef(config)
    check(_lib().nmk_schedule_wait_spans(byref(geometry.value), tasks.ctypes.data if len(tasks) else None, len(tasks),
                                         spans.ctypes.data if len(tasks) else None))
    return spans.astype(np.int64)


def waits_in_run(config: ModelConfig, batch: int, tasks: np.ndarray) -> np.ndarray:
    """Per task of a TASK_DTYPE array, of a step of `batch` rows: whether it waits for its counters
    inside its run, its start stamp before its wait (up to POST_SCALED_MAX_BATCH rows the QKV and
    ROUTER tiles, a sparse layer's GATE_UP and every attention split; only tasks with a wait). The
    kernel's rule (nmk_schedule_waits_in_run)."""
    tasks = np.ascontiguousarray(tasks, dtype=TASK_DTYPE)
    inside = np.zeros(len(tasks), dtype=np.uint8)
    geometry = _GeometryRef(config)
    check(_lib().nmk_schedule_waits_in_run(byref(geometry.value), batch, tasks.ctypes.data if len(tasks) else None,
                                           len(tasks), inside.ctypes.data if len(tasks) else None))
    return inside.astype(bool)


def check_schedule(config: ModelConfig, plan: dict[str, int], tasks: np.ndarray, sm_offsets: np.ndarray,
                   queue_offsets: np.ndarray | None = None) -> None:
    """Raises NativeError naming the first violation when the lists and queues are unsafe to
    run; ValueError when the offsets do not describe `tasks` (plan["num_queues"] + 1 queue
    offsets, ending at len(tasks); None only without queues)."""
    geometry = _GeometryRef(config)
    tasks = np.ascontiguousarray(tasks, dtype=TASK_DTYPE)
    offsets = np.ascontiguousarray(sm_offsets, dtype=np.uint32)
    queues = None if queue_offsets is None else np.ascontiguousarray(queue_offsets, dtype=np.uint32)
    num_queues = plan.get("num_queues", 0)
    if queues is not None and len(queues) != num_queues + 1:
        raise ValueError(f"queue_offsets needs plan['num_queues'] + 1 = {num_queues + 1} entries, got {len(queues)}")
    if queues is not None or not num_queues:  # else the library refuses the missing queue offsets
        end = offsets if queues is None else queues
        furthest = max((int(o.max()) for o in (offsets, end) if len(o)), default=0)
        if not len(end) or int(end[-1]) != len(tasks) or furthest > len(tasks):
            raise ValueError(f"the offsets must end at the task array's end ({len(tasks)} tasks) and not pass it")
    c_plan = Plan(**plan)
    check(_lib().nmk_schedule_check(byref(geometry.value), byref(c_plan), tasks.ctypes.data, offsets.ctypes.data,
                                    len(offsets) - 1, None if queues is None else queues.ctypes.data))


def copy_to_host(src: torch.Tensor, dst: torch.Tensor, stream: torch.cuda.Stream) -> torch.cuda.Event:
    """Copies `src`, which the work enqueued so far on the current stream writes (a step's tokens),
    into `dst` (pinned host memory) on `stream`, after that work: nothing of the copy sits on the
    current stream between two steps' kernels (a copy there held the next step ~5 us,
    tools/step_edges.py). src's memory is not reused before the copy has read it. Returns the
    copy's completion, an event on `stream`."""
    stepped = torch.cuda.Event()
    stepped.record()
    with torch.cuda.stream(stream):
        stream.wait_event(stepped)
        dst.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
    src.record_stream(stream)
    return done


@dataclass
class MegakernelTrace:
    """What the last step recorded (Megakernel.enable_debug), rows [:batch] of each:
    x, attn, mlp fp32 [L + 1, B, H]: per layer l the residual entering it (l = L: entering
    the final norm), and the o-proj and mlp outputs of layer l - 1 (zero at l = 0);
    experts int64 [L, B, K]: each row's routed experts, ascending (-1 on dense layers)."""

    x: torch.Tensor
    attn: torch.Tensor
    mlp: torch.Tensor
    experts: torch.Tensor


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class Megakernel:
    """The whole decode forward pass of `config` as one persistent kernel per step.

    Weights and KV pages stay owned by the caller and must outlive this object; the kernel
    reads and writes them in place (k, v of each step's token go into `kv`). It streams every
    matrix in the tiled layout (tiled_layout): the experts' in place, which it tiles first
    (model.weights.tile_experts_: the reference model reads either layout), the others from
    copies it holds (tiled_copies; 2.9 GB at North Mini Code's geometry).
    """

    def __init__(self, config: ModelConfig, weights: ModelWeights, kv: PagedKVCache):
        reason = unsupported_reason(config)
        if reason:
            raise ValueError(reason)
        if weights.dtype != torch.bfloat16 or weights.device.type != "cuda":
            raise ValueError("the megakernel needs bf16 weights on a CUDA device")
        if weights.lm_head is not None:
            raise ValueError("the megakernel needs tied embeddings (lm_head is embed)")
        self.config, self.weights, self.kv = config, weights, kv
        self._geometry = _GeometryRef(config)
        tile_experts_(weights)
        # The tiled copies (tiled_copies: what tiled_bytes counts), alive as long as the kernel.
        self._tiled = {id(w): tiled_layout(w) for w in tiled_copies(weights)}

        def tiled(w: torch.Tensor | None) -> int | None:
            return None if w is None else self._tiled[id(w)].data_ptr()

        self._layers = (Layer * config.num_layers)()
        for i, lw in enumerate(weights.layers):
            self._layers[i] = Layer(
                norm=_ptr(lw.norm), qkv=tiled(lw.qkv), o=tiled(lw.o), gate_up=tiled(lw.gate_up), down=tiled(lw.down),
                router=tiled(lw.router), experts_gate_up=_ptr(lw.experts_gate_up), experts_down=_ptr(lw.experts_down),
                kv_group=config.layer_group[i], kv_slot=config.layer_slot[i])
        pages = (c_void_p * KV_MAX_GROUPS)(*[p.data_ptr() for p in kv.pages])
        num_pages = (c_uint32 * KV_MAX_GROUPS)(*kv.num_pages)
        w = Weights(embed=tiled(weights.embed), final_norm=_ptr(weights.final_norm), layers=self._layers, kv_pages=pages,
                    kv_num_pages=num_pages)
        self._handle = c_void_p()
        with torch.cuda.device(weights.device):
            check(_lib().nmk_mk_create(byref(self._geometry.value), byref(w), byref(self._handle)))
        n = c_uint32()
        check(_lib().nmk_mk_num_sms(self._handle, byref(n)))
        self.num_sms = n.value

    def close(self) -> None:
        if getattr(self, "_handle", None):
            _lib().nmk_mk_destroy(self._handle)
            self._handle = None

    __del__ = close

    def prepare(self, batch: int, max_len: int) -> None:
        """Build, check and upload the schedule a step of `batch` rows whose longest row holds
        max_len tokens runs, which the step would otherwise build first (tens of ms of host time
        at North's geometry). Safe on another thread while steps run; not while close() does."""
        check(_lib().nmk_mk_prepare(self._handle, batch, max_len))

    def enable_debug(self) -> None:
        """Record every later step's per-layer residual, attention and mlp outputs and routing."""
        size = c_uint64()
        check(_lib().nmk_mk_debug_bytes(self._handle, byref(size)))
        self._debug = torch.full((size.value // 4,), -1, dtype=torch.int32, device=self.weights.device)
        check(_lib().nmk_mk_set_debug(self._handle, self._debug.data_ptr(), size.value))

    def trace(self, batch: int) -> MegakernelTrace:
        """The records of the last step (enable_debug first) for its `batch` rows."""
        if getattr(self, "_debug", None) is None:
            raise RuntimeError("call enable_debug() before the step to trace")
        c = self.config
        floats = (c.num_layers + 1) * DEBUG_STAGES * MAX_BATCH * c.hidden_size
        stages = self._debug[:floats].view(torch.float32).view(c.num_layers + 1, DEBUG_STAGES, MAX_BATCH, c.hidden_size)
        experts = self._debug[floats:].view(c.num_layers, MAX_BATCH, c.top_k)[:, :batch].long()
        x, attn, mlp = (stages[:, s, :batch].clone() for s in DebugStage)
        return MegakernelTrace(x, attn, mlp, experts)

    def enable_timing(self, capacity: int = 1 << 18) -> None:
        """Time each task of every later step (the first `capacity` of its task array: lists,
        then queues)."""
        self._timing = torch.zeros(capacity, 4, dtype=torch.int64, device=self.weights.device)
        check(_lib().nmk_mk_set_timing(self._handle, self._timing.data_ptr(), capacity))

    def task_times(self) -> torch.Tensor:
        """int64 [tasks, 4] of the last timed step: ns when each task's wait began, its run
        began and it ended (globaltimer, relative to the step's first), and op | layer << 8 |
        sm << 16 (the CTA that ran it). DRAIN entries are not timed."""
        if getattr(self, "_timing", None) is None:
            raise RuntimeError("call enable_timing() before the step to time")
        t = self._timing[self._timing[:, 2] > 0].cpu()
        t[:, :3] -= t[:, 0].min()
        return t

    def step(self, tokens: torch.Tensor, positions: list[int], block_tables: list[torch.Tensor],
             logits: torch.Tensor | None = None, next_tokens: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step on the current stream. tokens int32 [B] (device); positions: host
        list of each row's new position; block_tables per group int32 [B, cols] (device).
        Returns (logits fp32 [B, V], greedy next tokens int32 [B])."""
        b = len(positions)
        dev = self.weights.device
        if not 1 <= b <= MAX_BATCH or tokens.shape != (b,):
            raise ValueError(f"need 1..{MAX_BATCH} rows with one token each, got {tuple(tokens.shape)} / {b}")
        if len(block_tables) != len(self.kv.pages):
            raise ValueError(f"need {len(self.kv.pages)} block tables, got {len(block_tables)}")
        tables = [t.to(dev, torch.int32).contiguous() for t in block_tables]
        if any(t.shape[0] != b or t.shape[1] != tables[0].shape[1] for t in tables):
            raise ValueError("block tables must all be [B, cols]")
        tokens = tokens.to(dev, torch.int32).contiguous()
        if logits is None:
            logits = torch.empty(b, self.config.vocab_size, dtype=torch.float32, device=dev)
        elif (logits.shape != (b, self.config.vocab_size) or logits.dtype != torch.float32
              or logits.device != dev or not logits.is_contiguous()):
            raise ValueError(f"logits must be contiguous float32 [{b}, {self.config.vocab_size}] on {dev}")
        if next_tokens is None:
            next_tokens = torch.empty(b, dtype=torch.int32, device=dev)
        elif (next_tokens.shape != (b,) or next_tokens.dtype != torch.int32 or next_tokens.device != dev
              or not next_tokens.is_contiguous()):
            raise ValueError(f"next_tokens must be contiguous int32 [{b}] on {dev}")
        if next_tokens.data_ptr() == tokens.data_ptr():
            raise ValueError("next_tokens must not be the input tokens' buffer")
        host_pos = (c_int32 * b)(*positions)
        args = StepArgs(batch=b, host_positions=host_pos, tokens=tokens.data_ptr(),
                        table_cols=tables[0].shape[1], logits=logits.data_ptr(), next_tokens=next_tokens.data_ptr())
        for g, t in enumerate(tables):
            args.block_tables[g] = t.data_ptr()
        stream = torch.cuda.current_stream(dev).cuda_stream
        check(_lib().nmk_mk_step(self._handle, byref(args), stream))
        self._keep = (tokens, tables)  # alive until the next step is enqueued
        return logits, next_tokens
