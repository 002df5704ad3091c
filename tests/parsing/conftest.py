import pytest

from northmk.checkpoint_writer import config_dict
from northmk.tokenizer import Tokenizer
from northmk.tokenizer_files import write_tokenizer_files


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer_files(directory, config_dict("tiny")["vocab_size"])
    return Tokenizer.from_pretrained(directory)
