"""Checkpoint loading (safetensors, any layout) and synthetic weights.

On disk (the real key names, single file or sharded with model.safetensors.index.json):
    model.embed_tokens.weight, model.norm.weight, [lm_head.weight when untied]
    model.layers.{i}.input_layernorm.weight
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight
    dense:  model.layers.{i}.mlp.{gate,up,down}_proj.weight
    sparse: model.layers.{i}.mlp.gate.weight [E, H]
            model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight      (per expert), or
            model.layers.{i}.mlp.experts.gate_up_proj [E, 2I, H] + .down_proj [E, H, I]  (fused)
            model.layers.{i}.mlp.shared_experts.{gate,up,down}_proj.weight   (when shared experts exist)
Tensors are read lazily from the memory-mapped files one at a time and converted straight
into the in-memory layout of northmk.model.weights, so no tensor is held twice.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import safe_open

from .config import DENSE, ModelConfig
from .model.weights import LayerWeights, ModelWeights, from_tiled

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


class CheckpointError(ValueError):
    """A checkpoint that does not match its config; the message names every bad tensor."""


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


# ---- the expected tensors ---------------------------------------------------------

def expected_shapes(config: ModelConfig, fused_experts: bool = False) -> dict[str, tuple[int, ...]]:
    """Every on-disk key of a checkpoint for `config`, with its shape."""
    c, h = config, config.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    for i, mlp_type in enumerate(c.mlp_types):
        p = f"model.layers.{i}"
        shapes[f"{p}.input_layernorm.weight"] = (h,)
        shapes[f"{p}.self_attn.q_proj.weight"] = (c.q_size, h)
        shapes[f"{p}.self_attn.k_proj.weight"] = (c.kv_size, h)
        shapes[f"{p}.self_attn.v_proj.weight"] = (c.kv_size, h)
        shapes[f"{p}.self_attn.o_proj.weight"] = (h, c.q_size)
        if mlp_type == DENSE:
            shapes.update(_mlp_shapes(f"{p}.mlp", h, c.dense_intermediate_size))
            continue
        inter = c.moe_intermediate_size
        shapes[f"{p}.mlp.gate.weight"] = (c.num_experts, h)
        if fused_experts:
            shapes[f"{p}.mlp.experts.gate_up_proj"] = (c.num_experts, 2 * inter, h)
            shapes[f"{p}.mlp.experts.down_proj"] = (c.num_experts, h, inter)
        else:
            for e in range(c.num_experts):
                shapes.update(_mlp_shapes(f"{p}.mlp.experts.{e}", h, inter))
        if c.num_shared_experts:
            shapes.update(_mlp_shapes(f"{p}.mlp.shared_experts", h, inter * c.num_shared_experts))
    return shapes


def _mlp_shapes(prefix: str, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {
        f"{prefix}.gate_proj.weight": (inter, hidden),
        f"{prefix}.up_proj.weight": (inter, hidden),
        f"{prefix}.down_proj.weight": (hidden, inter),
    }


# ---- reading safetensors ----------------------------------------------------------

class _TensorFiles:
    """Lazy access to the tensors of one checkpoint directory (possibly sharded)."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.key_to_file = self._index(directory)
        self._handles: dict[Path, object] = {}

    @staticmethod
    def _index(directory: Path) -> dict[str, Path]:
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from None
            missing = sorted({f for f in weight_map.values() if not (directory / f).is_file()})
            if missing:
                raise CheckpointError(f"{index} names shard files that do not exist: {missing}")
            return {k: directory / f for k, f in weight_map.items()}
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors files in {directory}")
        mapping: dict[str, Path] = {}
        for f in files:
            try:
                with safe_open(f, framework="pt", device="cpu") as handle:
                    for k in handle.keys():
                        mapping[k] = f
            except Exception as exc:  # safetensors raises its own error types
                raise CheckpointError(f"{f}: unreadable safetensors file ({exc})") from None
        return mapping

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._handle(key).get_slice(key).get_shape())

    def get(self, key: str) -> torch.Tensor:
        return self._handle(key).get_tensor(key)

    def _handle(self, key: str):
        path = self.key_to_file[key]
        if path not in self._handles:
            try:
                self._handles[path] = safe_open(path, framework="pt", device="cpu")
            except Exception as exc:
                raise CheckpointError(f"{path}: unreadable safetensors file ({exc})") from None
        return self._handles[path]

    def nbytes(self) -> int:
        return sum(p.stat().st_size for p in set(self.key_to_file.values()))


