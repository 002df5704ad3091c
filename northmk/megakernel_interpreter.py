"""A PyTorch interpreter of the megakernel's instruction stream, for machines without a GPU.

It runs a host-built Schedule task by task, in an order the counters allow (each SM's list in
order, a task only once each counter it waits on reached its target; an SM at DRAIN(q) claims
the next unclaimed task of queue q and holds it until it may run, until q is exhausted, and
claims q's first as it reaches the list task before the DRAIN), on the same buffers and with
the same bf16 roundings as the kernel's tasks (cuda/mk/op_*.cuh), v0.6 semantics
(include/northmk.h): layer l's input is a sum that layer l - 1's OPROJ and DOWN tasks add into
(layer 0's: the embedding, from the NORM tiles), each signalling the counter of the column
block it wrote, and its readers (QKV, ROUTER, a dense GATE_UP, LM_HEAD) wait on all of the
blocks' counters (wait_spans); every reader of the normed input but a sparse GATE_UP rounds and
normalizes that sum itself, QKV and ROUTER up to POST_SCALED_MAX_BATCH rows by scaling their
GEMV's outputs with each row's rms; the layer's last ROUTER tile (the routing tile, which
runs once the layer's other ROUTER tiles have run: the kernel's tile polls their logits) writes
the normed input's image, which sparse GATE_UP tasks read, and routes the layer, DOWN weighs
each pick's output by its routing weight, and an attention pair's last split to run
merges its splits. Set beside the reference (megakernel_oracle) it checks what the schedule
builder decides: tile sizes, attention splits, expert slots, the wiring of counters, the
buffers each task reads and writes.

    run_schedule(config, weights, schedule, tokens, positions, tables, kv) -> (logits, MegakernelTrace)
    execution_order(schedule) -> [(sm, task index)]   who runs what, in an order the counters allow
    route(router_logits, top_k), expert_slots(experts, num_slots)   the routing rule
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import PAGE_SIZE, SLIDING, ModelConfig
from .megakernel import POST_SCALED_MAX_BATCH, MegakernelTrace, Opcode, Schedule
from .model.kv import PagedKVCache
from .model.weights import ModelWeights


def rb(t: torch.Tensor) -> torch.Tensor:
    """Round fp32 to bf16 and back: the kernel's rounding points."""
    return t.to(torch.bfloat16).float()


def route(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing of router logits fp32 [B, E]: each row's top_k experts by logit (ties: the
    lower id first) in ascending id, int64 [B, K], and their weights bf16(sigmoid(logit)) [B, K]."""
    picked = torch.sort(-router_logits, dim=-1, stable=True).indices[:, :top_k]
    experts = picked.sort(dim=-1).values
    return experts, rb(torch.sigmoid(router_logits.gather(1, experts)))


def expert_slots(experts: torch.Tensor, num_slots: int) -> tuple[list[int], list[list[int]]]:
    """slot_expert [num_slots]: the distinct experts of `experts` [B, K] in ascending id (-1
    past them); slot_k [num_slots][B]: where each row lists the slot's expert (-1: it does not)."""
    used = sorted(set(experts.flatten().tolist()))
    slot_expert = [used[y] if y < len(used) else -1 for y in range(num_slots)]
    rows = experts.tolist()
    return slot_expert, [[row.index(e) if e in row else -1 for row in rows] for e in slot_expert]


