"""A real engine on a tiny checkpoint (real on-disk format) behind the real app."""

import pytest

from northmk.checkpoint_writer import config_dict, write_checkpoint

from .helpers import ALIAS, DEVICE, MAX_MODEL_LEN, MODEL


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), config_dict("tiny"), seed=0, dtype="float32")


@pytest.fixture
def make_client(aiohttp_client, tiny_checkpoint):
    """make_client(engine={...}, server={...}, **create_app options) -> a client on a fresh engine + app."""
    from northmk.engine import AsyncEngine
    from northmk.engine.config import EngineConfig
    from northmk.server import ServerConfig, create_app

    async def make(engine: dict | None = None, server: dict | None = None, **app_options):
        engine_config = EngineConfig(**{"model": tiny_checkpoint, "device": DEVICE, "max_batch": 4, "max_model_len": MAX_MODEL_LEN,
                                        **(engine or {})})
        server_config = ServerConfig(served_model_names=(MODEL, ALIAS), model_root=str(tiny_checkpoint),
                                     drain_timeout_s=1.0, **(server or {}))
        model_engine = AsyncEngine.from_config(engine_config)
        return await aiohttp_client(create_app(server_config, model_engine, **app_options))

    return make


@pytest.fixture
async def client(make_client):
    return await make_client()