def _validate(files: _TensorFiles, config: ModelConfig) -> tuple[dict[str, tuple[int, ...]], bool]:
    """Check every tensor against the config; returns the expected shapes and whether experts are fused."""
    present = set(files.key_to_file)
    fused = any(k.endswith("mlp.experts.gate_up_proj") for k in present)
    expected = expected_shapes(config, fused_experts=fused)
    problems = []
    missing = sorted(set(expected) - present)
    unexpected = sorted(present - set(expected) - {"lm_head.weight"})
    if missing:
        problems.append(f"missing tensors: {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_listing(unexpected)}")
    for key in sorted(set(expected) & present):
        shape = files.shape(key)
        if shape != expected[key]:
            problems.append(f"tensor {key} has shape {list(shape)}, expected {list(expected[key])}")
    if problems:
        raise CheckpointError(f"checkpoint {files.directory} does not match its config.json: " + "; ".join(problems))
    return expected, fused


def _listing(keys: list[str], limit: int = 12) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" (and {len(keys) - limit} more)" if len(keys) > limit else "")


# ---- assembling ModelWeights --------------------------------------------------------

def load_checkpoint(
    path: str | Path,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    progress: bool | None = None,
) -> tuple[ModelConfig, ModelWeights]:
    """Read config.json and the safetensors weights of a checkpoint directory."""
    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    config = ModelConfig.from_file(directory)
    dtype = parse_dtype(dtype)
    files = _TensorFiles(directory)
    expected, fused = _validate(files, config)
    if progress is None:
        progress = files.nbytes() > (1 << 30) and sys.stderr.isatty()
    bar = _progress_bar(len(expected), progress)

    def take(key: str) -> torch.Tensor:
        bar(1)
        return files.get(key).to(device=device, dtype=dtype)

    weights = _assemble(config, take, fused)
    bar(0, close=True)
    return config, weights


def _progress_bar(total: int, enabled: bool) -> Callable[..., None]:
    if not enabled:
        return lambda n, close=False: None
    from tqdm import tqdm

    bar = tqdm(total=total, desc="loading weights", unit="tensor")

    def update(n: int, close: bool = False) -> None:
        bar.update(n)
        if close:
            bar.close()

    return update


def _assemble(config: ModelConfig, take: Callable[[str], torch.Tensor], fused: bool) -> ModelWeights:
    layers = []
    for i, mlp_type in enumerate(config.mlp_types):
        p = f"model.layers.{i}"
        attn = [take(f"{p}.self_attn.{n}_proj.weight") for n in ("q", "k", "v")]
        layer = LayerWeights(
            norm=take(f"{p}.input_layernorm.weight"),
            qkv=torch.cat(attn, dim=0),
            o=take(f"{p}.self_attn.o_proj.weight"),
        )
        del attn
        if mlp_type == DENSE:
            layer.gate_up, layer.down = _mlp(take, f"{p}.mlp")
        else:
            layer.router = take(f"{p}.mlp.gate.weight")
            if fused:
                layer.experts_gate_up = take(f"{p}.mlp.experts.gate_up_proj")
                layer.experts_down = take(f"{p}.mlp.experts.down_proj")
            else:
                layer.experts_gate_up, layer.experts_down = _stack_experts(take, p, config.num_experts)
            if config.num_shared_experts:
                layer.shared_gate_up, layer.shared_down = _mlp(take, f"{p}.mlp.shared_experts")
        layers.append(layer)
    embed = take("model.embed_tokens.weight")
    lm_head = None if config.tie_word_embeddings else take("lm_head.weight")
    return ModelWeights(embed=embed, final_norm=take("model.norm.weight"), layers=layers, lm_head=lm_head)


