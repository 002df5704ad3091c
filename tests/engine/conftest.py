"""Shared fixtures: one tiny checkpoint (real on-disk format) per test session."""

import pytest

from northmk.checkpoint_writer import config_dict, write_checkpoint
from northmk.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), config_dict("tiny"), seed=0, dtype="float32")


@pytest.fixture(scope="session")
def tokenizer(tiny_checkpoint):
    return Tokenizer.from_pretrained(tiny_checkpoint)
