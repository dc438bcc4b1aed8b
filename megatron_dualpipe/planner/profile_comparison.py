"""``simulate --profile --config``'s work: a profile's costs over a split, for the
config's schedule or every schedule of :mod:`.schedule_catalog` (ours, Megatron's,
torch's), in ms: the split the balance advisor finds for each on the profile's time within
the memory cap (the config's where none is faster; the config's, or the most even, where
none fits). Imports the schedule layer and the planner only (torch's schedules where torch
is installed)."""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import replace

from ..schedules import Placement, Schedule, ScheduleError, simulate, validate
from ..schedules.registry import SCHEDULES as REGISTERED
from ..schedules.registry import spec
from .advisor import StageTiming, advise, config_split_lines, split_changes, yaml_lines
from .config_advice import ConfigModel
from .profile_config import ConfigCosts, config_costs, profile_timing, timed_costs
from .profile_report import ProfileRow, deepseek_bubble, profile_table
from .profile_trace import TraceCosts
from .schedule_catalog import SCHEDULES as ENTRIES

GIB = 2**30

__all__ = ["profile_comparison", "twin_schedule"]


def profile_comparison(
    profile: TraceCosts,
    model: ConfigModel,
    *,
    schedule: str | None,
    microbatches: int | None,
    latency: float,
    memory_cap_gib: float | None = None,
) -> tuple[list[str], dict]:
    """The lines to print (the heading, the table, DeepSeek's formula where it applies) and
    the figures as JSON, for ``schedule`` (None: the config's; ``"all"``: every one); the
    advisor's splits within ``memory_cap_gib`` per rank (default: the config's split's
    peak, or the most even's)."""
    setup = model.setup
    pp = setup.pipeline_model_parallel_size
    mbs = microbatches or setup.num_microbatches
    wanted = [schedule or setup.pipeline_schedule] if schedule != "all" else None
    timing = profile_timing(profile, model.shape, setup)
    cap = None if memory_cap_gib is None else memory_cap_gib * GIB
    rows = []
    for entry in ENTRIES:
        if wanted is not None and entry.name not in wanted:
            continue
        builds = entry.variants or (("", entry.build),)
        found = [
            _row(entry.name, entry.source, build, model, mbs, timing, cap, latency)
            for _, build in builds
        ]
        rows.append(_fastest(found, [label for label, _ in builds]))
    if not rows:
        raise ScheduleError(f"{wanted[0]} is not a schedule here: see --schedule's choices")
    lines = [f"{model.source}: PP={pp}, {mbs} micro-batches, the profile's costs in ms"]
    lines.append(profile_table(rows))
    formula = deepseek_bubble(rows, pp)
    if formula:
        lines.append(formula["line"])
    if wanted is None:
        lines += _plan_lines(rows, model, mbs)
    payload = {
        **profile.to_json(),
        "pp": pp,
        "microbatches": mbs,
        "schedules": [r.to_json() for r in rows],
    }
    if formula:
        payload["deepseek_formula"] = {k: v for k, v in formula.items() if k != "line"}
    return lines, payload


#: The config keys that train a row of the table other than by its name: Megatron's
#: interleaved 1F1B with its all-to-all overlap (its virtual stages follow from the layout).
_TRAINED_AS: dict[str, dict[str, object]] = {
    "interleaved-1f1b-a2a": {"pipeline_schedule": "interleaved-1f1b"},
}
#: What Megatron-Core's ``TransformerConfig`` asserts beside ``overlap_moe_expert_parallel_comm``.
_OVERLAP_NEEDS = (
    "bf16 or fp16, expert_model_parallel_size above 1, the alltoall or flex token "
    "dispatcher, no recompute_method or full recomputation, no moe_shared_expert_overlap, "
    "at most one MTP layer"
)


