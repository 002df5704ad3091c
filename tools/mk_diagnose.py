"""One megakernel step with debug capture beside the reference: where does it first diverge?

    python tools/mk_diagnose.py [--layers 49] [--contexts 1 100 4097] [--small] [--out DIR]

Prints per layer the cosine of the kernel's residual against the free-running (routing-guided)
reference, and of each layer's attention / mlp output against the reference layer fed the
kernel's own input (local error: a bug shows up here at the layer that has it). --small: a
narrow 2-layer model, quick enough for compute-sanitizer.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from northmk.checkpoint import synthetic_weights  # noqa: E402
from northmk.config import PAGE_SIZE, ModelConfig  # noqa: E402
from northmk.megakernel import Megakernel  # noqa: E402
from northmk.megakernel_oracle import cosine, first_divergence, layer_report, reference_step  # noqa: E402
from northmk.model.kv import BatchLayout, PagedKVCache  # noqa: E402


def geometry(layers: int, small: bool) -> ModelConfig:
    raw = {
        "model_type": "cohere2_moe", "hidden_size": 2048, "num_hidden_layers": layers,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 262144,
        "num_experts": 128, "num_experts_per_tok": 8, "intermediate_size": 768,
        "prefix_dense_intermediate_size": 3072, "first_k_dense_replace": 1, "sliding_window": 4096,
        "rope_theta": 50000.0, "rms_norm_eps": 1e-6, "expert_selection_fn": "sigmoid", "norm_topk_prob": False,
        "logit_scale": 1.0, "tie_word_embeddings": True, "max_position_embeddings": 16384,
    }
    if small:
        raw.update(hidden_size=512, num_attention_heads=4, num_key_value_heads=1, vocab_size=4096, num_experts=16,
                   num_experts_per_tok=4, intermediate_size=256, prefix_dense_intermediate_size=512,
                   sliding_window=128)
    return ModelConfig.from_dict(raw)


def noisy_cache(config: ModelConfig, contexts: list[int], seed: int):
    per_row = -(-max(contexts) // PAGE_SIZE)
    kv = PagedKVCache(config, [len(contexts) * per_row] * len(config.attention_groups), torch.bfloat16, "cuda")
    gen = torch.Generator("cuda").manual_seed(seed)
    for pages in kv.pages:
        pages.normal_(generator=gen)
    table = torch.arange(len(contexts) * per_row, dtype=torch.int32, device="cuda").view(len(contexts), per_row)
    return kv, [table.clone() for _ in kv.pages]


def copy_of(config: ModelConfig, kv: PagedKVCache) -> PagedKVCache:
    out = PagedKVCache(config, kv.num_pages, torch.bfloat16, "cuda")
    for a, b in zip(out.pages, kv.pages):
        a.copy_(b)
    return out


def new_kv_cosines(config, kv_mk, kv_ref, layout) -> list[float]:
    """Per layer, the worst cosine of the new tokens' k, v between the two caches."""
    worst = []
    for layer in range(config.num_layers):
        a, b = kv_mk.layer_view(layer), kv_ref.layer_view(layer)
        table = layout.block_tables[config.layer_group[layer]]
        worst.append(min(cosine(a[table[r, p // PAGE_SIZE], :, :, p % PAGE_SIZE], b[table[r, p // PAGE_SIZE], :, :, p % PAGE_SIZE])
                         for r, p in enumerate(layout.start_positions)))
    return worst


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=49)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1, 100, 4097])
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--steps", type=int, default=1, help="steps to run (the last is compared)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    config = geometry(args.layers, args.small)
    weights = synthetic_weights(config, torch.bfloat16, "cuda", seed=0)
    contexts = [c + args.steps - 1 for c in args.contexts]
    kv_mk, tables = noisy_cache(config, contexts, seed=1)
    mk = Megakernel(config, weights, kv_mk)
    mk.enable_debug()
    tokens = torch.arange(len(contexts), dtype=torch.int32, device="cuda") * 7919 % config.vocab_size
    positions = [c - 1 for c in args.contexts]
    for _ in range(args.steps - 1):  # earlier steps: the kernel's own tokens and kv
        _, tokens = mk.step(tokens, positions, tables)
        positions = [p + 1 for p in positions]
    kv_ref, kv_local, kv_mk_before = (copy_of(config, kv_mk) for _ in range(3))
    logits, next_tokens = mk.step(tokens, positions, tables)
    torch.cuda.synchronize()
    trace = mk.trace(len(contexts))
    layout = BatchLayout([1] * len(contexts), positions, tables)
    free = reference_step(config, weights, tokens, layout, kv_ref, trace=trace)
    local = reference_step(config, weights, tokens, layout, kv_local, trace=trace, teacher=True)
    noisy = reference_step(config, weights, tokens, layout, kv_mk_before, trace=trace,
                           fp32_sums=False)  # the reference with torch's bf16 GEMMs: its own noise floor
    floor = [cosine(noisy.logits[r], free.logits[r]) for r in range(len(contexts))]
    free_rows, local_rows = layer_report(trace, free), layer_report(trace, local)
    kv_cos = new_kv_cosines(config, kv_mk, kv_local, layout)
    print(f"{'layer':>5} {'x(free)':>9} {'attn(loc)':>9} {'mlp(loc)':>9} {'x(loc)':>9} {'newkv':>9}")
    for f, l in zip(free_rows, local_rows):
        kv = kv_cos[l["layer"]] if l["layer"] < config.num_layers else float("nan")
        print(f"{l['layer']:>5} {f['x']:9.5f} {l['attn']:9.5f} {l['mlp']:9.5f} {l['x']:9.5f} {kv:9.5f}")
    rows = [{"row": r, "context": c, "logits_cos": cosine(logits[r], free.logits[r]), "ref_vs_torch_bf16": floor[r],
             "kernel_vs_torch_bf16": cosine(logits[r], noisy.logits[r]),
             "argmax": [int(next_tokens[r]), int(free.logits[r].argmax())]} for r, c in enumerate(contexts)]
    summary = {"config": {"layers": args.layers, "small": args.small, "contexts": contexts, "steps": args.steps},
               "rows": rows, "routing_errors": free.routing_errors[:10] + local.routing_errors[:10],
               "first_divergence_free": first_divergence(free_rows),
               "first_divergence_local": first_divergence(local_rows),
               "free": free_rows, "local": local_rows, "new_kv": kv_cos}
    for r in rows:
        print(f"row {r['row']} context {r['context']}: logits cosine {r['logits_cos']:.5f} argmax {r['argmax']} "
              f"| vs torch-bf16 reference {r['kernel_vs_torch_bf16']:.5f} | fp32-sum vs torch-bf16 reference "
              f"{r['ref_vs_torch_bf16']:.5f}")
    print("routing errors:", summary["routing_errors"][:3])
    print("first divergence free:", summary["first_divergence_free"], "| local:", summary["first_divergence_local"])
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        name = f"diag-{'small' if args.small else 'north'}-{args.layers}l-{args.steps}s.json"
        (args.out / name).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
