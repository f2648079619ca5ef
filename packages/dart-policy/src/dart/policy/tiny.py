"""A tiny random Qwen2.5-VL checkpoint with a locally trained tokenizer, for CPU runs and tests.

Nothing is downloaded: the tokenizer is a byte-level BPE trained with ``tokenizers`` on the UI-TARS
action grammar and a list of instruction texts, and the weights are random. The result loads with
``AutoProcessor.from_pretrained(path)`` and ``Qwen2_5_VLForConditionalGeneration.from_pretrained(path)``
like any Qwen2.5-VL checkpoint, so the same code paths serve the production model.

Usage::

    manifest = write_tiny_checkpoint("/tmp/tiny-policy", seed=0)
"""

from __future__ import annotations

import itertools
import json
import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dart.policy.action_grammar import format_output
from dart.policy.families import writer_of
from dart.policy.formats import DART_ACTION_SPACE, DART_SYSTEM_PROMPT
from dart.policy.models import MODEL_FAMILIES
from dart.policy.tiny_spec import IMAGE_SIZE, TinyModelSpec
from dart.protocol.messages import (
    Action,
    Click,
    DoubleClick,
    Drag,
    Fail,
    Finished,
    Hotkey,
    RightClick,
    Scroll,
    ScrollDirection,
    Type,
    Wait,
)

MANIFEST_NAME = "dart_tiny_manifest.json"

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
"""Qwen2.5-VL's special tokens, in Qwen's order; they get the ids right after the BPE vocabulary."""

# Qwen2-VL's chat template (images and text parts, no tools), so apply_chat_template works too.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

DEFAULT_INSTRUCTIONS: tuple[str, ...] = (
    "Click the OK button.",
    "Click the Cancel button.",
    "Click the Submit button.",
    "Click on the link named Next.",
    "Double click the file icon.",
    "Right click the folder and choose Delete.",
    "Type hello into the text field and press Submit.",
    "Type the name John Smith into the field and press Enter.",
    "Enter the password and click Login.",
    "Tick the checkbox labelled Remember me.",
    "Tick all the checkboxes, then click Submit.",
    "Untick the box next to Newsletter.",
    "Select Blue in the list and click Submit.",
    "Select the third item in the dropdown menu.",
    "Choose the date 12/05/2024 from the calendar.",
    "Drag the slider to the right end.",
    "Drag the square into the box.",
    "Scroll down and click the last button.",
    "Scroll up to the top of the page.",
    "Open the menu and click Settings.",
    "Close the dialog window.",
    "Press ctrl c to copy the selected text.",
    "Copy the text and paste it into the search box.",
    "Search for weather in the search bar.",
    "Find the word apple and click it.",
    "Click the red circle, then the green square.",
    "Click the tab named Profile and save the changes.",
    "Wait until the page loads, then click Continue.",
    "Enter the number 42 in the input and press Enter.",
    "Select yes or no and press the button.",
    "Turn on the switch and click Apply.",
    "Rename the file to report and press Enter.",
)
"""Typical simulated-environment instructions, the default tokenizer training text."""


@dataclass(frozen=True)
class TinyManifest:
    """What :func:`write_tiny_checkpoint` wrote (also stored as ``dart_tiny_manifest.json``).

    Attributes:
        path: Checkpoint directory.
        architecture: The transformers class name to load the weights with.
        transformers_version: Version that wrote the checkpoint.
        seed: Seed of the random weights and the synthetic tokenizer corpus.
        num_parameters: Total parameter count.
        vocab_size: Tokenizer size including special tokens (equals the embedding rows).
        image_tokens: Visual tokens one screenshot becomes in the prompt.
        spec: The sizes used.
        created_at: Unix time of creation, seconds.
    """

    path: str
    architecture: str
    transformers_version: str
    seed: int
    num_parameters: int
    vocab_size: int
    image_tokens: int
    spec: dict[str, Any] = field(default_factory=dict)
    created_at: float = 0.0


