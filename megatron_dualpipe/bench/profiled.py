"""``simulate --profile --config``'s work: a profile's costs over a config's split, for
the config's schedule or every schedule of :mod:`.catalog` (ours, Megatron's, torch's),
in ms. Imports the schedule layer only (torch's schedules where torch is installed)."""

from __future__ import annotations

from ..schedules import ScheduleError, simulate, validate
from ..schedules.config_advice import ConfigModel
from ..schedules.profile_config import config_costs
from ..schedules.profile_report import ProfileRow, deepseek_bubble, profile_table
from ..schedules.profile_trace import TraceCosts
from .catalog import SCHEDULES as ENTRIES

__all__ = ["profile_comparison"]


def profile_comparison(
    profile: TraceCosts,
    model: ConfigModel,
    *,
    schedule: str | None,
    microbatches: int | None,
    latency: float,
) -> tuple[list[str], dict]:
    """The lines to print (the heading, the table, DeepSeek's formula where it applies) and
    the figures as JSON, for ``schedule`` (None: the config's; ``"all"``: every one)."""
    setup = model.setup
    pp = setup.pipeline_model_parallel_size
    mbs = microbatches or setup.num_microbatches
    wanted = [schedule or setup.pipeline_schedule] if schedule != "all" else None
    rows = []
    for entry in ENTRIES:
        if wanted is not None and entry.name not in wanted:
            continue
        try:
            built = entry.build(pp, mbs)
            validate(built)
        except ScheduleError as err:
            rows.append(ProfileRow(entry.name, entry.source, note=str(err)))
            continue
        except ModuleNotFoundError as err:  # torch's schedules, where torch is not installed
            rows.append(ProfileRow(entry.name, entry.source, note=f"needs {err.name}"))
            continue
        costs = config_costs(profile, model.shape, setup, built.placement, latency)
        result = simulate(built, costs.cost)
        rows.append(ProfileRow.of(entry.name, entry.source, result, costs))
    if not rows:
        raise ScheduleError(f"{wanted[0]} is not a schedule here: see --schedule's choices")
    lines = [f"{model.source}: PP={pp}, {mbs} micro-batches, the profile's costs in ms"]
    lines.append(profile_table(rows))
    formula = deepseek_bubble(rows, pp)
    if formula:
        lines.append(formula["line"])
    payload = {
        **profile.to_json(),
        "pp": pp,
        "microbatches": mbs,
        "schedules": [r.to_json() for r in rows],
    }
    if formula:
        payload["deepseek_formula"] = {k: v for k, v in formula.items() if k != "line"}
    return lines, payload
