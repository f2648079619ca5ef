"""torchrun worker of test_megatron.py: the megatron backend at TP=2, then TP=1 x DP=2, against transformers.

Usage: ``torchrun --standalone --nproc-per-node 2 megatron_worker.py CHECKPOINT OUT_DIR``. Rank 0 writes
the measured differences to ``OUT_DIR/result.json``; the test asserts on them.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from PIL import Image

from dart.train.batching import InputBuilder, ModelInputs
from dart.train.config import MegatronBackendSettings, TrainerConfig
from dart.train.errors import CheckpointError
from dart.train.loss import token_logprobs
from dart.train.megatron import MegatronBackend
from dart.train.testing import OpCount

LR, CLIP, STEPS, TEMPERATURE = 1e-3, 1.0, 3, 0.7


def samples(backend: MegatronBackend) -> list[ModelInputs]:
    """One row with an image (64 visual tokens, 3-D positions) and one text-only row."""
    cfg = backend.hf_config
    builder = InputBuilder(backend.processor, int(cfg.image_token_id))
    image = Image.new("RGB", (224, 224), (10, 120, 200))
    image.putpixel((5, 5), (255, 0, 0))
    prompt = [5, 6, 7, cfg.vision_start_token_id] + [cfg.image_token_id] * 64 + [cfg.vision_end_token_id, 8, 9]
    return [builder.build(prompt, [11, 12, 13, 14, 15], [image]), builder.build([21, 22, 23, 24], [25, 26, 27], [])]


def loss_of(logp: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
    """A loss that touches both outputs: maximize likelihood, with a small entropy bonus."""
    return -logp.mean() - 0.01 * entropy.mean()


def hf_logprobs(model: torch.nn.Module, x: ModelInputs, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Tempered log-probs and raw (temperature 1) entropies from transformers, as the backend interface defines."""
    kw = x.kwargs("cpu", torch.float32)
    logits = model(**kw, use_cache=False).logits[0, x.prompt_len - 1 : x.prompt_len - 1 + x.response_len]
    targets = kw["input_ids"][0, x.prompt_len :]
    return token_logprobs(logits / temperature, targets)[0], token_logprobs(logits, targets)[1]


def train(backend: MegatronBackend, inputs: list[ModelInputs], steps: int) -> tuple[list[float], list[float]]:
    losses, norms = [], []
    for _ in range(steps):
        total = 0.0
        for x in inputs:
            loss = loss_of(*backend.forward_logprobs(x, temperature=TEMPERATURE))
            loss.backward()
            total += float(loss.detach())
        losses.append(total)
        norms.append(backend.optimizer_step())
    return losses, norms


def max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-30)) for k in b)


def max_abs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in b)