def split_keys(c: ModelConfig, layer: int, pos: int, split: int, splits: int) -> tuple[int, int]:
    """Keys [key0, key1) that attention split `split` of `splits` reads for a row at pos
    (cuda/mk/op_attention.cuh's cut of the live pages; empty when key1 <= key0)."""
    lo = max(0, pos - c.sliding_window + 1) if c.layer_types[layer] == SLIDING else 0
    first = lo // PAGE_SIZE
    pages = pos // PAGE_SIZE - first + 1
    key0 = max(lo, (first + split * pages // splits) * PAGE_SIZE)
    key1 = min(pos + 1, (first + (split + 1) * pages // splits) * PAGE_SIZE)
    return key0, key1


class _Step:
    """Buffers of one step (fp32 unless the kernel keeps them in bf16, where they are rounded)."""

    def __init__(self, config: ModelConfig, weights: ModelWeights, plan: dict, tokens, positions, tables, kv):
        c, B = config, plan["batch"]
        self.c, self.w, self.plan, self.kv = c, weights, plan, kv
        self.tokens, self.positions, self.tables = tokens.tolist(), positions, tables
        # the residual entering layer l at resid[l % 3]: fp32 sums (Params::resid)
        self.resid = torch.zeros(3, B, c.hidden_size)
        self.router_logits = torch.zeros(B, c.num_experts)
        self.normed_image = torch.zeros(B, c.hidden_size)  # written whole by the routing tile
        self.q = torch.zeros(B, c.q_size)
        self.part: dict[tuple[int, int, int], tuple] = {}  # (b, kv head, split) -> (acc [G, D], m [G], l [G])
        self.tickets = [[0] * c.num_kv_heads for _ in range(B)]  # finished splits per (row, kv head)
        self.attn = torch.zeros(B, c.q_size)
        self.slot_expert = [-1] * plan["expert_slots"]
        self.slot_k = [[-1] * B for _ in range(plan["expert_slots"])]
        self.topk_weight = torch.zeros(B, c.top_k)
        self.act = torch.zeros(plan["expert_slots"], B, max(c.moe_intermediate_size, c.dense_intermediate_size))
        self.logits = torch.zeros(B, c.vocab_size)
        self.trace = MegakernelTrace(torch.zeros(c.num_layers + 1, B, c.hidden_size),
                                     torch.zeros(c.num_layers + 1, B, c.hidden_size),
                                     torch.zeros(c.num_layers + 1, B, c.hidden_size),
                                     torch.full((c.num_layers, B, c.top_k), -1, dtype=torch.long))

    def rms(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, H], the input of `layer` (num_layers: of the final norm) with its sums rounded
        to bf16, and each row's rms [B] from x's own sums of squares."""
        x = rb(self.resid[layer % 3])
        return x, torch.rsqrt(x.pow(2).sum(-1) / self.c.hidden_size + self.c.norm_eps)

    def normed(self, weight: torch.Tensor, layer: int) -> torch.Tensor:
        """h [B, H]: the input of `layer` normalized, bf16(bf16(x * rms) * weight)."""
        x, rms = self.rms(layer)
        return rb(rb(x * rms[:, None]) * weight.float())

    def normed_gemv(self, weight: torch.Tensor, layer: int, w: torch.Tensor) -> torch.Tensor:
        """bf16 outputs [B, R] of w [R, H] over the normed input of `layer` (QKV's, ROUTER's
        gemv_normed): up to POST_SCALED_MAX_BATCH rows scaled after the GEMV, bf16(rms_b *
        (g_b . w)) with g = bf16(x * weight); past that bf16(h_b . w) of the normed h."""
        if self.plan["batch"] > POST_SCALED_MAX_BATCH:
            return rb(self.normed(weight, layer) @ w.float().T)
        x, rms = self.rms(layer)
        return rb(rms[:, None] * (rb(x * weight.float()) @ w.float().T))

    # ---- tasks (cuda/mk/op_*.cuh) -------------------------------------------------------------
    def norm(self, tile: int) -> None:
        """Layer 0's input: the embedding's columns of the tile; layer 1's sums zeroed there."""
        cols = self.plan["norm_cols"]
        span = slice(tile * cols, (tile + 1) * cols)
        for b in range(self.plan["batch"]):
            v = self.w.embed[self.tokens[b], span].float()
            self.resid[0, b, span], self.resid[1, b, span] = v, 0.0
            self.trace.x[0, b, span] = v

    def qkv(self, layer: int, tile: int) -> None:
        """Rows of qkv over the normed input (normed_gemv), RoPE on the rounded outputs: q, and
        k, v into the paged cache."""
        c, rows = self.c, self.plan["qkv_rows"]
        r0, r1 = tile * rows, min((tile + 1) * rows, c.q_size + 2 * c.kv_size)
        out = self.normed_gemv(self.w.layers[layer].norm, layer, self.w.layers[layer].qkv[r0:r1])  # [B, rows]
        for b, pos in enumerate(self.positions):
            for r in range(r0, r1, 2):
                v0, v1 = out[b, r - r0], out[b, r - r0 + 1]
                if c.rope_layers[layer] and r < c.q_size + c.kv_size:
                    d = r % c.head_dim
                    angle = torch.tensor(pos, dtype=torch.float32) / torch.tensor(c.rope_theta) ** (d / c.head_dim)
                    cos, sin = torch.cos(angle), torch.sin(angle)
                    v0, v1 = rb(v0 * cos - v1 * sin), rb(v1 * cos + v0 * sin)
                if r < c.q_size:
                    self.q[b, r], self.q[b, r + 1] = v0, v1
                    continue
                kv, col = int(r >= c.q_size + c.kv_size), r - c.q_size - (r >= c.q_size + c.kv_size) * c.kv_size
                page = int(self.tables[c.layer_group[layer]][b, pos // PAGE_SIZE])
                pages = self.kv.layer_view(layer)
                head, dim = col // c.head_dim, col % c.head_dim
                pages[page, kv, head, pos % PAGE_SIZE, dim:dim + 2] = torch.stack((v0, v1)).to(pages.dtype)

    def attention(self, layer: int, b: int, kvh: int, split: int, splits: int) -> None:
        c, G = self.c, self.c.gqa_group
        key0, key1 = split_keys(c, layer, self.positions[b], split, splits)
        q = self.q[b].view(c.num_heads, c.head_dim)[kvh * G:(kvh + 1) * G] * c.head_dim ** -0.5  # [G, D]
        if key1 <= key0:
            self.part[b, kvh, split] = (torch.zeros(G, c.head_dim), torch.full((G,), -torch.inf), torch.zeros(G))
        else:
            table, pages = self.tables[c.layer_group[layer]][b], self.kv.layer_view(layer)
            keys = torch.arange(key0, key1)
            rows = pages[table[keys // PAGE_SIZE].long(), :, kvh, keys % PAGE_SIZE].float()  # [S, 2, D]
            scores = q @ rows[:, 0].T  # [G, S]
            m = scores.max(-1).values
            e = torch.exp(scores - m[:, None])
            self.part[b, kvh, split] = (e @ rows[:, 1], m, e.sum(-1))
        self.tickets[b][kvh] += 1  # the kernel's atomic ticket: the pair's last split merges and rezeroes it
        if self.tickets[b][kvh] == splits:
            self.tickets[b][kvh] = 0
            self.merge(b, kvh, splits)

    def merge(self, b: int, kvh: int, splits: int) -> None:
        c, G = self.c, self.c.gqa_group
        acc, m, l = (torch.stack(t) for t in zip(*(self.part[b, kvh, s] for s in range(splits))))
        mx = m.max(0).values
        scale = torch.where(m == -torch.inf, torch.zeros_like(m), torch.exp(m - mx))  # [splits, G]
        out = (acc * scale[..., None]).sum(0) / (l * scale).sum(0)[:, None]
        self.attn[b].view(c.num_heads, c.head_dim)[kvh * G:(kvh + 1) * G] = rb(out)

    def oproj(self, layer: int, tile: int) -> None:
        """x + attn into the next layer's sums; the layer after next's zeroed."""
        rows = self.plan["oproj_rows"]
        r0, r1 = tile * rows, min((tile + 1) * rows, self.c.hidden_size)
        a = rb(self.attn @ self.w.layers[layer].o[r0:r1].float().T)
        x = rb(self.resid[layer % 3, :, r0:r1])
        self.resid[(layer + 1) % 3, :, r0:r1] += rb(x + a)
        self.resid[(layer + 2) % 3, :, r0:r1] = 0.0
        self.trace.x[layer, :, r0:r1], self.trace.attn[layer + 1, :, r0:r1] = x, a

    def router(self, layer: int, tile: int) -> None:
        """The tile's experts' logits (normed_gemv); the routing tile (the layer's last, run after
        the others: execution_order) writes the normed image and routes the layer."""
        rows = self.plan["router_rows"]
        e0, e1 = tile * rows, min((tile + 1) * rows, self.c.num_experts)
        lw = self.w.layers[layer]
        self.router_logits[:, e0:e1] = self.normed_gemv(lw.norm, layer, lw.router[e0:e1])
        if tile == self.plan["router_tiles"] - 1:
            self.normed_image[:] = self.normed(lw.norm, layer)  # the exact image, either way
            self.route(layer)

    def route(self, layer: int) -> None:
        """The routing of `layer` from all of router_logits, published for GATE_UP and DOWN."""
        experts, weights = route(self.router_logits, self.c.top_k)
        self.slot_expert, self.slot_k = expert_slots(experts, self.plan["expert_slots"])
        self.topk_weight[:], self.trace.experts[layer] = weights, experts

    def gate_up(self, layer: int, tile: int, y: int) -> None:
        lw = self.w.layers[layer]
        if lw.is_dense:
            gate_up, h = lw.gate_up, self.normed(lw.norm, layer)
        elif self.slot_expert[y] < 0:
            return
        else:
            gate_up, h = lw.expert(self.slot_expert[y])[0], self.normed_image.clone()
        inter = gate_up.shape[0] // 2
        cols = self.plan["dense_cols" if lw.is_dense else "moe_cols"]
        c0, c1 = tile * cols, min((tile + 1) * cols, inter)
        g = rb(h @ gate_up[c0:c1].float().T)
        u = rb(h @ gate_up[inter + c0:inter + c1].float().T)
        self.act[y, :, c0:c1] = rb(rb(F.silu(g)) * u)

    def down(self, layer: int, tile: int, y: int) -> None:
        lw = self.w.layers[layer]
        if lw.is_dense:
            down, routed = lw.down, [(b, 0) for b in range(self.plan["batch"])]
        elif self.slot_expert[y] < 0:
            return
        else:
            down = lw.expert(self.slot_expert[y])[1]
            routed = [(b, k) for b, k in enumerate(self.slot_k[y]) if k >= 0]
        rows = self.plan["dense_down_rows" if lw.is_dense else "moe_down_rows"]
        r0, r1 = tile * rows, min((tile + 1) * rows, self.c.hidden_size)
        inter = down.shape[1]
        for b, k in routed:  # weighted as the reference weighs it: bf16(w * bf16(out)); dense: w = 1
            out = rb(self.act[y, b, :inter] @ down[r0:r1].float().T)
            v = out if lw.is_dense else rb(self.topk_weight[b, k] * out)
            self.resid[(layer + 1) % 3, b, r0:r1] += v  # into the next layer's sums
            self.trace.mlp[layer + 1, b, r0:r1] += v

    def lm_head(self, tile: int) -> None:
        rows = self.plan["lm_rows"]
        r0, r1 = tile * rows, min((tile + 1) * rows, self.c.vocab_size)
        h = self.normed(self.w.final_norm, self.c.num_layers)
        self.logits[:, r0:r1] = rb(h @ self.w.embed[r0:r1].float().T) * self.c.logit_scale

    def run(self, t) -> None:
        op, layer, x, y, z = Opcode(int(t["op"])), int(t["layer"]), int(t["x"]), int(t["y"]), int(t["z"])
        if op == Opcode.NORM:
            self.norm(x)
        elif op == Opcode.FINAL_NORM:
            raise ValueError("opcode FINAL_NORM is retired (v0.5): the LM head normalizes the last layer's sums")
        elif op == Opcode.QKV:
            self.qkv(layer, x)
        elif op == Opcode.ROUTER:
            self.router(layer, x)
        elif op == Opcode.ATTN:
            self.attention(layer, x, y, z & 0xFF, z >> 8)
        elif op == Opcode.COMBINE:
            raise ValueError("opcode COMBINE is retired (v0.3): the last ATTN split of a pair merges")
        elif op == Opcode.OPROJ:
            self.oproj(layer, x)
        elif op == Opcode.GATE_UP:
            self.gate_up(layer, x, y)
        elif op == Opcode.DOWN:
            self.down(layer, x, y)
        elif op == Opcode.LM_HEAD:
            self.lm_head(x)
        elif op == Opcode.ARGMAX:  # the greedy token is logits.argmax, read by the caller
            self.trace.x[self.c.num_layers, x] = rb(self.resid[self.c.num_layers % 3, x])
        elif op == Opcode.DRAIN:
            raise ValueError("a DRAIN entry is not a task: execution_order claims its queue's tasks instead")


class Lists:
    """The task lists' cursors and the queues' heads as the kernel walks them (execution_order
    here, and the timed replays of bench_simulate and bench_fluid): `next(sm)` is the
    list's next task, claiming queue q's next task at a DRAIN(q) entry (held until it ran) and
    passing the entry once the queue is dry; a list task followed by DRAIN(q) claims q's next
    task when it is first returned (the kernel's run_list claims it as the list task begins);
    `ran(sm, i)` moves past task i."""

    def __init__(self, schedule):
        self.ops = schedule.tasks["op"].astype(int).tolist()
        self.queue_x = schedule.tasks["x"].astype(int).tolist()
        self.cursor = [int(o) for o in schedule.sm_offsets[:-1]]
        self.list_end = [int(o) for o in schedule.sm_offsets[1:]]
        self.head = [int(o) for o in schedule.queue_offsets[:-1]]
        self.queue_end = [int(o) for o in schedule.queue_offsets[1:]]
        self.held: list[int | None] = [None] * schedule.num_sms

    def next(self, sm: int) -> int | None:
        """The SM's next task, None when its list is done."""
        while self.cursor[sm] < self.list_end[sm]:
            i = self.cursor[sm]
            if self.ops[i] != Opcode.DRAIN:
                if i + 1 < self.list_end[sm] and self.ops[i + 1] == Opcode.DRAIN and self.held[sm] is None:
                    self.claim(sm, self.queue_x[i + 1])
                return i
            if self.held[sm] is not None:
                return self.held[sm]
            if self.claim(sm, self.queue_x[i]):
                return self.held[sm]
            self.cursor[sm] += 1
        return None

    def claim(self, sm: int, q: int) -> bool:
        """The SM holds queue q's next task, if the queue has one left."""
        if self.head[q] >= self.queue_end[q]:
            return False
        self.held[sm], self.head[q] = self.head[q], self.head[q] + 1
        return True

    def ran(self, sm: int, i: int) -> None:
        if self.held[sm] == i:
            self.held[sm] = None
        else:
            self.cursor[sm] += 1



def execution_order(schedule: Schedule) -> list[tuple[int, int]]:
    """(sm, index into schedule.tasks) of every task but the DRAIN entries, in an order the
    kernel may run them: round-robin over the SMs, each running as far as its waits allow (a
    task once every counter of its wait span, schedule.wait_spans(), reached its target; a
    layer's routing tile, its last ROUTER tile, once the layer's other ROUTER tiles ran), its
    list and claims walked as the kernel does (Lists). Deterministic. RuntimeError if no SM can
    make progress (a deadlock)."""
    tasks, num_sms = schedule.tasks, schedule.num_sms
    waits, targets, signals = (tasks[f].astype(int).tolist() for f in ("wait", "target", "signal"))
    ops, layers, xs = (tasks[f].astype(int).tolist() for f in ("op", "layer", "x"))
    routing_tile = schedule.plan.get("router_tiles", 0) - 1  # -1: no ROUTER tiles
    routers_ran: dict[int, int] = {}  # per layer
    spans = schedule.wait_spans().tolist()
    num_queues = len(schedule.queue_offsets) - 1
    for sm in range(num_sms):
        for t in schedule.tasks_of(sm):
            if t["op"] == Opcode.DRAIN and int(t["x"]) >= num_queues:
                raise ValueError(f"SM {sm} drains queue {int(t['x'])}, the schedule has {num_queues}")
    counters = [0] * schedule.plan["num_counters"]
    lists = Lists(schedule)
    order: list[tuple[int, int]] = []

    def ready(i: int) -> bool:
        if ops[i] == Opcode.ROUTER and xs[i] == routing_tile and routers_ran.get(layers[i], 0) < routing_tile:
            return False  # it polls the other tiles' logits
        return all(counters[c] >= targets[i] for c in range(waits[i], waits[i] + spans[i]))

    progressed = True
    while progressed:
        progressed = False
        for sm in range(num_sms):
            while (i := lists.next(sm)) is not None and ready(i):
                order.append((sm, i))
                if signals[i] >= 0:
                    counters[signals[i]] += 1
                if ops[i] == Opcode.ROUTER:
                    routers_ran[layers[i]] = routers_ran.get(layers[i], 0) + 1
                lists.ran(sm, i)
                progressed = True
    stuck = [sm for sm in range(num_sms) if lists.cursor[sm] < lists.list_end[sm]]
    if stuck:
        raise RuntimeError(f"deadlock: SMs {stuck[:8]} wait forever")
    undrained = [q for q in range(num_queues) if lists.head[q] < lists.queue_end[q]]
    if undrained:
        raise RuntimeError(f"queues {undrained[:8]} are never drained: no list holds their DRAIN")
    return order


def run_schedule(config: ModelConfig, weights: ModelWeights, schedule: Schedule, tokens: torch.Tensor,
                 positions: list[int], tables: list[torch.Tensor], kv: PagedKVCache
                 ) -> tuple[torch.Tensor, MegakernelTrace]:
    """Executes the schedule's tasks on CPU tensors (weights and kv on the CPU) in
    execution_order; writes k, v into kv. Returns fp32 logits [B, V] and the per-layer records
    the kernel's debug capture makes. Raises ValueError on rows that do not match the
    schedule's batch or a task with a retired or unknown opcode, RuntimeError if no SM can
    make progress (a deadlock)."""
    batch = schedule.plan["batch"]
    if tokens.shape != (batch,) or len(positions) != batch:
        raise ValueError(f"the schedule is for {batch} rows, got {tuple(tokens.shape)} tokens and "
                         f"{len(positions)} positions")
    order = execution_order(schedule)
    step = _Step(config, weights, schedule.plan, tokens, positions, tables, kv)
    for _, i in order:
        step.run(schedule.tasks[i])
    return step.logits, step.trace
