"""Loss reports where Megatron-LM's training loop expects them, though our placements
compute losses elsewhere: per-micro-batch reports moved to the last pipeline stage, and the
MTP losses of Megatron's tracker reduced over the pipeline (under dualpipe two ranks hold
an MTP block each, for half of the micro-batches)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

from ..compat.version import clean_mtp_tracker, mtp_tracker_fields, save_mtp_metrics

__all__ = ["mtp_losses_to_last_stage", "reports_to_last_stage"]


def reports_to_last_stage(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every pipeline rank's ``reports``, gathered on the last pipeline stage in rank order
    (the others get []); collective over the pipeline group. Tensors travel on the CPU and
    land on this rank's device."""
    group = parallel_state.get_pipeline_model_parallel_group()
    mine = [
        {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in report.items()}
        for report in reports
    ]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return []
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return [
        {k: v.to(device) if torch.is_tensor(v) else v for k, v in report.items()}
        for part in gathered
        for report in part
    ]


def _pipeline_mtp_sum(num_mtp_layers: int) -> torch.Tensor:
    """Megatron's MTP tracker on this rank (zeros without an MTP block), summed over the
    pipeline group: one row per tracker entry (:func:`~.version.mtp_tracker_fields`, the
    loss first), one column per MTP layer; the tracker is cleared. Collective over the
    pipeline group."""
    tracker = MTPLossLoggingHelper.tracker
    fields = mtp_tracker_fields()
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    total = torch.zeros(len(fields), num_mtp_layers, dtype=torch.float64, device=device)
    if tracker.get(fields[0]) is not None:
        for row, field in enumerate(fields):
            if tracker.get(field) is not None:
                total[row] += tracker[field].to(total)
        clean_mtp_tracker()
    dist.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
    return total


def mtp_losses_to_last_stage(num_mtp_layers: int) -> None:
    """Move Megatron's MTP tracker to the last pipeline stage, where Megatron-LM's
    ``training_log`` reports it: the pipeline's sums there (with the data-parallel group to
    average over, as ``GPTModel`` records them), empty elsewhere. Collective over the
    pipeline group."""
    total = _pipeline_mtp_sum(num_mtp_layers)
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return
    data_parallel = parallel_state.get_data_parallel_group(with_context_parallel=True)
    for layer in range(num_mtp_layers):
        save_mtp_metrics(list(total[:, layer].float()), layer, num_mtp_layers, data_parallel)