def _random_action(rng: random.Random, words: Sequence[str]) -> Action:
    def c() -> float:
        return rng.randint(0, 1000) / 1000

    kind = rng.randrange(10)
    if kind == 0:
        return Click(x=c(), y=c())
    if kind == 1:
        return DoubleClick(x=c(), y=c())
    if kind == 2:
        return RightClick(x=c(), y=c())
    if kind == 3:
        return Drag(x1=c(), y1=c(), x2=c(), y2=c())
    if kind == 4:
        return Hotkey(keys=tuple(rng.sample(["ctrl", "shift", "alt", "enter", "tab", "a", "c", "v", "escape"], 2)))
    if kind == 5:
        return Type(text=" ".join(rng.sample(list(words), min(3, len(words)))))
    if kind == 6:
        return Scroll(x=c(), y=c(), direction=rng.choice(list(ScrollDirection)))
    if kind == 7:
        return Wait()
    if kind == 8:
        return Finished(content=rng.choice(["", "done", "The task is complete."]))
    return Fail(reason=rng.choice(["", "cannot find the button"]))


def tokenizer_corpus(instructions: Iterable[str], *, seed: int = 0, num_actions: int = 3000) -> list[str]:
    """Training text for the tiny tokenizer: the prompt scaffold, instructions and many action outputs.

    Args:
        instructions: Instruction texts whose words should become whole tokens.
        seed: Seed for the random actions.
        num_actions: How many random ``Thought/Action`` outputs to include (covers all coordinates 0..1000).
    """
    rng = random.Random(seed)
    texts = [DART_SYSTEM_PROMPT, DART_ACTION_SPACE, *instructions]
    words = [w.strip(".,") for t in texts for w in t.split()] or ["ok"]
    for i in range(num_actions):
        thought = " ".join(rng.sample(words, min(6, len(words))))
        texts.append(format_output(thought, _random_action(rng, words)))
        texts.append(str(i % 1001))
    return texts


