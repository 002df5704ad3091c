"""The built-in default model: a small North-Mini-Code-architecture checkpoint with random
weights, made deterministically on first use and cached (NORTHMK_CACHE or ~/.cache/northmk)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

DEFAULT_SEED = 0
NOTICE = "northmk: serving the built-in default model (random weights): its output is meaningless"


def cache_dir() -> Path:
    root = os.environ.get("NORTHMK_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "northmk")
    return Path(root)


def _recipe() -> dict:
    from .checkpoint_writer import config_dict

    return {"config": config_dict("default"), "seed": DEFAULT_SEED, "format": 1}


def default_model_path() -> Path:
    """Directory of the default checkpoint, written there atomically if not yet present."""
    recipe = _recipe()
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    target = cache_dir() / f"default-{digest}"
    if (target / "config.json").is_file():
        return target
    from .checkpoint_writer import write_checkpoint

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".default-", dir=target.parent))
    try:
        write_checkpoint(staging, recipe["config"], seed=recipe["seed"], dtype="float32")
        try:
            staging.rename(target)
        except OSError:  # another process won the race; its copy is identical
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def resolve_model(path: str | None) -> Path:
    """The --model argument, or the default model (announced on stderr in one line)."""
    if path:
        return Path(path)
    print(NOTICE, file=sys.stderr)
    return default_model_path()