def main() -> None:
    checkpoint, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    started = time.perf_counter()
    result: dict[str, object] = {}
    config = TrainerConfig(
        model_path=checkpoint, lr=LR, grad_clip=CLIP, seed=0, backend={"kind": "megatron", "tensor_parallel_size": 2}
    )
    backend = MegatronBackend.create(config)
    inputs = samples(backend)
    result["layout"] = [backend.tensor_parallel_size, backend.data_parallel_size]
    hf = None
    if rank == 0:
        from transformers import Qwen2_5_VLForConditionalGeneration

        hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).train()
        initial = {k: v.clone() for k, v in hf.state_dict().items()}

    # 1. Conversion round trip HF -> Megatron (TP=2, live GPTModel parameters) -> HF: bitwise.
    state = backend.full_state_dict()
    if hf is not None:
        result["roundtrip_same_keys"] = set(state) == set(initial)
        result["roundtrip_bitwise"] = all(torch.equal(state[k], initial[k]) for k in initial)

    # 2. Logits, log-probs and entropies vs transformers, and gradients of the same loss.
    with torch.no_grad():
        x = inputs[0]
        logits = backend.model(x, 0, x.input_ids.shape[1])
        if hf is not None:
            ref = hf(**x.kwargs("cpu", torch.float32), use_cache=False).logits[0]
            result["logits_max_abs"] = float((logits - ref).abs().max())
            result["logits_scale"] = float(ref.abs().max())
    diffs = []
    # The rows megatron's output layer is given: the response-predicting positions only.
    head_rows: list[int] = []
    counted = backend.model.gpt.output_layer.register_forward_hook(
        lambda _module, args, _out: head_rows.append(args[0].shape[0])
    )
    unpacked = []
    for x in inputs:
        logp, entropy = backend.forward_logprobs(x, temperature=TEMPERATURE)
        loss_of(logp, entropy).backward()
        unpacked.append((logp.detach(), entropy.detach()))
        if hf is not None:
            ref_logp, ref_entropy = hf_logprobs(hf, x, TEMPERATURE)
            loss_of(ref_logp, ref_entropy).backward()
            diffs += [
                float((logp - ref_logp).detach().abs().max()),
                float((entropy - ref_entropy).detach().abs().max()),
            ]
    counted.remove()
    result["head_rows"] = head_rows
    result["response_and_sequence_lens"] = [[x.response_len, x.input_ids.shape[1]] for x in inputs]
    grads = backend.full_grad_dict()
    if hf is not None:
        result["logprob_entropy_max_abs"] = max(diffs)
        ref_grads = {n: p.grad for n, p in hf.named_parameters()}
        result["grads_same_keys"] = set(grads) == set(ref_grads)
        result["grads_max_rel"] = max_rel(grads, ref_grads)
        hf.zero_grad(set_to_none=True)
    backend.optimizer.zero_grad(set_to_none=True)

    # 2b. The same rows packed into one forward pass (a block-causal mask): each row's log-probs, entropies and the
    # gradients as unpacked, the output layer run once on every row's response-predicting positions.
    backend.config = backend.config.model_copy(update={"packing": True})
    packed_head_rows: list[int] = []
    counted = backend.model.gpt.output_layer.register_forward_hook(
        lambda _module, args, _out: packed_head_rows.append(args[0].shape[0])
    )
    packed = backend.forward_logprobs_many(inputs, [{"temperature": TEMPERATURE}] * len(inputs))
    counted.remove()
    sum(loss_of(logp, entropy) for logp, entropy in packed).backward()  # type: ignore[misc]
    packed_grads = backend.full_grad_dict()
    result["packed_head_rows"] = packed_head_rows
    result["packed_logprob_entropy_max_abs"] = max(
        float((a.detach() - b).abs().max())
        for (logp, entropy), (ref_logp, ref_entropy) in zip(packed, unpacked, strict=True)
        for a, b in ((logp, ref_logp), (entropy, ref_entropy))
    )
    if hf is not None:
        result["packed_grads_max_rel"] = max_rel(packed_grads, grads)
    backend.optimizer.zero_grad(set_to_none=True)
    backend.config = backend.config.model_copy(update={"packing": False})

    # 2c. Activation checkpointing: each decoder layer and vision block runs again in the backward pass (its SiLU
    # with it), and the gradients are the same.
    backend.model.checkpoint_activations()
    silu_in_backward = 0
    for x in inputs:
        logp, entropy = backend.forward_logprobs(x, temperature=TEMPERATURE)
        with OpCount() as ops:
            loss_of(logp, entropy).backward()
        silu_in_backward += ops.calls["silu"]
    checkpointed_grads = backend.full_grad_dict()
    result["checkpointed_silu_in_backward"] = silu_in_backward
    if hf is not None:
        result["checkpointed_grads_max_rel"] = max_rel(checkpointed_grads, grads)
    backend.optimizer.zero_grad(set_to_none=True)

    # 3. Three AdamW steps with clipping, vs transformers + torch AdamW + clip_grad_norm_ in one process.
    backend.save_checkpoint(out / "ckpt0")
    losses, norms = train(backend, inputs, 1)
    backend.save_checkpoint(out / "ckpt1")
    more_losses, more_norms = train(backend, inputs, STEPS - 1)
    losses, norms = losses + more_losses, norms + more_norms
    after = backend.full_state_dict()
    result["step"] = backend.step
    result["tp2_losses"], result["tp2_norms"] = losses, norms
    if hf is not None:
        opt = torch.optim.AdamW(hf.parameters(), lr=LR)
        ref_norms = []
        for _ in range(STEPS):
            for x in inputs:
                loss_of(*hf_logprobs(hf, x, TEMPERATURE)).backward()
            ref_norms.append(float(torch.nn.utils.clip_grad_norm_(hf.parameters(), CLIP)))
            opt.step()
            opt.zero_grad(set_to_none=True)
        result["ref_norms"] = ref_norms
        result["tp2_vs_hf_weights_max_abs"] = max_abs(after, hf.state_dict())
        result["weights_moved_max_abs"] = max_abs(after, initial)

    # 4. Exact resume: back to the checkpoint after step 1, the same two steps again.
    backend.load_checkpoint(out / "ckpt1")
    result["step_after_load"] = backend.step
    redo_losses, _ = train(backend, inputs, STEPS - 1)
    again = backend.full_state_dict()
    if rank == 0:
        result["resume_losses_equal"] = redo_losses == more_losses
        result["resume_bitwise"] = all(torch.equal(again[k], after[k]) for k in after)

    # 4b. A published version taken (a restart without a newer checkpoint): rank 0 holds the initial weights,
    # each TP rank converts its shard; the trained weights and the moments are gone.
    backend.load_published(state if rank == 0 else {})
    taken = backend.full_state_dict()
    moments = len(backend.optimizer.state)
    if rank == 0:
        result["published_taken_bitwise"] = set(taken) == set(state) and all(
            torch.equal(taken[k], state[k]) for k in state
        )
        result["published_taken_moments"] = moments
    backend.close()

    # 5. TP=1 x DP=2 (both ranks the same samples, gradients averaged): same trajectory as TP=2.
    # Built the way the trainer service builds backends: load(trainer config) with a backend section.
    single = MegatronBackend.load(
        config.model_copy(update={"backend": MegatronBackendSettings(tensor_parallel_size=1, data_parallel_size=2)})
    )
    result["dp_rank_size"] = [single.dp_rank, single.dp_size]
    result["layout_tp1"] = [single.tensor_parallel_size, single.data_parallel_size]
    try:
        single.load_checkpoint(out / "ckpt0")
        result["tp_mismatch_refused"] = False
    except CheckpointError:
        result["tp_mismatch_refused"] = True
    tp1_losses, tp1_norms = train(single, inputs, STEPS)
    tp1_after = single.full_state_dict()
    if rank == 0:
        result["tp1_losses"], result["tp1_norms"] = tp1_losses, tp1_norms
        result["tp1_vs_tp2_weights_max_abs"] = max_abs(tp1_after, after)
        assert all(math.isfinite(v) for v in losses + tp1_losses)
    single.close()

    # 6. A vocabulary TP does not divide (923 rows, padded to 924): the padded logit never shows.
    odd = out / "odd-vocab"
    if rank == 0:
        from transformers import Qwen2_5_VLForConditionalGeneration

        shutil.copytree(checkpoint, odd)
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32)
        model.resize_token_embeddings(923, mean_resizing=False)
        model.save_pretrained(odd)
    dist.barrier()
    padded = MegatronBackend.create(config.model_copy(update={"model_path": str(odd)}))
    with torch.no_grad():
        x = inputs[0]
        logits = padded.model(x, 0, x.input_ids.shape[1])
        logp, entropy = padded.forward_logprobs(x)
    state = padded.full_state_dict()
    if rank == 0:
        from transformers import Qwen2_5_VLForConditionalGeneration

        ref_model = Qwen2_5_VLForConditionalGeneration.from_pretrained(odd, dtype=torch.float32)
        with torch.no_grad():
            ref = ref_model(**x.kwargs("cpu", torch.float32), use_cache=False).logits[0]
            ref_logp, ref_entropy = hf_logprobs(ref_model, x, 1.0)
        result["odd_vocab_shapes"] = [list(logits.shape), list(ref.shape)]
        result["odd_vocab_logits_max_abs"] = float((logits - ref).abs().max())
        result["odd_vocab_logprob_entropy_max_abs"] = max(
            float((logp - ref_logp).abs().max()), float((entropy - ref_entropy).abs().max())
        )
        ref_state = ref_model.state_dict()
        result["odd_vocab_roundtrip_bitwise"] = set(state) == set(ref_state) and all(
            torch.equal(state[k], ref_state[k]) for k in ref_state
        )
        result["seconds"] = time.perf_counter() - started
        (out / "result.json").write_text(json.dumps(result, indent=1))
    padded.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
