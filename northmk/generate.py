"""Offline generation with the reference model: `python -m northmk.generate`.

    python -m northmk.generate "def fib(n):" --max-tokens 32
    python -m northmk.generate --prompt-token-ids 2,17,99 --json --logprobs
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field

import torch

from .checkpoint import CheckpointError, load_checkpoint, parse_dtype
from .config import PAGE_SIZE, ConfigError
from .model.kv import BatchLayout, PagedKVCache
from .model.reference import ReferenceModel


@dataclass
class Generation:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finished: bool = False


def sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """Token ids [rows] from float32 logits [rows, V]: argmax at temperature 0, else a draw."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


def generate(model: ReferenceModel, prompts: list[list[int]], max_tokens: int, temperature: float = 0.0,
             seed: int | None = None, stop_ids: tuple[int, ...] = ()) -> list[Generation]:
    """Prefill every prompt as one ragged batch, then decode the unfinished rows together."""
    config = model.config
    if any(not p for p in prompts):
        raise ValueError("every prompt needs at least one token")
    pages_per_row = -(-(max(map(len, prompts)) + max_tokens) // PAGE_SIZE)
    rows = len(prompts)
    kv = PagedKVCache(config, [rows * pages_per_row] * len(config.attention_groups), model.dtype, model.device)
    table = torch.arange(rows * pages_per_row, dtype=torch.int32).view(rows, pages_per_row)
    tables = [table] * len(config.attention_groups)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    gens = [Generation(prompt_ids=list(p)) for p in prompts]

    active = list(range(rows))
    ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long)
    layout = BatchLayout([len(p) for p in prompts], [0] * rows, tables)
    for _ in range(max_tokens):
        logits = model.step(ids, layout, kv)
        logprobs = torch.log_softmax(logits, dim=-1)
        next_ids = sample(logits, temperature, generator)
        for i, (r, tok) in enumerate(zip(active, next_ids.tolist())):
            g = gens[r]
            g.token_ids.append(tok)
            g.logprobs.append(logprobs[i, tok].item())
            g.finished = tok in stop_ids or len(g.token_ids) >= max_tokens
        active = [r for r in active if not gens[r].finished]
        if not active:
            break
        ids = torch.tensor([gens[r].token_ids[-1] for r in active], dtype=torch.long)
        positions = [len(gens[r].prompt_ids) + len(gens[r].token_ids) - 1 for r in active]
        layout = BatchLayout([1] * len(active), positions, [t[active] for t in tables])
    return gens


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m northmk.generate", description=__doc__.splitlines()[0])
    p.add_argument("prompts", nargs="*", help="text prompts (each one a separate generation)")
    p.add_argument("--prompt-token-ids", action="append", default=[],
                   help="a prompt as comma-separated token ids (repeatable)")
    p.add_argument("--model", help="checkpoint directory (default: the built-in random model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--logprobs", action="store_true", help="print chosen-token logprobs (always in --json)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--no-bos", action="store_true", help="do not prepend BOS to text prompts")
    p.add_argument("--json", action="store_true", help="one JSON line per prompt")
    args = p.parse_args(argv)
    if not args.prompts and not args.prompt_token_ids:
        p.error("give at least one prompt (text or --prompt-token-ids)")
    if args.max_tokens < 1:
        p.error("--max-tokens must be >= 1")
    if args.temperature < 0:
        p.error("--temperature must be >= 0")
    return args


def _token_ids(spec: str, vocab_size: int) -> list[int]:
    try:
        ids = [int(x) for x in spec.replace(" ", "").split(",") if x]
    except ValueError:
        raise ValueError(f"--prompt-token-ids {spec!r}: expected comma-separated integers") from None
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if not ids or bad:
        raise ValueError(f"--prompt-token-ids {spec!r}: ids must be in [0, {vocab_size}), got {bad or 'none'}")
    return ids


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    from .default_model import resolve_model
    from .tokenizer import Tokenizer

    try:
        path = resolve_model(args.model)
        config, weights = load_checkpoint(path, dtype=parse_dtype(args.dtype), device=args.device)
        tokenizer = Tokenizer.from_pretrained(path)
        prompts = [_token_ids(s, config.vocab_size) for s in args.prompt_token_ids]
        bos = [] if args.no_bos or tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
        prompts += [bos + tokenizer.encode(text) for text in args.prompts]
        model = ReferenceModel(config, weights)
        stop = () if args.ignore_eos else config.eos_token_ids
        gens = generate(model, prompts, args.max_tokens, args.temperature, args.seed, stop)
    except (ConfigError, CheckpointError, ValueError, OSError, RuntimeError) as exc:
        print(f"northmk.generate: error: {exc}", file=sys.stderr)
        return 1
    for g in gens:
        text = tokenizer.decode(g.token_ids)
        if args.json:
            print(json.dumps({"token_ids": g.token_ids, "logprobs": g.logprobs, "text": text}))
        else:
            print(text)
            if args.logprobs:
                print(" ".join(f"{t}:{lp:.4f}" for t, lp in zip(g.token_ids, g.logprobs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
