"""A cost model from a measured step: per model stage, the mean measured F, B (dX) and W
(dW) times, the F&B overlap factor of the measured FB pairs and a given P2P latency, in
the simulator's :class:`~..cost.CostModel` (what :func:`~.optimizer.optimize` takes)."""

from __future__ import annotations

import statistics
from collections import defaultdict

from ...schedules.cost import CostModel
from ...schedules.ir import Kind, ScheduleError
from ...schedules.simulate import SimResult

__all__ = ["measured_costs"]

_PARTS = {Kind.F: (0,), Kind.B: (1,), Kind.W: (2,), Kind.BW: (1, 2)}


def measured_costs(measured: SimResult, latency: float = 0.0) -> CostModel:
    """Per model stage ``(f, b, w)``: the means of its measured F, B and W (a BW counts
    as B where no B of that stage was measured); a part no action of a stage measured
    takes the mean of the stages that measured it. The overlap factor is the mean ratio
    of each FB pair's time to the sum of its halves' stage means (1 without pairs).
    Raises ScheduleError where no compute action was measured."""
    placement = measured.schedule.placement
    stages = placement.num_model_stages
    samples: dict[tuple[int, int], list[float]] = defaultdict(list)  # (stage, part) -> times
    backward_whole: dict[int, list[float]] = defaultdict(list)
    pairs = []
    for rank in measured.ranks:
        for timed in rank.actions:
            action, took = timed.action, timed.end - timed.start
            stage = placement.model_stage(action.stage)
            if action.kind is Kind.FB:
                pairs.append((action, took))
            elif action.kind is Kind.BW:
                backward_whole[stage].append(took)
            elif action.kind in _PARTS:
                samples[(stage, _PARTS[action.kind][0])].append(took)
    for stage, times in backward_whole.items():
        if not samples.get((stage, 1)):
            samples[(stage, 1)] = times
    if not any(samples.values()):
        raise ScheduleError(f"the measured step of {measured.schedule.name} has no timed action")
    means = {key: statistics.fmean(times) for key, times in samples.items() if times}
    fill = {
        part: statistics.fmean([v for (_, p), v in means.items() if p == part] or [0.0])
        for part in range(3)
    }
    costs = tuple(
        tuple(means.get((stage, part), fill[part]) for part in range(3)) for stage in range(stages)
    )
    ratios = []
    for action, took in pairs:
        halves = sum(
            costs[placement.model_stage(h.stage)][i] for h in action.sub for i in _PARTS[h.kind]
        )
        if halves > 0:
            ratios.append(took / halves)
    overlap = statistics.fmean(ratios) if ratios else 1.0
    return CostModel(overlap=overlap, latency=latency, stage_costs=costs)
