"""The tokenizer of a checkpoint at a published size: Qwen's 151,643 ids below the special tokens, the trained
vocabulary and reserved ids beyond it, each reserved id text that encodes back to it, as in a published tokenizer,
so a random policy's answers keep their length when the next step's prompt repeats them."""

from __future__ import annotations

import random
from typing import Any

import pytest

from dart.policy.families import FIRST_SPECIAL_ID
from dart.policy.tiny import DEFAULT_INSTRUCTIONS, SPECIAL_TOKENS, build_tokenizer, tokenizer_corpus
from dart.policy.tiny_spec import TinyModelSpec

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    corpus = tokenizer_corpus(DEFAULT_INSTRUCTIONS)
    return build_tokenizer(corpus, TinyModelSpec().bpe_vocab_size, first_special_id=FIRST_SPECIAL_ID)


@pytest.fixture(scope="module")
def trained() -> Any:
    """The same tokenizer without the reserved ids (the tiny checkpoint's)."""
    return build_tokenizer(tokenizer_corpus(DEFAULT_INSTRUCTIONS), TinyModelSpec().bpe_vocab_size)


def test_the_special_tokens_sit_at_qwens_ids(tokenizer: Any) -> None:
    ids = [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    assert ids == list(range(FIRST_SPECIAL_ID, FIRST_SPECIAL_ID + len(SPECIAL_TOKENS)))
    assert len(tokenizer) == FIRST_SPECIAL_ID + len(SPECIAL_TOKENS)


def test_every_reserved_character_and_pair_encodes_back_to_itself(tokenizer: Any, trained: Any) -> None:
    first_reserved = len(trained) - len(SPECIAL_TOKENS)
    assert first_reserved < 4096  # nearly every id is reserved
    # The first 64 are pieces of a character (its first two bytes), as a published tokenizer's byte tokens are.
    pieces = range(first_reserved, first_reserved + 64)
    assert all(tokenizer.decode([i]) == "\ufffd" for i in pieces)
    wrong = [i for i in range(pieces.stop, FIRST_SPECIAL_ID, 7) if tokenizer(tokenizer.decode([i]))["input_ids"] != [i]]
    assert wrong == []


def test_random_answers_keep_their_length_in_the_history(tokenizer: Any) -> None:
    rng = random.Random(0)
    for _ in range(20):
        drawn = [rng.randrange(FIRST_SPECIAL_ID) for _ in range(128)]
        again = tokenizer(tokenizer.decode(drawn, skip_special_tokens=True))["input_ids"]
        # Within a few: a drawn character and one that pairs with it merge into one token, and a trained
        # vocabulary's lone byte of a multi-byte character comes back as the replacement character's bytes.
        assert len(drawn) - 8 <= len(again) <= len(drawn) + 8


def test_the_reserved_merges_leave_ordinary_text_as_the_trained_vocabulary_splits_it(
    tokenizer: Any, trained: Any
) -> None:
    text = "Thought: the Save button is greyed out.\nAction: click(start_box='(1203,87)') ünïcödé 数据"
    assert tokenizer(text)["input_ids"] == trained(text)["input_ids"]
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
