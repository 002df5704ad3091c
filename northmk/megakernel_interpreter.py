"""A PyTorch interpreter of the megakernel's instruction stream, for machines without a GPU.

It runs a host-built Schedule task by task, in an order the counters allow (each SM's list
in order, a task only once its counter reached its target), on the same buffers and with
the same bf16 roundings as the kernel's tasks (cuda/mk/op_*.cuh). Set beside the reference
(megakernel_oracle) it checks what the schedule builder decides: tile sizes, attention
splits, expert slots, the wiring of counters, the buffers each task reads and writes.

    run_schedule(config, weights, schedule, tokens, positions, tables, kv) -> (logits, MegakernelTrace)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import PAGE_SIZE, SLIDING, ModelConfig
from .megakernel import MegakernelTrace, Opcode, Schedule
from .model.kv import PagedKVCache
from .model.weights import ModelWeights


def rb(t: torch.Tensor) -> torch.Tensor:
    """Round fp32 to bf16 and back: the kernel's rounding points."""
    return t.to(torch.bfloat16).float()


class _Step:
    """Buffers of one step (fp32 unless the kernel keeps them in bf16, where they are rounded)."""

    def __init__(self, config: ModelConfig, weights: ModelWeights, plan: dict, tokens, positions, tables, kv):
        c, B = config, plan["batch"]
        self.c, self.w, self.plan, self.kv = c, weights, plan, kv
        self.tokens, self.positions, self.tables = tokens.tolist(), positions, tables
        self.x = torch.zeros(B, c.hidden_size)
        self.h = torch.zeros(B, c.hidden_size)
        self.q = torch.zeros(B, c.q_size)
        self.part: dict[tuple[int, int, int], tuple] = {}  # (b, kv head, split) -> (acc [G, D], m [G], l [G])
        self.attn = torch.zeros(B, c.q_size)
        self.o = torch.zeros(B, c.hidden_size)
        self.slot_expert = [-1] * plan["expert_slots"]
        self.slot_k = [[-1] * B for _ in range(plan["expert_slots"])]
        self.topk_weight = torch.zeros(B, c.top_k)
        self.act = torch.zeros(plan["expert_slots"], B, max(c.moe_intermediate_size, c.dense_intermediate_size))
        self.mlp = torch.zeros(B, c.top_k, c.hidden_size)
        self.logits = torch.zeros(B, c.vocab_size)
        self.trace = MegakernelTrace(torch.zeros(c.num_layers + 1, B, c.hidden_size),
                                     torch.zeros(c.num_layers + 1, B, c.hidden_size),
                                     torch.zeros(c.num_layers + 1, B, c.hidden_size),
                                     torch.full((c.num_layers, B, c.top_k), -1, dtype=torch.long))

    # ---- tasks (cuda/mk/op_*.cuh) -------------------------------------------------------------
    def norm(self, layer: int, final: bool) -> None:
        c, prev = self.c, (self.c.num_layers - 1 if final else layer - 1)
        weight = (self.w.final_norm if final else self.w.layers[layer].norm).float()
        for b in range(self.plan["batch"]):
            if prev < 0:
                v, attn, mlp = self.w.embed[self.tokens[b]].float(), 0.0, 0.0
            else:
                attn, mlp = self.o[b].clone(), self.mlp_out(prev, b)
                v = rb(rb(self.x[b] + attn) + mlp)
            self.trace.x[prev + 1, b], self.trace.attn[prev + 1, b], self.trace.mlp[prev + 1, b] = v, attn, mlp
            self.x[b] = v
            rms = torch.rsqrt(v.pow(2).mean() + c.norm_eps)
            self.h[b] = rb(rb(v * rms) * weight)

    def mlp_out(self, prev: int, b: int) -> torch.Tensor:
        if self.w.layers[prev].is_dense:
            return self.mlp[b, 0].clone()
        total = torch.zeros(self.c.hidden_size)
        for k in range(self.c.top_k):
            total = rb(total + rb(self.topk_weight[b, k] * self.mlp[b, k]))
        return total

    def qkv(self, layer: int, tile: int) -> None:
        c, rows = self.c, self.plan["qkv_rows"]
        r0, r1 = tile * rows, min((tile + 1) * rows, c.q_size + 2 * c.kv_size)
        out = rb(self.h[:self.plan["batch"]] @ self.w.layers[layer].qkv[r0:r1].float().T)  # [B, rows]
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

    def key_range(self, layer: int, b: int, split: int, splits: int) -> tuple[int, int]:
        c, pos = self.c, self.positions[b]
        lo = max(0, pos - c.sliding_window + 1) if c.layer_types[layer] == SLIDING else 0
        first = lo // PAGE_SIZE
        pages = pos // PAGE_SIZE - first + 1
        key0 = max(lo, (first + split * pages // splits) * PAGE_SIZE)
        key1 = min(pos + 1, (first + (split + 1) * pages // splits) * PAGE_SIZE)
        return key0, key1

    def attention(self, layer: int, b: int, kvh: int, split: int, splits: int) -> None:
        c, G = self.c, self.c.gqa_group
        key0, key1 = self.key_range(layer, b, split, splits)
        q = self.q[b].view(c.num_heads, c.head_dim)[kvh * G:(kvh + 1) * G] * c.head_dim ** -0.5  # [G, D]
        if key1 <= key0:
            self.part[b, kvh, split] = (torch.zeros(G, c.head_dim), torch.full((G,), -torch.inf), torch.zeros(G))
            return
        table, pages = self.tables[c.layer_group[layer]][b], self.kv.layer_view(layer)
        keys = torch.arange(key0, key1)
        rows = pages[table[keys // PAGE_SIZE].long(), :, kvh, keys % PAGE_SIZE].float()  # [S, 2, D]
        scores = q @ rows[:, 0].T  # [G, S]
        m = scores.max(-1).values
        e = torch.exp(scores - m[:, None])
        self.part[b, kvh, split] = (e @ rows[:, 1], m, e.sum(-1))

    def combine(self, b: int, kvh: int, splits: int) -> None:
        c, G = self.c, self.c.gqa_group
        acc, m, l = (torch.stack(t) for t in zip(*(self.part[b, kvh, s] for s in range(splits))))
        mx = m.max(0).values
        scale = torch.where(m == -torch.inf, torch.zeros_like(m), torch.exp(m - mx))  # [splits, G]
        out = (acc * scale[..., None]).sum(0) / (l * scale).sum(0)[:, None]
        self.attn[b].view(c.num_heads, c.head_dim)[kvh * G:(kvh + 1) * G] = rb(out)

    def oproj(self, layer: int, tile: int) -> None:
        rows = self.plan["oproj_rows"]
        r0, r1 = tile * rows, min((tile + 1) * rows, self.c.hidden_size)
        self.o[:, r0:r1] = rb(self.attn[:self.plan["batch"]] @ self.w.layers[layer].o[r0:r1].float().T)

    def router(self, layer: int) -> None:
        c, B = self.c, self.plan["batch"]
        logits = rb(self.h[:B] @ self.w.layers[layer].router.float().T)  # [B, E]
        for b in range(B):
            # top-k by value, ties to the lower id (a stable sort of the negated logits)
            picked = sorted(torch.sort(-logits[b], stable=True).indices[:c.top_k].tolist())
            self.topk_weight[b] = rb(torch.sigmoid(logits[b, picked]))
            self.trace.experts[layer, b] = torch.tensor(picked)
        used = sorted(set(self.trace.experts[layer, :B].flatten().tolist()))
        for y in range(self.plan["expert_slots"]):
            self.slot_expert[y] = used[y] if y < len(used) else -1
            if y < len(used):
                self.slot_k[y] = [self.trace.experts[layer, b].tolist().index(used[y])
                                  if used[y] in self.trace.experts[layer, b].tolist() else -1 for b in range(B)]

    def slot(self, layer: int, y: int):
        """(gate_up [2I, H], down [H, I], routed rows with their top-k index) of mlp slot y, or None."""
        lw = self.w.layers[layer]
        if lw.is_dense:
            return lw.gate_up, lw.down, [(b, 0) for b in range(self.plan["batch"])]
        e = self.slot_expert[y]
        if e < 0:
            return None
        return lw.experts_gate_up[e], lw.experts_down[e], [(b, k) for b, k in enumerate(self.slot_k[y]) if k >= 0]

    def gate_up(self, layer: int, tile: int, y: int) -> None:
        s = self.slot(layer, y)
        if s is None:
            return
        gate_up, _, _ = s
        inter = gate_up.shape[0] // 2
        cols = self.plan["dense_cols" if self.w.layers[layer].is_dense else "moe_cols"]
        c0, c1 = tile * cols, min((tile + 1) * cols, inter)
        B = self.plan["batch"]
        g = rb(self.h[:B] @ gate_up[c0:c1].float().T)
        u = rb(self.h[:B] @ gate_up[inter + c0:inter + c1].float().T)
        self.act[y, :B, c0:c1] = rb(rb(F.silu(g)) * u)

    def down(self, layer: int, tile: int, y: int) -> None:
        s = self.slot(layer, y)
        if s is None:
            return
        _, down, routed = s
        rows = self.plan["dense_down_rows" if self.w.layers[layer].is_dense else "moe_down_rows"]
        r0, r1 = tile * rows, min((tile + 1) * rows, self.c.hidden_size)
        inter = down.shape[1]
        for b, k in routed:
            self.mlp[b, k, r0:r1] = rb(self.act[y, b, :inter] @ down[r0:r1].float().T)

    def lm_head(self, tile: int) -> None:
        rows, B = self.plan["lm_rows"], self.plan["batch"]
        r0, r1 = tile * rows, min((tile + 1) * rows, self.c.vocab_size)
        self.logits[:, r0:r1] = rb(self.h[:B] @ self.w.embed[r0:r1].float().T) * self.c.logit_scale

    def run(self, t) -> None:
        op, layer, x, y, z = Opcode(int(t["op"])), int(t["layer"]), int(t["x"]), int(t["y"]), int(t["z"])
        if op in (Opcode.NORM, Opcode.FINAL_NORM):
            self.norm(layer, op == Opcode.FINAL_NORM)
        elif op == Opcode.QKV:
            self.qkv(layer, x)
        elif op == Opcode.ROUTER:
            self.router(layer)
        elif op == Opcode.ATTN:
            self.attention(layer, x, y, z & 0xFF, z >> 8)
        elif op == Opcode.COMBINE:
            self.combine(x, y, z)
        elif op == Opcode.OPROJ:
            self.oproj(layer, x)
        elif op == Opcode.GATE_UP:
            self.gate_up(layer, x, y)
        elif op == Opcode.DOWN:
            self.down(layer, x, y)
        elif op == Opcode.LM_HEAD:
            self.lm_head(x)
        # ARGMAX: the greedy token is logits.argmax, read by the caller


def run_schedule(config: ModelConfig, weights: ModelWeights, schedule: Schedule, tokens: torch.Tensor,
                 positions: list[int], tables: list[torch.Tensor], kv: PagedKVCache
                 ) -> tuple[torch.Tensor, MegakernelTrace]:
    """Executes the schedule's tasks on CPU tensors (weights and kv on the CPU); writes k, v into
    kv. Returns fp32 logits [B, V] and the per-layer records the kernel's debug capture makes.
    Raises RuntimeError if no SM can make progress (a deadlock)."""
    step = _Step(config, weights, schedule.plan, tokens, positions, tables, kv)
    counters = [0] * schedule.plan["num_counters"]
    cursor = [0] * schedule.num_sms
    remaining = len(schedule.tasks)
    while remaining:
        progressed = False
        for sm in range(schedule.num_sms):
            tasks = schedule.tasks_of(sm)
            while cursor[sm] < len(tasks):
                t = tasks[cursor[sm]]
                if t["wait"] >= 0 and counters[t["wait"]] < t["target"]:
                    break
                step.run(t)
                if t["signal"] >= 0:
                    counters[t["signal"]] += 1
                cursor[sm] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {sm: cursor[sm] for sm in range(schedule.num_sms) if cursor[sm] < len(schedule.tasks_of(sm))}
            raise RuntimeError(f"deadlock: SMs {sorted(stuck)[:8]} wait forever")
    return step.logits, step.trace
