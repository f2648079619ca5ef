"""Sequence packing: a micro-batch's samples as one row of one forward pass, each attending to itself only.

Unpacked, each sample is its own forward pass (``batching``'s one unpadded row per sample). Packed, the
rows are laid end to end: one ``(1, sum L_i)`` row of token ids, every sample's image patches in order,
and ``(4, 1, sum L_i)`` positions: the text positions (``0 .. L_i - 1`` per sample) above the three
multimodal rope rows, each sample's computed on its own row alone (:func:`rope_positions`). Nothing is
padded, so many short samples cost what their tokens cost, not the longest one's length each.

The attention stays per sample. transformers reads the sample boundaries from the text positions (a
restart at 0) and builds a block-causal mask (sdpa, eager) or variable-length attention (flash-attention
2); megatron's attention takes :func:`block_causal_mask`. Vision towers already attend within each image.
So each sample's log-probs equal its own row's up to the attention kernel's rounding (tested).

The LM head runs on the positions that predict response tokens only (:meth:`PackedInputs.kept_positions`):
as unpacked, a prompt's logits are never made.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dart.train.batching import ModelInputs
from dart.train.loss import behaviour_logprobs


def rope_positions(rope_owner: Any, inputs: ModelInputs, device: torch.device | str) -> torch.Tensor:
    """``(3, 1, L)`` multimodal rope positions of one row, as the model computes them (text-only rows:
    ``0 .. L - 1`` on all three). ``rope_owner`` is the transformers model that has ``get_rope_index``
    (``Qwen2_5_VLModel``, ``Qwen3VLModel``); it reads its config only."""
    ids = inputs.input_ids.to(device)
    if inputs.image_grid_thw is None:
        return torch.arange(ids.shape[1], device=device).view(1, 1, -1).expand(3, 1, -1)
    pos, _ = rope_owner.get_rope_index(
        ids,
        mm_token_type_ids=inputs.mm_token_type_ids.to(device),
        image_grid_thw=inputs.image_grid_thw.to(device),
        attention_mask=torch.ones_like(ids),
    )
    assert isinstance(pos, torch.Tensor)
    return pos


@dataclass(frozen=True)
class PackedInputs:
    """Several samples' rows as one.

    Attributes:
        rows: The samples' own inputs, in order.
        input_ids: ``(1, T)``, the rows' token ids end to end (``T = sum L_i``).
        mm_token_type_ids: ``(1, T)``.
        pixel_values: Every row's image patches in order, or None without images.
        image_grid_thw: ``(num_images, 3)`` in the same order, or None.
        position_ids: ``(4, 1, T)``: text positions (restarting at 0 for each row), then the rope rows.
        starts: Offset of each row in the packed row.
    """

    rows: tuple[ModelInputs, ...]
    input_ids: torch.Tensor
    mm_token_type_ids: torch.Tensor
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None
    position_ids: torch.Tensor
    starts: tuple[int, ...]

    @property
    def lengths(self) -> list[int]:
        """Tokens of each row."""
        return [int(r.input_ids.shape[1]) for r in self.rows]

    def kept_positions(self) -> torch.Tensor:
        """Indices of the positions whose logits are needed: row ``i``'s ``R_i`` response tokens are predicted by
        its positions ``P_i - 1 .. P_i + R_i - 2`` (position t predicts token t + 1). In row order."""
        spans = [
            torch.arange(start + row.prompt_len - 1, start + row.prompt_len - 1 + row.response_len)
            for start, row in zip(self.starts, self.rows, strict=True)
        ]
        return torch.cat(spans)

    def kwargs(self, device: torch.device | str, dtype: torch.dtype) -> dict[str, Any]:
        """Keyword arguments of a transformers Qwen-VL forward pass, on ``device`` (pixels in ``dtype``). No
        attention mask: the model derives the block-causal one from the text positions."""
        out: dict[str, Any] = {
            "input_ids": self.input_ids.to(device),
            "mm_token_type_ids": self.mm_token_type_ids.to(device),
            "position_ids": self.position_ids.to(device),
        }
        if self.pixel_values is not None:
            out["pixel_values"] = self.pixel_values.to(device=device, dtype=dtype)
            out["image_grid_thw"] = self.image_grid_thw.to(device) if self.image_grid_thw is not None else None
        return out


def pack(rows: Sequence[ModelInputs], rope_owner: Any) -> PackedInputs:
    """Lay ``rows`` end to end (see the module docstring); ``rope_owner`` computes each row's rope positions.

    Raises:
        ValueError: No rows, or a row without a prompt token (its first response token has no predicting
            position).
    """
    if not rows:
        raise ValueError("packing needs at least one row")
    if any(r.prompt_len < 1 for r in rows):
        raise ValueError("every packed row needs at least one prompt token")
    starts, at = [], 0
    positions = []
    for row in rows:
        starts.append(at)
        length = int(row.input_ids.shape[1])
        at += length
        text = torch.arange(length).view(1, 1, -1)
        positions.append(torch.cat([text, rope_positions(rope_owner, row, "cpu").to(text.dtype)], dim=0))
    pixels = [r.pixel_values for r in rows if r.pixel_values is not None]
    grids = [r.image_grid_thw for r in rows if r.image_grid_thw is not None]
    return PackedInputs(
        rows=tuple(rows),
        input_ids=torch.cat([r.input_ids for r in rows], dim=1),
        mm_token_type_ids=torch.cat([r.mm_token_type_ids for r in rows], dim=1),
        pixel_values=torch.cat(pixels) if pixels else None,
        image_grid_thw=torch.cat(grids) if grids else None,
        position_ids=torch.cat(positions, dim=2),
        starts=tuple(starts),
    )


def block_causal_mask(lengths: Sequence[int], device: torch.device | str) -> torch.Tensor:
    """``(1, 1, T, T)`` boolean mask, ``True`` where a score is masked out (megatron's convention): a token sees
    the tokens of its own row up to itself."""
    row = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))
    causal = torch.ones(row.numel(), row.numel(), dtype=torch.bool, device=device).tril()
    same = row[:, None] == row[None, :]
    return ~(causal & same)[None, None]


def row_logprobs(
    logits: torch.Tensor, rows: Sequence[ModelInputs], samplings: Sequence[Mapping[str, Any]]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each row's ``(logp, entropy)`` (:func:`~dart.train.loss.behaviour_logprobs` under ``samplings[i]``) from the
    kept positions' logits of a packed pass (:meth:`PackedInputs.kept_positions` order)."""
    out = []
    for row, pred, sampling in zip(rows, torch.split(logits, [r.response_len for r in rows]), samplings, strict=True):
        targets = row.input_ids[0, row.prompt_len :].to(logits.device)
        out.append(behaviour_logprobs(pred, targets, **sampling))
    return out
