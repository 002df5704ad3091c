"""Tokenizer files we write for our checkpoints, and the runtime tokenizer that reads them."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from northmk.tokenizer import Tokenizer, TokenizerError
from northmk.tokenizer_files import CHAT_TOKENS, LOW_SPECIAL_TOKENS, MIN_VOCAB_SIZE, write_tokenizer_files

FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
# Any unicode text except lone surrogates (not encodable as UTF-8 at all).
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=200)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok4096")
    write_tokenizer_files(directory, 4096)
    return directory


@pytest.fixture(scope="module")
def tok(tok_dir):
    return Tokenizer.from_pretrained(tok_dir)


# ---- the file writer -------------------------------------------------------------------
@pytest.mark.parametrize("vocab_size", [512, 4096, 262144])
def test_special_ids_sit_at_the_model_positions(tmp_path, vocab_size):
    info = write_tokenizer_files(tmp_path, vocab_size)
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.vocab_size == vocab_size
    assert info["pad_token_id"] == tok.token_to_id("<PAD>") == 0
    assert tok.token_to_id("<UNK>") == 1
    assert info["bos_token_id"] == tok.bos_token_id == tok.token_to_id("<BOS_TOKEN>") == 2
    end_of_turn = 255001 if vocab_size == 262144 else vocab_size - len(CHAT_TOKENS) + 1
    assert info["eos_token_id"] == tok.eos_token_id == tok.token_to_id("<|END_OF_TURN_TOKEN|>") == end_of_turn
    for name in (*LOW_SPECIAL_TOKENS, *CHAT_TOKENS):
        token_id = info["special_tokens"][name]
        assert tok.token_to_id(name) == token_id and token_id < vocab_size
        assert tok.encode(f"a{name}b")[1:-1] == [token_id], "a special token in text encodes as itself"
    assert sorted(info["special_tokens"].values()) == tok.all_special_ids


def test_writer_is_deterministic(tmp_path):
    write_tokenizer_files(tmp_path / "a", 4096)
    write_tokenizer_files(tmp_path / "b", 4096)
    for name in FILES:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_config_names_the_tokens_and_keeps_the_template_in_its_own_file(tok_dir):
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert config["bos_token"] == "<BOS_TOKEN>" and config["eos_token"] == "<|END_OF_TURN_TOKEN|>"
    assert config["pad_token"] == "<PAD>"
    assert "chat_template" not in config
    assert (tok_dir / "chat_template.jinja").read_text().strip()


@pytest.mark.parametrize("vocab_size", [MIN_VOCAB_SIZE - 1, 0, -5, 300.0, True])
def test_too_small_or_non_integer_vocab_is_refused(tmp_path, vocab_size):
    with pytest.raises(ValueError, match="vocab_size"):
        write_tokenizer_files(tmp_path, vocab_size)


def test_smallest_vocab_still_holds_every_token(tmp_path):
    info = write_tokenizer_files(tmp_path, MIN_VOCAB_SIZE)
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.vocab_size == MIN_VOCAB_SIZE == len(info["special_tokens"]) + 256
    assert tok.decode(tok.encode("héllo wörld")) == "héllo wörld"


# ---- encode / decode -------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(text=TEXT)
def test_any_text_round_trips(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids, skip_special_tokens=False) == text


@settings(max_examples=50, deadline=None)
@given(text=TEXT)
def test_ids_match_transformers(tok, hf_tok, text):
    assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False)
    assert tok.encode(text, add_special_tokens=True) == hf_tok.encode(text)


def test_bos_is_added_only_when_asked(tok):
    assert tok.encode("hi", add_special_tokens=True) == [tok.bos_token_id, *tok.encode("hi")]
    assert tok.bos_token_id not in tok.encode("hi")


def test_merges_make_common_code_shorter_than_bytes(tok):
    text = "def sum_of_squares(numbers):\n    return total\n"
    assert len(tok.encode(text)) < len(text.encode()) / 2


def test_decode_skips_special_tokens_by_default(tok):
    ids = tok.encode("<|START_TEXT|>Hello<|END_TEXT|>")
    assert tok.decode(ids) == "Hello"
    assert tok.decode(ids, skip_special_tokens=False) == "<|START_TEXT|>Hello<|END_TEXT|>"


@pytest.mark.parametrize("bad", [[-1], [1.5], [None], [True]])
def test_decode_rejects_ids_that_are_not_token_ids(tok, bad):
    with pytest.raises(TokenizerError, match="not a non-negative integer"):
        tok.decode(bad)


def test_ids_past_the_tokenizer_vocabulary_have_no_text(tok):
    """A model may pad its vocabulary past the tokenizer's (the real North does); those rows decode to nothing."""
    ids = tok.encode("ab")
    assert tok.decode([ids[0], 4096, 10**6, *ids[1:]]) == "ab"


def test_id_token_lookups(tok):
    assert tok.id_to_token(2) == "<BOS_TOKEN>"
    assert tok.token_to_id("<|CHATBOT_TOKEN|>") == 4096 - len(CHAT_TOKENS) + 3
    assert tok.token_to_id("no such token") is None


# ---- loading errors --------------------------------------------------------------------
def test_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(TokenizerError, match="does not exist"):
        Tokenizer.from_pretrained(tmp_path / "nowhere")


def test_missing_tokenizer_json_is_a_clear_error(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)


@pytest.mark.parametrize("content", ["", "not json", '{"model": {"type": "BPE"', '{"version": "1.0"}', "[1, 2]"])
def test_corrupt_tokenizer_json_is_a_clear_error(tmp_path, content):
    (tmp_path / "tokenizer.json").write_text(content)
    with pytest.raises(TokenizerError, match="not a valid tokenizer file"):
        Tokenizer.from_pretrained(tmp_path)


def test_corrupt_tokenizer_config_is_a_clear_error(tmp_path, tok_dir):
    (tmp_path / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text("{ broken")
    with pytest.raises(TokenizerError, match="tokenizer_config.json: not valid JSON"):
        Tokenizer.from_pretrained(tmp_path)


def test_eos_missing_from_the_vocabulary_is_a_clear_error(tmp_path, tok_dir):
    (tmp_path / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}))
    with pytest.raises(TokenizerError, match="eos_token '<nope>' is not in"):
        Tokenizer.from_pretrained(tmp_path)


def test_special_tokens_may_be_added_token_objects(tmp_path, tok_dir):
    (tmp_path / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    config = {"bos_token": {"content": "<BOS_TOKEN>", "special": True}, "eos_token": "<EOS_TOKEN>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_pretrained(tmp_path)
    assert (tok.bos_token_id, tok.eos_token_id) == (2, 3)


@pytest.fixture(scope="module")
def hf_tok(tok_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(tok_dir))


def test_transformers_reads_the_same_special_tokens(hf_tok, tok):
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.pad_token_id) == (
        tok.bos_token_id,
        tok.eos_token_id,
        tok.pad_token_id,
    )
    assert len(hf_tok) == tok.vocab_size