def _mlp(take: Callable[[str], torch.Tensor], prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
    gate_up = torch.cat([take(f"{prefix}.gate_proj.weight"), take(f"{prefix}.up_proj.weight")], dim=0)
    return gate_up, take(f"{prefix}.down_proj.weight")


def _stack_experts(take: Callable[[str], torch.Tensor], prefix: str, num_experts: int):
    first_gate = take(f"{prefix}.mlp.experts.0.gate_proj.weight")
    inter, hidden = first_gate.shape
    gate_up = first_gate.new_empty((num_experts, 2 * inter, hidden))
    down = first_gate.new_empty((num_experts, hidden, inter))
    for e in range(num_experts):
        q = f"{prefix}.mlp.experts.{e}"
        gate_up[e, :inter] = first_gate if e == 0 else take(f"{q}.gate_proj.weight")
        gate_up[e, inter:] = take(f"{q}.up_proj.weight")
        down[e] = take(f"{q}.down_proj.weight")
    return gate_up, down


# ---- synthetic weights ----------------------------------------------------------------

def synthetic_weights(
    config: ModelConfig,
    dtype: torch.dtype | str = torch.bfloat16,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> ModelWeights:
    """Random weights for any geometry, made directly on `device` (full North in seconds on a GPU).

    Every projection ~ N(0, 1/fan_in), so each layer adds O(1) to the residual stream and the
    router's logits spread over experts; norm weights ~ 1 + N(0, 0.02); embeddings ~
    N(0, 4/H), so the tied head gives logits of standard deviation ~2 while the embedding is
    small beside the layers' contributions: the next token depends on the context instead of
    echoing the last one, and greedy comparisons are meaningful.
    """
    dtype = parse_dtype(dtype)
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int, scale: float | None = None) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=device)
        return t.normal_(0.0, scale if scale is not None else shape[-1] ** -0.5, generator=gen)

    def norm(h: int) -> torch.Tensor:
        return randn(h, scale=0.02).add_(1.0)

    c, h = config, config.hidden_size
    layers = []
    for mlp_type in c.mlp_types:
        layer = LayerWeights(norm=norm(h), qkv=randn(c.q_size + 2 * c.kv_size, h), o=randn(h, c.q_size))
        if mlp_type == DENSE:
            layer.gate_up = randn(2 * c.dense_intermediate_size, h)
            layer.down = randn(h, c.dense_intermediate_size)
        else:
            inter = c.moe_intermediate_size
            layer.router = randn(c.num_experts, h)
            layer.experts_gate_up = randn(c.num_experts, 2 * inter, h)
            layer.experts_down = randn(c.num_experts, h, inter)
            if c.num_shared_experts:
                layer.shared_gate_up = randn(2 * inter * c.num_shared_experts, h)
                layer.shared_down = randn(h, inter * c.num_shared_experts)
        layers.append(layer)
    lm_head = None if c.tie_word_embeddings else randn(c.vocab_size, h, scale=2.0 / math.sqrt(h))
    return ModelWeights(embed=randn(c.vocab_size, h, scale=2.0 / math.sqrt(h)), final_norm=norm(h), layers=layers,
                        lm_head=lm_head)


def checkpoint_tensors(config: ModelConfig, weights: ModelWeights, fused_experts: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The on-disk (key, tensor) pairs for `weights`: the inverse of load_checkpoint."""
    c = config
    yield "model.embed_tokens.weight", weights.embed
    yield "model.norm.weight", weights.final_norm
    if weights.lm_head is not None:
        yield "lm_head.weight", weights.lm_head
    for i, layer in enumerate(weights.layers):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", layer.norm
        q, k, v = layer.qkv.split([c.q_size, c.kv_size, c.kv_size], dim=0)
        yield from ((f"{p}.self_attn.{n}_proj.weight", t) for n, t in (("q", q), ("k", k), ("v", v)))
        yield f"{p}.self_attn.o_proj.weight", layer.o
        if layer.is_dense:
            yield from _mlp_items(f"{p}.mlp", layer.gate_up, layer.down)
            continue
        yield f"{p}.mlp.gate.weight", layer.router
        if fused_experts:
            gate_up, down = layer.experts_gate_up, layer.experts_down
            if layer.experts_tiled:
                gate_up, down = from_tiled(gate_up), from_tiled(down)
            yield f"{p}.mlp.experts.gate_up_proj", gate_up
            yield f"{p}.mlp.experts.down_proj", down
        else:
            for e in range(c.num_experts):
                yield from _mlp_items(f"{p}.mlp.experts.{e}", *layer.expert(e))
        if layer.shared_gate_up is not None:
            yield from _mlp_items(f"{p}.mlp.shared_experts", layer.shared_gate_up, layer.shared_down)


def _mlp_items(prefix: str, gate_up: torch.Tensor, down: torch.Tensor):
    gate, up = gate_up.chunk(2, dim=0)
    yield f"{prefix}.gate_proj.weight", gate
    yield f"{prefix}.up_proj.weight", up
    yield f"{prefix}.down_proj.weight", down
