"""Lets PyPI's CUDA-built torchvision import next to a CPU-only torch (installed only in the vLLM venv).

torchvision's compiled extension links libtorch_cuda and does not load with the CPU torch, so its
``torchvision::*`` operator schemas are never registered, and ``import torchvision`` then fails in its
meta registrations (``operator torchvision::nms does not exist``). :func:`install` puts an import hook
in front of ``torchvision`` that declares those schemas (no kernels) right before torchvision's first
import. vLLM's Qwen2.5-VL path only needs torchvision's transforms; the detection ops stay unusable.
A ``.pth`` file in the venv's site-packages calls :func:`install` at interpreter start; torch is only
imported when torchvision is.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Any

SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qroi_align(Tensor input, Tensor rois, float input_scale, int input_zero_point, float rois_scale, "
    "int rois_zero_point, float spatial_scale, SymInt pooled_height, SymInt pooled_width, int sampling_ratio, "
    "bool aligned) -> Tensor",
    "roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "int sampling_ratio, bool aligned) -> Tensor",
    "_roi_align_backward(Tensor grad, Tensor rois, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width, int sampling_ratio, "
    "bool aligned) -> Tensor",
    "ps_roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "int sampling_ratio) -> (Tensor, Tensor)",
    "_ps_roi_align_backward(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale, "
    "SymInt pooled_height, SymInt pooled_width, int sampling_ratio, SymInt batch_size, SymInt channels, "
    "SymInt height, SymInt width) -> Tensor",
    "roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width) "
    "-> (Tensor, Tensor)",
    "_roi_pool_backward(Tensor grad, Tensor rois, Tensor argmax, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width) -> Tensor",
    "ps_roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width) "
    "-> (Tensor, Tensor)",
    "_ps_roi_pool_backward(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale, "
    "SymInt pooled_height, SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, "
    "SymInt width) -> Tensor",
    "deform_conv2d(Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, SymInt stride_h, "
    "SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, SymInt dilation_w, SymInt groups, "
    "SymInt offset_groups, bool use_mask) -> Tensor",
    "_deform_conv2d_backward(Tensor grad, Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, "
    "SymInt stride_h, SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, SymInt dilation_w, "
    "SymInt groups, SymInt offset_groups, bool use_mask) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    "_interpolate_bilinear2d_aa(Tensor input, int[] output_size, bool align_corners) -> Tensor",
    "_interpolate_bicubic2d_aa(Tensor input, int[] output_size, bool align_corners) -> Tensor",
)
_library: Any = None


def declare_schemas() -> None:
    """Declare the ``torchvision::*`` schemas the CUDA extension would have registered (idempotent)."""
    global _library
    if _library is not None:
        return
    import torch

    library = torch.library.Library("torchvision", "FRAGMENT")
    for schema in SCHEMAS:
        try:
            library.define(schema)
        except RuntimeError:  # already declared (a working extension registered it)
            pass
    _library = library  # the Library object must stay alive, or its definitions are dropped


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        if fullname == "torchvision":
            sys.meta_path.remove(self)
            declare_schemas()
        return None  # let the normal finders import it


def install() -> None:
    """Declare the schemas just before torchvision is first imported."""
    if not any(isinstance(h, _Hook) for h in sys.meta_path):
        sys.meta_path.insert(0, _Hook())
