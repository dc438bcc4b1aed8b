"""dualpipev's chunks given the initial values Megatron-LM's 1F1B gives their layers, so
that two fresh runs, one under 1F1B and one under dualpipev, print the same digits.

:func:`values_as_1f1b` builds, for every 1F1B rank whose layers a chunk holds, that rank's
modules as 1F1B seeds and builds them (:class:`AsRank`), copies the parameters the chunk
holds by global name and puts back the random state it found. It applies where 1F1B's split
is Megatron's even one and each chunk's layers lie within one 1F1B rank's, and returns False
otherwise. Why and how: docs/training.md, "The same losses: exactly what is equal".
"""

from __future__ import annotations

import contextlib
import copy
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from megatron.core import parallel_state, tensor_parallel
from torch import nn

from ...schedules.pipeline_setup import PipelineSetup
from ..schedule.checks import pipeline_setup
from .names import global_named_parameters
from .placement import StagePlacementLayout, chunk_roles

__all__ = ["AsRank", "megatron_lm_seed", "one_f_one_b_owners", "values_as_1f1b"]


class AsRank(StagePlacementLayout):
    """1F1B's layout of ``layers`` per rank, with this process building 1F1B's pipeline
    rank ``rank`` whatever its own (its row of ``layout`` too, which Megatron's MTP helpers
    read)."""

    def __init__(
        self, pipeline_size: int, layers: Sequence[int], mtp_num_layers: int | None, rank: int
    ):
        super().__init__(pipeline_setup("1f1b", pipeline_size, tuple(layers)), mtp_num_layers)
        self.as_rank = rank
        here = parallel_state.get_pipeline_model_parallel_rank()
        self.layout[here] = list(self.layout[rank])

    def _model_stage(self, vp_stage: int | None, pp_rank: int | None) -> int:
        return self.as_rank


def one_f_one_b_owners(setup: PipelineSetup) -> list[list[int]] | None:
    """Per rank of a dualpipev ``setup`` (its ``stage_layers``: decoder layers of each of
    the V's model stages), per local chunk, the 1F1B rank whose layers it holds under
    Megatron's even split; None (for every rank alike) where 1F1B's split is not even or a
    chunk's layers span two 1F1B ranks."""
    total, pipeline_size = sum(setup.stage_layers), setup.pipeline_size
    if total % pipeline_size:
        return None
    per = total // pipeline_size
    owners = [_owners(setup, rank, per) for rank in range(pipeline_size)]
    return None if None in owners else owners


def _owners(setup: PipelineSetup, rank: int, per: int) -> list[int] | None:
    pipeline_size = setup.pipeline_size
    owners = []
    for role in chunk_roles(setup, rank):
        first, last = role.layer_offset, role.layer_offset + role.num_layers - 1
        owner = min(first // per, pipeline_size - 1)
        if role.num_layers and last // per != owner:
            return None
        if role.pre_process:
            owner = 0 if owner == 0 and role.layer_offset == 0 else -1
        if role.post_process and owner != pipeline_size - 1:
            owner = -1
        if owner < 0:
            return None
        owners.append(owner)
    return owners


@contextlib.contextmanager
def _random_state_kept() -> Iterator[None]:
    """The Python, NumPy, torch and CUDA generators and Megatron's RNG tracker as they were
    before the block."""
    saved = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracked = tracker.get_states()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])
        tracker.set_states(tracked)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def megatron_lm_seed(args: Any, pipeline_rank: int, use_cudagraphable_rng: bool) -> None:
    """Seed every generator as Megatron-LM's ``pretrain`` leaves pipeline rank
    ``pipeline_rank``'s before building its model: ``initialize_megatron``'s
    ``_set_random_seed`` (which adds 100 per rank to ``args.seed``, here from this process's
    rank), then ``set_jit_fusion_options``, whose warm-up draws random tensors (from the
    generator the weights are drawn from where they are made on the CPU)."""
    from megatron.training.initialize import _set_random_seed, set_jit_fusion_options

    here = parallel_state.get_pipeline_model_parallel_rank()
    _set_random_seed(
        args.seed + 100 * (pipeline_rank - here),
        getattr(args, "data_parallel_random_init", False),
        getattr(args, "te_rng_tracker", False),
        getattr(args, "inference_rng_tracker", False),
        use_cudagraphable_rng,
    )
    set_jit_fusion_options()


def values_as_1f1b(
    chunks: Sequence[nn.Module],
    *,
    setup: PipelineSetup,
    mtp_num_layers: int | None,
    config: Any,
    build: Callable[[Any, bool, bool], nn.Module],
    seed_as: Callable[[int], None],
) -> bool:
    """Give this rank's ``chunks`` of a dualpipev ``setup`` the values 1F1B gives their
    parameters (docs/training.md). ``build(config, pre_process, post_process)``
    builds one chunk as the run builds its chunks; ``seed_as(k)`` seeds every generator as
    Megatron-LM seeds pipeline rank k. False (nothing changed) where the split does not
    allow it."""
    every = one_f_one_b_owners(setup)
    if every is None:
        return False
    owners = every[parallel_state.get_pipeline_model_parallel_rank()]
    pipeline_size = setup.pipeline_size
    per = sum(setup.stage_layers) // pipeline_size
    layers = [per] * pipeline_size
    with _random_state_kept(), torch.no_grad():
        for owner in sorted(set(owners)):
            seed_as(owner)
            as_owner = copy.copy(config)
            as_owner.pipeline_model_parallel_layout = AsRank(
                pipeline_size, layers, mtp_num_layers, owner
            )
            built = global_named_parameters(build(as_owner, owner == 0, owner == pipeline_size - 1))
            for chunk, chunk_owner in zip(chunks, owners, strict=True):
                if chunk_owner != owner:
                    continue
                for name, param in global_named_parameters(chunk).items():
                    param.copy_(built[name])
            del built
    return True
