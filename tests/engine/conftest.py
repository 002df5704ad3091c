"""Shared fixtures: one tiny checkpoint (real on-disk format) per test session, and
engines on it that are shut down after each test."""

import pytest

from northmk.checkpoint_writer import config_dict, write_checkpoint
from northmk.engine import AsyncEngine, EngineConfig
from northmk.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), config_dict("tiny"), seed=0, dtype="float32")


@pytest.fixture(scope="session")
def tokenizer(tiny_checkpoint):
    return Tokenizer.from_pretrained(tiny_checkpoint)


@pytest.fixture
async def make_engine(tiny_checkpoint):
    engines = []

    async def make(device_sampler=None, **overrides):
        """A started engine on the tiny checkpoint; device_sampler: draws steps on it (as the
        megakernel backend's GPU sampler does) instead of on the host."""
        engine = AsyncEngine.from_config(EngineConfig(model=tiny_checkpoint, **overrides))
        if device_sampler is not None:
            engine.device_sampler = device_sampler
        await engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        await engine.shutdown()