def _plan_lines(rows: list[ProfileRow], model: ConfigModel, microbatches: int) -> list[str]:
    """The fastest row that trains on Megatron (ours or Megatron's own; torch's do not)
    within the memory cap (faster ones over it are named, never planned) against Megatron's
    interleaved-1f1b-a2a at its fastest, and the config lines and
    Megatron-LM flags that train it as it was timed: the schedule, the split (the config's
    other split keys and virtual stages cleared), the all-to-all overlap the profile's F&B
    pairs had, the micro-batch count."""
    timed = [r for r in rows if r.source != "torch" and r.step is not None]
    trained = [r for r in timed if r.fits]
    if not trained:
        if not timed:
            return []
        return [
            "\nplan: none: no schedule here has a split found within the memory cap (each "
            "row's note says what its leanest needs): raise --memory-cap"
        ]
    best = min(trained, key=lambda r: r.step)
    setup = model.setup
    keys = dict(_TRAINED_AS.get(best.schedule, {"pipeline_schedule": best.schedule}))
    layout = {"pipeline_model_parallel_layout": best.layout}
    keys |= split_changes(layout, config_split_lines(setup))
    if setup.virtual_pipeline_model_parallel_size is not None:
        keys["virtual_pipeline_model_parallel_size"] = None  # the layout says it
    overlapped = best.source == "megatron" or best.overlaps
    if overlapped:
        keys["overlap_moe_expert_parallel_comm"] = True
    if microbatches != setup.num_microbatches:
        per_microbatch = setup.micro_batch_size * setup.data_parallel_size
        keys["global_batch_size"] = microbatches * per_microbatch
    lines = [f"\nplan: {best.schedule} at the {best.split} split trains fastest here"]
    lines[0] += f", {best.step:.1f} ms a step"
    megatron = next((r for r in trained if r.source == "megatron"), None)
    if megatron is not None and megatron is not best:
        lines[0] += (
            f", {megatron.step / best.step:.3f}x as fast as Megatron's {megatron.schedule} at "
            f"its fastest ({megatron.step:.1f} ms)"
        )
    elif megatron is not None:
        lines[0] += ": none of megatron-dualpipe's schedules is ahead of it at these costs"
    over = [r for r in timed if not r.fits and r.step < best.step]
    if over:
        said = ", ".join(f"{r.schedule} ({r.step:.1f} ms)" for r in over)
        lines[0] += f" (faster, but with no split found within the memory cap: {said})"
    lines[0] += f"; to train it, set in {model.source}:"
    lines += [f"  {line}" for line in yaml_lines(keys)]
    flags = [
        f"--{key.replace('_', '-')}" + ("" if value is True else f" {shlex.quote(str(value))}")
        for key, value in keys.items()
        if value not in (None, False) and not (key == "pipeline_schedule" and best.source != "ours")
    ]
    script = (
        "pretrain_gpt.py" if best.source != "ours" else "pretrain_gpt.py with this project's patch"
    )
    lines.append(f"or give Megatron-LM's {script}, in place of its split flags: {' '.join(flags)}")
    if overlapped:
        lines.append(f"overlap_moe_expert_parallel_comm needs {_OVERLAP_NEEDS} (TransformerConfig)")
    return lines


def _row(
    name: str,
    source: str,
    build: Callable[[int, int], Schedule],
    model: ConfigModel,
    microbatches: int,
    timing: StageTiming,
    cap: float | None,
    latency: float,
) -> ProfileRow:
    """The schedule ``build`` makes, simulated at the advisor's split for it (the config's
    where none is faster); a row with only a note where it cannot be built."""
    setup = model.setup
    try:
        built = build(setup.pipeline_model_parallel_size, microbatches)
        validate(built)
    except ScheduleError as err:
        return ProfileRow(name, source, note=str(err))
    except ModuleNotFoundError as err:  # torch's schedules, where torch is not installed
        return ProfileRow(name, source, note=f"needs {err.name}")
    costs = config_costs(timing, model.shape, setup, built.placement, latency)
    advised, note = _advised(model, built, microbatches, timing, cap, latency)
    if advised is not None and advised.stages != costs.stages:
        costs = advised
    result = simulate(built, costs.cost)
    # Without advice under a cap, the config's split is timed but not known to fit it.
    fits = advised is not None or cap is None
    return replace(ProfileRow.of(name, source, result, costs), note=note, fits=fits)


def _fastest(rows: list[ProfileRow], labels: list[str]) -> ProfileRow:
    """The fastest of a schedule's builds (``labels``: each one's), noting which it is and
    what the others took, where there are others."""
    timed = [(r.step, i) for i, r in enumerate(rows) if r.step is not None]
    if len(rows) == 1 or not timed:
        return rows[0]
    best = min(timed)[1]
    others = ", ".join(
        f"{labels[i]} {r.step:.1f} ms" if r.step is not None else f"{labels[i]} ({r.note})"
        for i, r in enumerate(rows)
        if i != best
    )
    note = f"{labels[best]}, the fastest (also tried: {others})"
    return replace(rows[best], note="; ".join(filter(None, (note, rows[best].note))))


def twin_schedule(placement: Placement) -> str | None:
    """The registered schedule that places stages as ``placement`` does (its kind, and its
    stages per rank), whatever micro-batch counts that one accepts."""
    chunks = placement.num_stages // placement.num_ranks
    for name in REGISTERED:
        found = spec(name)
        fixed = found.chunks == chunks if found.chunks is not None else chunks > 1
        if found.placement == placement.kind and fixed:
            return name
    return None


def _advised(
    model: ConfigModel,
    built: Schedule,
    microbatches: int,
    timing: StageTiming,
    cap: float | None,
    latency: float,
) -> tuple[ConfigCosts | None, str]:
    """``built`` timed at the advisor's split for it on ``timing`` within ``cap`` (the
    config's where no split is faster); None, with why, where its placement has no
    registered twin or no split fits."""
    twin = twin_schedule(built.placement)
    if twin is None:
        return None, "no schedule of ours places stages as it does: not advised"
    try:
        advice = advise(
            model.shape,
            model.setup,
            schedule=twin,
            microbatches=microbatches,
            memory_cap=cap,
            settings=model.memory_settings(),
            timing=timing,
            built=built,
        )
    except ScheduleError as err:
        return None, f"the advisor found no split for it: {err}"
    stages = advice.after.stages
    return timed_costs(timing, model.shape, model.setup, stages, "advised", latency), ""
