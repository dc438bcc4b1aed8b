"""Global parameter names: a layout-independent name for every parameter of a GPT chunk.

A parameter's *global name* is the name it has in an unpipelined model with one
expert-parallel rank. A pipeline stage's ``decoder.layers.K`` becomes ``decoder.layers.G``
with ``G`` the layer's global index (Megatron's layer offset, as stored in ``layer_number``,
so it also holds for custom layouts), a local expert ``J`` (of a decoder layer or of an MTP
layer's transformer layer, :func:`~.version.mtp_inner_layer_name`) becomes its global expert
index, and a tied ``output_layer.weight`` becomes ``embedding.word_embeddings.weight``. MTP
layers keep their names (``mtp.layers.K``: Megatron numbers them from 0 wherever they sit),
and so does the MTP block's copy of the embedding, which is therefore named like the
embedding it copies. Initialisation by name (the training loop) and the tests' comparisons
with an unpipelined reference rely on it.
"""

from __future__ import annotations

import re

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.utils import unwrap_model

from ..compat.version import mtp_inner_layer_name

__all__ = ["global_named_parameters"]

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")
_TIED_OUTPUT = "output_layer.weight"
_WORD_EMBEDDINGS = "embedding.word_embeddings.weight"


def _global_expert(layer: torch.nn.Module, rest: str) -> str:
    """``rest`` of a transformer layer's parameter name with its global expert index."""
    expert = _LOCAL_EXPERT.match(rest)
    if expert is None:
        return rest
    global_expert = layer.mlp.local_expert_indices[int(expert.group(1))]
    return f"mlp.experts.local_experts.{global_expert}.{expert.group(2)}"


def _global_name(model: GPTModel, name: str) -> str:
    match = _LAYER.match(name)
    if match is not None:
        layer = model.decoder.layers[int(match.group(1))]
        return f"decoder.layers.{layer.layer_number - 1}.{_global_expert(layer, match.group(2))}"
    inner = mtp_inner_layer_name()
    match = re.match(rf"^(mtp\.layers\.(\d+)\.{inner}\.)(.*)$", name)
    if match is not None:
        layer = getattr(model.mtp.layers[int(match.group(2))], inner)
        return match.group(1) + _global_expert(layer, match.group(3))
    if name == _TIED_OUTPUT and model.share_embeddings_and_output_weights:
        return _WORD_EMBEDDINGS
    return name


def global_named_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Parameters of one model chunk (wrappers such as DDP allowed) by global name."""
    inner = unwrap_model(model)
    named = {_global_name(inner, name): p for name, p in inner.named_parameters()}
    if len(named) != len(list(inner.parameters())):
        raise ValueError("two parameters of one model chunk map to the same global name")
    return named