def build_tokenizer(texts: Iterable[str], vocab_size: int, *, first_special_id: int | None = None) -> Any:
    """Train a byte-level BPE on ``texts`` and wrap it as a Qwen2 fast tokenizer.

    Byte-level means any text encodes, and decode(encode(text)) == text, which the action parser relies on.

    Args:
        texts: Training text.
        vocab_size: Target size of the BPE vocabulary, before the special tokens.
        first_special_id: Put the special tokens from this id on (Qwen's is 151643), filling the ids between
            the trained vocabulary and it with reserved tokens of private-use characters (see
            :func:`_reserve_ids_until`); None puts them right after the trained vocabulary.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2TokenizerFast  # type: ignore[attr-defined]  # lazily exported alias

    tok = Tokenizer(models.BPE())
    # Digits are split one by one (as Qwen does) so coordinates are not memorised as whole numbers.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    if first_special_id is not None:
        tok = _reserve_ids_until(tok, first_special_id)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return Qwen2TokenizerFast(
        tokenizer_object=tok,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=32768,
        chat_template=CHAT_TEMPLATE,
    )


def _reserve_ids_until(tok: Any, first_free: int) -> Any:
    """``tok`` with vocabulary entries added up to id ``first_free - 1``, each with the merge that produces it.

    As in a published tokenizer, every id but a few pieces of characters is text that encodes back to it: the 64
    two-byte prefixes of U+E000..U+EFFF (the pieces), then those 4,096 characters, then pairs of a character from
    U+E000..U+E7FF and one from U+E800..U+EFFF (the two halves never merge among themselves, so a run of decoded
    pairs splits back as it was written). Every merge starts with byte 0xEE, which only these characters start
    with, so no other text encodes differently. A random policy draws mostly these ids: decoded into its answer and
    encoded again into the next step's history they keep their number, as a real model's tokens do (placeholder
    tokens that no text encodes to would come back as the characters of their names, about 17 tokens each).

    Raises:
        ValueError: The trained vocabulary already reaches ``first_free``.
    """
    from tokenizers import Tokenizer, pre_tokenizers

    data = json.loads(tok.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    merges: list[list[str]] = data["model"]["merges"]
    if len(vocab) > first_free:
        raise ValueError(
            f"the trained vocabulary has {len(vocab)} tokens, more than the {first_free} ids below the first special id"
        )
    # Each character as the byte-level pre-tokenizer shows its three UTF-8 bytes (one symbol per byte).
    shown = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    chars = {cp: shown.pre_tokenize_str(chr(cp))[0][0] for cp in range(0xE000, 0xF000)}
    prefixes = dict.fromkeys(c[:2] for c in chars.values())
    candidates = itertools.chain(
        ((p[0], p[1]) for p in prefixes),
        ((c[:2], c[2]) for c in chars.values()),
        ((chars[a], chars[b]) for a in range(0xE000, 0xE800) for b in range(0xE800, 0xF000)),
    )
    for left, right in candidates:
        if len(vocab) >= first_free:
            break
        if left + right not in vocab:
            vocab[left + right] = len(vocab)
            merges.append([left, right])
    if len(vocab) < first_free:  # pragma: no cover - 4 million pairs fill any vocabulary below Qwen's ids
        raise ValueError(f"could not reserve ids up to {first_free}")
    return Tokenizer.from_str(json.dumps(data))


def write_tiny_checkpoint(
    path: str | Path,
    *,
    seed: int = 0,
    vocab_texts: Sequence[str] | None = None,
    spec: TinyModelSpec | None = None,
) -> TinyManifest:
    """Write a random tiny checkpoint of ``spec.family`` (config, safetensors, tokenizer, processor, manifest).

    Args:
        path: Directory to write (created; existing files are overwritten).
        seed: Seed of the weights and the tokenizer's synthetic corpus; the same seed gives the same checkpoint.
        vocab_texts: Instruction texts the tokenizer is trained on besides the action grammar;
            defaults to :data:`DEFAULT_INSTRUCTIONS`.
        spec: Model sizes; defaults to :class:`TinyModelSpec`.

    Returns:
        The manifest, also written to ``path/dart_tiny_manifest.json``.
    """
    import torch
    import transformers

    spec = spec or TinyModelSpec()
    family = MODEL_FAMILIES.get(spec.family)
    writer = writer_of(family)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(
        tokenizer_corpus(vocab_texts if vocab_texts is not None else DEFAULT_INSTRUCTIONS, seed=seed),
        spec.bpe_vocab_size,
    )
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    vocab_size = len(tokenizer)
    config = writer.tiny_config(spec, vocab_size, ids)
    torch.manual_seed(seed)
    model = family.model_cls()(config).to(torch.float32).eval()
    model.generation_config.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.save_pretrained(out)
    writer.tiny_processor(spec, tokenizer).save_pretrained(out)

    image_tokens = spec.image_tokens
    manifest = TinyManifest(
        path=str(out),
        architecture=type(model).__name__,
        transformers_version=transformers.__version__,
        seed=seed,
        num_parameters=sum(p.numel() for p in model.parameters()),
        vocab_size=vocab_size,
        image_tokens=image_tokens,
        spec=asdict(spec),
        created_at=time.time(),
    )
    (out / MANIFEST_NAME).write_text(json.dumps(asdict(manifest), indent=2) + "\n")
    return manifest


def main() -> None:
    """Write a tiny checkpoint to the directory given on the command line and time one CPU forward pass."""
    import argparse

    import torch

    from dart.policy.loading import load_policy

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("path")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    manifest = write_tiny_checkpoint(args.path, seed=args.seed)
    model, processor = load_policy(args.path)
    from PIL import Image

    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (200, 30, 30))
    text = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>" + "click " * 200
    inputs = processor(text=[text], images=[image], return_tensors="pt")
    with torch.inference_mode():
        model(**inputs)
        start = time.perf_counter()
        model(**inputs)
        elapsed = time.perf_counter() - start
    print(
        f"{manifest.architecture}: {manifest.num_parameters:,} parameters, vocab {manifest.vocab_size}, "
        f"{inputs['input_ids'].shape[1]} prompt tokens ({manifest.image_tokens} visual), "
        f"forward {elapsed * 1000:.1f} ms on {torch.get_num_threads()} CPU threads"
    )


if __name__ == "__main__":
    main()
