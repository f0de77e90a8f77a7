"""The demo's arithmetic verifier and the character tokenizer every tiny model here uses."""

import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # so a bare `pytest` finds the repository's packages too

from examples.make_demo import build_char_tokenizer, build_tiny_qwen2  # noqa: E402
from rewards.arithmetic import compute_score  # noqa: E402

# ----------------------------------------------------------------------------------------------
# Verifier


def test_correct_sums_differences_and_products_score_one():
    prompts = ["47+38=", "10+10=", "99+99=", "50-8=", "12*11="]
    responses = ["85", "20", "198", "42", "132"]
    assert compute_score(prompts, responses) == [1.0, 1.0, 1.0, 1.0, 1.0]


def test_wrong_answers_score_zero():
    prompts = ["47+38="] * 4 + ["12*11="]
    responses = ["84", "86", "75", "3847", "23"]
    assert compute_score(prompts, responses) == [0.0] * 5


@pytest.mark.parametrize(
    "response",
    ["", "   ", "85abc", "8 5", "085", "+85", "85.0", "eighty-five", "85</s>", "\n", "--85"],
)
def test_malformed_responses_score_zero(response):
    assert compute_score(["47+38="], [response]) == [0.0]


@pytest.mark.parametrize("response", [" 85", "85 ", "\t85\t", "85\n", "85\n12", " 85 \nanything"])
def test_whitespace_is_stripped_and_only_the_first_line_counts(response):
    assert compute_score(["47+38="], [response]) == [1.0]


def test_a_wrong_first_line_is_not_rescued_by_a_right_second_line():
    assert compute_score(["47+38="], ["84\n85"]) == [0.0]


def test_negative_results_and_operands():
    prompts = ["12-47=", "12-47=", "-3*4=", "5--2=", "0-0="]
    responses = ["-35", "35", "-12", "7", "0"]
    assert compute_score(prompts, responses) == [1.0, 0.0, 1.0, 1.0, 1.0]


def test_spaces_inside_the_prompt_are_allowed():
    assert compute_score(["47 + 38 =", " 6 * 7= "], ["85", "42"]) == [1.0, 1.0]


def test_scores_come_back_in_order_as_floats():
    scores = compute_score(["1+1=", "2+2=", "3+3="], ["2", "5", "6"])
    assert scores == [1.0, 0.0, 1.0]
    assert all(type(s) is float for s in scores)


@pytest.mark.parametrize("prompt", ["hello", "47+38", "47/38=", "4.5+1=", "+38=", "47+38=85", ""])
def test_unparseable_prompt_raises_naming_it(prompt):
    with pytest.raises(ValueError) as err:
        compute_score(["1+1=", prompt], ["2", "0"])
    assert repr(prompt) in str(err.value)


def test_length_mismatch_raises():
    with pytest.raises(ValueError):
        compute_score(["1+1=", "2+2="], ["2"])
    with pytest.raises(ValueError):
        compute_score(["1+1="], ["2", "4"])


def test_marked_as_verifier():
    assert compute_score.is_verifier is True


# ----------------------------------------------------------------------------------------------
# Tokenizer (ids fixed by W1, docs/benchmarks.md)

# Written out from the spec, not imported: the test must catch a drift in make_demo's table.
SPEC_CHARS = "0123456789+-*=? abcdefghijklmnopqrstuvwxyz." + "\n"


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def test_special_token_ids(tok):
    names = (tok.pad_token, tok.bos_token, tok.eos_token, tok.unk_token)
    assert names == ("<pad>", "<s>", "</s>", "<unk>")
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)


def test_every_character_has_its_spec_id(tok):
    assert len(tok) == 48  # 4 specials + 44 characters; the model's 64 rows leave room
    for i, ch in enumerate(SPEC_CHARS):
        assert tok.convert_tokens_to_ids(ch) == 4 + i, repr(ch)


def test_prompt_encodes_one_id_per_character_without_specials(tok):
    # '0' is 4, so '4'->8, '7'->11; '+' is 14, '3'->7, '8'->12, '=' is 17.
    assert tok("47+38=")["input_ids"] == [8, 11, 14, 7, 12, 17]
    # space is 19, 'a' 20, 'b' 21, newline 47, '.' 46; an unknown character is <unk> (3).
    assert tok("a b\n.A")["input_ids"] == [20, 19, 21, 47, 46, 3]


@pytest.mark.parametrize("text", ["47+38=", "47+38=85", "what is 6*7?\nit is 42."])
def test_round_trip(tok, text):
    assert tok.decode(tok(text)["input_ids"]) == text


def test_decoding_a_response_drops_eos_and_padding(tok):
    assert tok.decode([12, 9, 2, 0, 0], skip_special_tokens=True) == "85"
    assert tok("85</s>")["input_ids"] == [12, 9, 2]  # EOS written as text is the EOS token


def test_saved_tokenizer_loads_back_identically(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.get_vocab() == tok.get_vocab()
    assert loaded.all_special_ids == tok.all_special_ids
    assert loaded.padding_side == "left"
    for text in ["47+38=", "a b\n.A", "85</s>"]:
        assert loaded(text)["input_ids"] == tok(text)["input_ids"]
        assert loaded.decode(loaded(text)["input_ids"]) == tok.decode(tok(text)["input_ids"])


# ----------------------------------------------------------------------------------------------
# The tiny model builder and the committed demo assets


def test_default_tiny_qwen2_is_the_w1_policy_shape(tok):
    model = build_tiny_qwen2()
    c = model.config
    assert (c.vocab_size, c.hidden_size, c.intermediate_size) == (64, 256, 512)
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (4, 4, 2)
    assert c.max_position_embeddings == 256
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    assert next(model.parameters()).dtype == torch.float32
    ids = torch.tensor([tok("47+38=")["input_ids"]])
    assert model(input_ids=ids).logits.shape == (1, 6, 64)
    # seeded init: the same call builds the same weights
    again = build_tiny_qwen2()
    assert torch.equal(again.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_demo_data_is_disjoint_and_its_answers_verify():
    train = pd.read_parquet(ROOT / "examples" / "data" / "train.parquet")
    val = pd.read_parquet(ROOT / "examples" / "data" / "val.parquet")
    assert len(val) == 200 and len(train) >= 2000
    assert not set(train["prompt"]) & set(val["prompt"])
    for frame in (train, val):
        assert frame["prompt"].is_unique
        assert compute_score(list(frame["prompt"]), list(frame["answer"])) == [1.0] * len(frame)
