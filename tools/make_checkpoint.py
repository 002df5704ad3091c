"""Write a North-Mini-Code-architecture checkpoint with random weights in the real on-disk format.

    python tools/make_checkpoint.py out/tiny --preset tiny
    python tools/make_checkpoint.py out/odd --preset tiny --hidden-size 96 --num-experts 12 --shards 3
    python tools/make_checkpoint.py out/north --preset north --dtype bfloat16 --shards 8
"""

from __future__ import annotations

import argparse
import sys

from northmk.checkpoint_writer import PRESETS, config_dict, write_checkpoint
from northmk.config import ConfigError

GEOMETRY = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "num_experts", "num_experts_per_tok", "intermediate_size",
            "prefix_dense_intermediate_size", "sliding_window", "max_position_embeddings", "first_k_dense_replace",
            "num_shared_experts")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("directory")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    for name in GEOMETRY:
        p.add_argument("--" + name.replace("_", "-"), type=int, dest=name)
    p.add_argument("--logit-scale", type=float)
    p.add_argument("--rope-theta", type=float)
    p.add_argument("--expert-selection-fn", choices=["sigmoid", "softmax"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--fused-experts", action="store_true", help="store experts as fused gate_up_proj/down_proj")
    args = p.parse_args(argv)
    overrides = {name: getattr(args, name) for name in GEOMETRY}
    overrides.update(logit_scale=args.logit_scale, rope_theta=args.rope_theta,
                     expert_selection_fn=args.expert_selection_fn)
    try:
        raw = config_dict(args.preset, **overrides)
        path = write_checkpoint(args.directory, raw, dtype=args.dtype, seed=args.seed, shards=args.shards,
                                fused_experts=args.fused_experts)
    except (ConfigError, ValueError, OSError) as exc:
        print(f"make_checkpoint: error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
