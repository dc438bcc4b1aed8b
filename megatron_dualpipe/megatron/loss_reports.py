"""Per-micro-batch loss reports moved to the last pipeline stage, where Megatron-LM's
training loop averages and logs them (our placements compute losses elsewhere)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

__all__ = ["reports_to_last_stage"]


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
