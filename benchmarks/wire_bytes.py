"""What a real-size episode weighs on the bus: a 1920x1080 desktop episode under UI-TARS-1.5's prompt with the
model's own resize rule and two earlier screens, its steps' exact prompt tokens as a real-width checkpoint's
processor gives them, encoded as one trajectory message and as the training batch of its group, each as plain
JSON and in the wire form the codec sends (xz-compressed above its threshold), with the time to encode and to
decode.

No engine runs: the answers are either random token ids decoded to text, as a randomly initialized model writes them
(``--answers random``: mostly the cut's reserved private-use ids, which re-tokenize to about as many tokens as were
drawn), or a short UI-TARS answer of about 40 tokens (``--answers short``), as a trained policy writes. Screens are
references (dart-data stores every image by reference); what is weighed is the tokens, log-probs and text.

Usage::

    python benchmarks/wire_bytes.py [--model DIR] [--steps 20] [--answers random|short] [--group 2]

``--model`` is a real-width checkpoint whose processor is read (written first when missing:
``dart model init --arch qwen2.5-vl-3b --layers 2 --vision-blocks 2``). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from desktop_1080p import ROOT, init_model
from PIL import Image as PILImage
from transformers import AutoProcessor

from dart.policy.formats import PROMPT_FORMATS
from dart.policy.models import family_of
from dart.policy.prompt import HistoryStep, build_prompt, encode_prompt
from dart.policy.screen import ResizeRule
from dart.protocol.messages import ImageRef, StepRecord, TrainingBatch, TrainingSample, Trajectory
from dart.protocol.messages.codec import COMPRESS_ABOVE_BYTES, decode, encode
from dart.runtime.testing import all_messages

SCREEN = (1920, 1080)


def answer_ids(tokenizer: Any, rng: random.Random, kind: str, step: int, new_tokens: int) -> list[int]:
    if kind == "random":
        return [rng.randrange(len(tokenizer)) for _ in range(new_tokens)]
    x, y = rng.randrange(SCREEN[0]), rng.randrange(SCREEN[1])
    text = f"Thought: The terminal is open; I click it and type the command for step {step}.\n"
    return list(tokenizer.encode(text + f"Action: click(start_box='({x},{y})')"))


def episode(model: Path, steps: int, answers: str, new_tokens: int, max_images: int, seed: int) -> list[StepRecord]:
    """The steps of one episode, each recording the exact prompt tokens the processor gives."""
    processor = AutoProcessor.from_pretrained(model)
    rule = ResizeRule.of_checkpoint(model)
    chat, fmt = family_of(model).chat, PROMPT_FORMATS.get("ui-tars-1.5")
    template = next(x for x in all_messages() if isinstance(x, Trajectory)).steps[0]
    rng = random.Random(seed)
    history: list[HistoryStep] = []
    records = []
    shown = rule.size(*SCREEN)
    for i in range(steps):
        screen = PILImage.new("RGB", SCREEN, (rng.randrange(256), 0, 0))
        prompt = build_prompt(
            "Open a terminal and list the files",
            screen,
            history,
            max_images=max_images,
            image_size=rule,
            prompt_format=fmt,
            chat=chat,
        )
        ids = encode_prompt(processor, prompt).input_ids
        response = answer_ids(processor.tokenizer, rng, answers, i, new_tokens)
        text = processor.tokenizer.decode(response, skip_special_tokens=True)
        digest = hashlib.sha256(f"{seed}-{i}".encode()).hexdigest()
        screenshot = ImageRef(
            uri=f"s3://bucket/screenshots/{digest}.png", sha256=digest, width=SCREEN[0], height=SCREEN[1]
        )
        fed = ImageRef(
            uri=f"s3://bucket/screenshots/{digest[::-1]}.png", sha256=digest[::-1], width=shown[0], height=shown[1]
        )
        records.append(
            template.model_copy(
                update={
                    "index": i,
                    "observation": template.observation.model_copy(update={"screenshot": screenshot}),
                    "prompt_token_ids": ids,
                    "prompt_images": [fed] * len(prompt.images),
                    "response_token_ids": response,
                    "response_logprobs": [rng.uniform(-12.0, 0.0) for _ in response],
                    "response_entropy": [],
                    "response_text": text,
                }
            )
        )
        history.append(HistoryStep(text, screen))
    return records


def weigh(msg: Any, schema: type[Any]) -> dict[str, Any]:
    """Plain JSON and wire bytes of ``msg``, and the median of 3 encodes and decodes, ms."""
    plain = len(msg.model_dump_json().encode())
    encodes, decodes = [], []
    for _ in range(3):
        began = time.perf_counter()
        data = encode(msg)
        encodes.append(time.perf_counter() - began)
        began = time.perf_counter()
        assert decode(data, schema) == msg
        decodes.append(time.perf_counter() - began)
    return {
        "json_bytes": plain,
        "wire_bytes": len(data),
        "ratio": round(plain / len(data), 1),
        "encode_ms": round(1000 * statistics.median(encodes), 1),
        "decode_ms": round(1000 * statistics.median(decodes), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "qwen2.5-vl-3b-2l")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--answers", choices=("random", "short"), default="random")
    parser.add_argument("--new-tokens", type=int, default=128, help="a random answer's length, tokens")
    parser.add_argument("--max-images", type=int, default=3)
    parser.add_argument("--group", type=int, default=2, help="trajectories in the group the batch trains on")
    args = parser.parse_args()
    if not (args.model / "config.json").is_file():
        print(f"checkpoint written to {args.model} in {init_model(args.model)} s")
    samples = next(x for x in all_messages() if isinstance(x, TrainingBatch))
    trajectory = next(x for x in all_messages() if isinstance(x, Trajectory))
    trajectories, batch_samples = [], []
    for member in range(args.group):
        steps = episode(args.model, args.steps, args.answers, args.new_tokens, args.max_images, seed=member)
        version = steps[0].policy_version
        trajectories.append(
            trajectory.model_copy(update={"steps": steps, "min_policy_version": version, "max_policy_version": version})
        )
        template: TrainingSample = samples.samples[0]
        batch_samples += [
            template.model_copy(
                update={
                    "step_index": s.index,
                    "policy_version": version,
                    "prompt_token_ids": s.prompt_token_ids,
                    "response_token_ids": s.response_token_ids,
                    "rollout_logprobs": s.response_logprobs,
                    "images": s.prompt_images,
                }
            )
            for s in steps
        ]
    batch = samples.model_copy(
        update={"samples": batch_samples, "min_policy_version": version, "max_policy_version": version}
    )
    prompt_tokens = [len(s.prompt_token_ids) for s in trajectories[0].steps]
    result = {
        "screen": list(SCREEN),
        "answers": args.answers,
        "steps": args.steps,
        "max_images": args.max_images,
        "compress_above_bytes": COMPRESS_ABOVE_BYTES,
        "prompt_tokens_first_last": [prompt_tokens[0], prompt_tokens[-1]],
        "trajectory": weigh(trajectories[0], Trajectory),
        "batch": {"samples": len(batch_samples), **weigh(batch, TrainingBatch)},
    }
    for name in ("trajectory", "batch"):
        f = result[name]
        print(
            f"{name}: {f['json_bytes']:,} B as JSON, {f['wire_bytes']:,} B on the wire ({f['ratio']}x); "
            f"encode {f['encode_ms']} ms, decode {f['decode_ms']} ms"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
