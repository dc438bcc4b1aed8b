"""``simulate``'s work, without its flags: the schedules to run, each checked and simulated
on its cost model, the table, the files written, the NCCL check. Pure Python.

Progress goes to ``bar``, anything with ``phase(label, total=0)`` and a ``done``
attribute (the command's :class:`megatron_dualpipe.progress.Progress`).
"""

from __future__ import annotations

import contextlib
import gc
import json
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Protocol

from ..schedules.comm_plan import comm_plan
from ..schedules.cost import CostModel
from ..schedules.ir import Schedule, ScheduleError
from ..schedules.limits import MAX_TIMELINE_SIZE
from ..schedules.nccl_rules import CommDeadlockError, check_nccl
from ..schedules.registry import generate, spec
from ..schedules.simulate import SimResult, simulate
from ..schedules.validate import check
from .bound import step_bound

__all__ = [
    "check_and_simulate",
    "cost_for",
    "generate_at",
    "generate_each",
    "load_schedule",
    "nccl_lines",
    "no_cyclic_gc",
    "results_table",
    "suffixed",
    "write_outputs",
]


class Bar(Protocol):
    done: int

    def phase(self, label: str, total: int = 0) -> None: ...


def generate_at(name: str, pp: int, mbs: int, chunks: int) -> Schedule:
    """Schedule ``name`` at ``pp`` ranks and ``mbs`` micro-batches (``chunks`` where the
    schedule's chunk count is not fixed)."""
    options = {"chunks": chunks} if spec(name).chunks is None else {}
    return generate(name, pp, mbs, **options)


def generate_each(
    names: Sequence[str], pp: int, mbs: int, chunks: int, bar: Bar
) -> tuple[list[Schedule], dict[str, str]]:
    """The schedules ``names``, and why any of them do not apply (one name alone: its
    error, naming ``--microbatches`` and ``--pp``)."""
    schedules, skipped = [], {}
    for name in names:
        bar.phase(f"generating {name} for PP={pp} x {mbs} micro-batches")
        try:
            schedules.append(generate_at(name, pp, mbs, chunks))
        except ScheduleError as err:
            if len(names) == 1:
                raise ScheduleError(f"{err}: change --microbatches or --pp") from None
            skipped[name] = str(err)
    return schedules, skipped


def load_schedule(path: Path) -> Schedule:
    """The schedule in ``path`` (text form, or JSON for ``.json``); one sentence for a file
    that cannot be read or holds no schedule."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ScheduleError(f"cannot read {path} ({err.strerror or err})") from None
    except UnicodeDecodeError:
        raise ScheduleError(
            f"{path} is not a schedule (not UTF-8 text): write one with simulate --save"
        ) from None
    if path.suffix != ".json":
        try:
            return Schedule.from_text(text)
        except ScheduleError as err:
            raise ScheduleError(
                f"{path} is not a schedule ({err}): write one with simulate --save"
            ) from None
    try:
        return Schedule.from_json(json.loads(text))
    except json.JSONDecodeError as err:
        raise ScheduleError(
            f"{path} is not JSON (line {err.lineno}, column {err.colno}: {err.msg})"
        ) from None
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise ScheduleError(
            f"{path} holds JSON but not a schedule ({type(err).__name__}: {err}): "
            "write one with simulate --json"
        ) from None


def cost_for(schedule: Schedule, text: str, latency: float, per: str) -> CostModel:
    """The cost model ``text`` with P2P ``latency`` for ``schedule``'s stages: as given
    (``per="stage"``) or one rank's share of the model (``per="rank"``)."""
    cost = CostModel.parse(text, latency=latency)
    if per == "rank":
        p = schedule.placement
        cost = cost.per_stage(p.num_ranks, p.num_model_stages)
    return cost


def check_and_simulate(
    schedule: Schedule,
    cost_of: Callable[[Schedule], CostModel],
    bar: Bar,
    *,
    checked: bool,
    timeline: bool,
) -> SimResult:
    """``schedule`` checked (where ``checked``; the simulation is its dry run) and
    simulated on the cost model ``cost_of`` gives it, keeping every action's times where
    ``timeline``."""
    if checked:
        bar.phase(f"checking {schedule.name}", total=schedule.num_ranks)
        check(schedule, dry_run=False, progress=partial(setattr, bar, "done"))
    bar.phase(f"simulating {schedule.name}", total=sum(map(len, schedule.ranks)))
    progress = partial(setattr, bar, "done")
    return simulate(schedule, cost_of(schedule), timeline=timeline, progress=progress)


def checks_fully(schedule: Schedule, loaded: bool) -> bool:
    """Whether ``simulate`` runs the full check first: a loaded schedule always, a
    generated one up to :data:`MAX_TIMELINE_SIZE` ranks x micro-batches."""
    return loaded or schedule.num_ranks * schedule.num_microbatches <= MAX_TIMELINE_SIZE


@contextlib.contextmanager
def no_cyclic_gc() -> Iterator[None]:
    """Schedules are millions of acyclic tuples: the cyclic collector would walk them over
    and over (twice the time at PP=1000) and find nothing."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def results_table(results: list[SimResult], skipped: dict[str, str]) -> str:
    """One schedule's per-rank table, or several side by side (with why any skipped)."""
    from .report import comparison_table, rank_table

    if len(results) == 1:
        return rank_table(results[0])
    return comparison_table(results, skipped)


def suffixed(path: Path, name: str, many: bool) -> Path:
    """``path`` with ``_name`` before its suffix where there are ``many`` files to write."""
    return path.with_name(f"{path.stem}_{name}{path.suffix}") if many else path


def write_outputs(
    results: list[SimResult],
    *,
    grid: bool = False,
    png: Path | None = None,
    trace: Path | None = None,
    json_path: Path | None = None,
    extra: dict | None = None,
) -> Iterator[str]:
    """Write the files asked for, one per schedule where there are several (``extra``:
    more figures for the JSON; each schedule's carries its compute bound), yielding each
    line to print as it goes: the text grid, or ``wrote PATH``."""
    from .export import to_grid, to_png, write_chrome_trace

    many = len(results) > 1
    for r in results:
        name = r.schedule.name
        if grid:
            yield to_grid(r)
        if png:
            to_png(r, str(suffixed(png, name, many)))
            yield f"wrote {suffixed(png, name, many)}"
        if trace:
            write_chrome_trace(r, str(suffixed(trace, name, many)))
            yield f"wrote {suffixed(trace, name, many)}"
    if json_path:
        payload = [{**r.to_json(), "bound": step_bound(r).to_json()} for r in results]
        if extra and many:
            payload = {**extra, "schedules": payload}
        elif extra:
            payload[0].update(extra)
        json_path.write_text(json.dumps(payload if many else payload[0]), encoding="utf-8")
        yield f"wrote {json_path}"


def nccl_lines(
    schedules: list[Schedule],
    *,
    message_bytes: int | None,
    streams: str,
) -> Iterator[str]:
    """Each schedule's communication plan under NCCL's rules, a line each as it is checked;
    then a :class:`ScheduleError` naming those that would deadlock."""
    from .report import nccl_line

    failed = []
    for schedule in schedules:
        plan = comm_plan(schedule, message_bytes=message_bytes)
        try:
            outcome = check_nccl(plan, streams=streams)
        except CommDeadlockError as err:
            outcome = err
            failed.append(schedule.name)
        yield nccl_line(schedule.name, plan, message_bytes, streams, outcome)
    if failed:
        raise ScheduleError(
            f"{', '.join(failed)} would deadlock on NCCL with {streams} streams: see the "
            "cycle above"
        )
