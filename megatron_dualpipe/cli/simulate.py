"""``megatron-dualpipe simulate``: generate, validate and simulate a schedule (or load
one); with ``--config`` the balance advisor, with ``--optimize`` the optimiser, with
``--profile`` a profiler trace's costs. Here the flags are parsed and checked; the work is
the planner's (:mod:`megatron_dualpipe.planner.simulation`, ``.config_advice``,
``.optimize``, ``.profile_trace``, ``.profile_comparison``). Pure Python, as the schedule
layer."""

from __future__ import annotations

import argparse
import math
import os
from functools import partial
from pathlib import Path

from ..planner.profile_trace import TraceCosts
from ..planner.simulation import (
    check_and_simulate,
    checks_fully,
    cost_for,
    generate_at,
    generate_each,
    load_schedule,
    nccl_lines,
    no_cyclic_gc,
    results_table,
    write_outputs,
)
from ..progress import Progress, StatusLine
from ..schedules.cost import CostModel
from ..schedules.ir import Schedule, ScheduleError
from ..schedules.limits import (
    MAX_TIMELINE_SIZE,
    nccl_check_size_problem,
    optimize_size_problem,
    schedule_size,
    size_problem,
)
from ..schedules.nccl_rules import EAGER_LIMIT, STREAMS
from ..schedules.registry import SCHEDULES, spec
from ..schedules.validate import validate
from .common import add_overrides, check_outputs

__all__ = ["add", "run"]

_DEFAULT_COST = "F=1,B=1,W=1"
#: ``simulate --pp`` without --config when not given.
_DEFAULT_PP = 4


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="simulate a pipeline schedule under a cost model",
        description="Generate, validate and simulate a schedule; print its figures. With "
        "--config, the balance advisor: derive each stage's costs from the config's model, "
        "simulate, and propose the layer split with the shortest step within the memory cap.",
    )
    p.add_argument(
        "--schedule",
        default=None,
        choices=[*SCHEDULES, "all"],
        help="the schedule to simulate, or all side by side (default: dualpipev; with "
        "--config, the config's pipeline_schedule)",
    )
    p.add_argument(
        "--pp",
        type=int,
        default=None,
        help="pipeline-parallel ranks (default: 4; with --config, the config's "
        "pipeline_model_parallel_size, changed with --set)",
    )
    p.add_argument(
        "--microbatches", type=int, default=None, help="micro-batches (default: 2 x PP + 2)"
    )
    p.add_argument(
        "--chunks", type=int, default=2, help="stages per rank for interleaved-1f1b (default: 2)"
    )
    p.add_argument(
        "--cost",
        default=_DEFAULT_COST,
        help=f"F, B (dX) and W (dW) times, optionally FB=1.6 or overlap=0.8 for an overlapped "
        f"forward + backward pair (default: {_DEFAULT_COST})",
    )
    p.add_argument(
        "--cost-per",
        choices=["rank", "stage"],
        default=None,
        help="costs are for one rank's share of the model (compare schedules at equal model "
        "size; schedules with more, smaller stages scale them down) or for one stage as given "
        "(default: rank; with --profile: stage, the profile's layer or action)",
    )
    p.add_argument("--latency", type=float, default=0.0, help="time of one P2P hop (default: 0)")
    p.add_argument("--load", type=Path, help="simulate a schedule from a text or JSON file")
    p.add_argument("--grid", action="store_true", help="print a text timeline")
    p.add_argument("--png", type=Path, help="write a PNG timeline")
    p.add_argument("--trace", type=Path, help="write a Chrome/Perfetto trace JSON")
    p.add_argument("--json", type=Path, help="write the figures and the timeline as JSON")
    p.add_argument("--save", type=Path, help="write the generated schedule in text form")
    p.add_argument(
        "--check-nccl",
        action="store_true",
        help="also run the schedule's communication plan under NCCL's ordering rules "
        "(streams in issue order, receives and large sends hold theirs, the step's data- "
        "and expert-parallel collectives on them too) and name any deadlock cycle; see "
        "docs/runtime.md",
    )
    p.add_argument(
        "--streams",
        choices=STREAMS,
        default="shared",
        help="with --check-nccl: every communicator of a rank on one stream (the worst case, "
        "as PyTorch's stream pool allows) or a stream each (default: shared)",
    )
    p.add_argument(
        "--message-mib",
        type=float,
        default=None,
        metavar="MIB",
        help="with --check-nccl: the size of every message (default: unknown, so every send "
        f"waits for its receive; at most {EAGER_LIMIT // 2**20} MiB a send completes eagerly)",
    )
    p.add_argument(
        "--config",
        type=Path,
        help="balance advisor: a training config (e.g. configs/deepseek_v3_pp16.yaml) whose "
        "model, batch sizes and pipeline settings give the per-stage costs; see docs/advisor.md",
    )
    add_overrides(p, "with --config: override a config key (repeatable)")
    p.add_argument(
        "--memory-cap",
        type=float,
        default=None,
        metavar="N",
        help="with --config: the most memory a rank may use, in GiB (parameters, gradients, "
        "optimizer state and saved activations); default: the peak of the config's split. "
        "With --optimize: live activations per rank, a whole number of stages x micro-batches "
        "of the schedule's placement; default: the peak of the best hand-made schedule",
    )
    p.add_argument(
        "--optimize",
        action="store_true",
        help="reorder the schedule's work for these costs: start from the best hand-made "
        "schedule of its placement, search within the memory cap and the time limit, and "
        "print before and after with a proven lower bound (see docs/optimizer.md)",
    )
    p.add_argument(
        "--time-limit",
        type=float,
        default=10.0,
        help="with --optimize: seconds to search (default 10)",
    )
    p.add_argument(
        "--profile",
        type=Path,
        metavar="TRACE",
        help="take the costs from a PyTorch profiler trace (Chrome JSON, plain or .gz): print "
        "per layer the F, B and W compute, the all-to-all of each direction, an F&B pair's "
        "wall time against its parts and the compute streams' busy share, then simulate on "
        "the cost model they give (in ms; with --config, over the config's split); see "
        "docs/BENCHMARKS.md",
    )


def run(args: argparse.Namespace) -> None:
    _check_numbers(args)
    _check_distinct_outputs(args)
    check_outputs({f"--{n}": getattr(args, n) for n in ("png", "trace", "json", "save")})
    profile = _read_profile(args) if args.profile else None
    extra = None if profile is None else profile.to_json()
    if profile is not None and args.config:
        _run_profile_config(args, profile)
        return
    if args.config:
        if args.optimize:
            raise ScheduleError(
                "--optimize does not apply with --config (the advisor chooses the layer split, "
                "the optimiser reorders a schedule's work): drop one"
            )
        _run_advisor(args)
        return
    args.pp = _DEFAULT_PP if args.pp is None else args.pp
    if args.optimize:
        with no_cyclic_gc():
            _run_optimize(args, extra)
        return
    if args.overrides or args.memory_cap is not None:
        raise ScheduleError(
            "--set and --memory-cap apply to the advisor: add --config CONFIG (or, for "
            "--memory-cap, --optimize)"
        )
    args.schedule = args.schedule or "dualpipev"
    if args.check_nccl and not args.load:
        too_large = nccl_check_size_problem(args.pp, _microbatches(args), args.chunks)
        if too_large is not None:
            raise ScheduleError(f"{too_large}: lower --pp or --microbatches")
    timeline = any((args.grid, args.png, args.trace, args.json))
    with no_cyclic_gc(), Progress() as bar:
        if args.load:
            bar.phase(f"reading {args.load}")
            schedules, skipped = [_load(args.load)], {}
        else:
            mbs = _microbatches(args)
            _check_size(args, mbs)
            names = list(SCHEDULES) if args.schedule == "all" else [args.schedule]
            schedules, skipped = generate_each(names, args.pp, mbs, args.chunks, bar)
        results = [
            check_and_simulate(
                s,
                partial(_cost_for, args=args),
                bar,
                checked=checks_fully(s, loaded=bool(args.load)),
                timeline=timeline,
            )
            for s in schedules
        ]
    print(results_table(results, skipped))
    _write_outputs(results, args, extra)
    _save(schedules[0], args)
    if args.check_nccl:
        size = None if args.message_mib is None else int(args.message_mib * 2**20)
        for line in nccl_lines(
            schedules,
            message_bytes=size,
            streams=args.streams,
        ):
            print(line)


def _check_numbers(args: argparse.Namespace) -> None:
    """Refuse, before any work, a number flag that is not finite or out of its range."""
    for flag in ("pp", "microbatches", "chunks"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ScheduleError(f"--{flag} must be a whole number >= 1, got {value}")
    one = args.schedule not in (None, "all") and spec(args.schedule).chunks is None
    if one and args.chunks < 2:
        raise ScheduleError(
            f"{args.schedule} needs --chunks >= 2 (use 1f1b for one chunk), got {args.chunks}"
        )
    ranges = {
        "latency": (0.0, False),
        "time_limit": (0.0, True),
        "memory_cap": (0.0, True),
        "message_mib": (0.0, False),
    }
    for name, (least, strictly) in ranges.items():
        value = getattr(args, name)
        if value is None:
            continue
        if not math.isfinite(value) or value < least or (strictly and value == least):
            bound = f"{'>' if strictly else '>='} {least:g}"
            flag = "--" + name.replace("_", "-")
            raise ScheduleError(f"{flag} must be a finite number {bound}, got {value}")


def _check_distinct_outputs(args: argparse.Namespace) -> None:
    """Refuse, before any work, two output flags naming one file (one would replace the
    other without a word)."""
    given = [(f"--{n}", getattr(args, n)) for n in ("png", "trace", "json", "save")]
    seen: dict[Path, str] = {}
    for flag, path in given:
        if path is None:
            continue
        where = Path(path).resolve()
        if where in seen:
            raise ScheduleError(
                f"{seen[where]} and {flag} both name {path}: one would overwrite the other; "
                "give each its own file"
            )
        seen[where] = flag


def _check_size(args: argparse.Namespace, mbs: int) -> None:
    """Refuse, before any work, what this command cannot simulate in a minute and 2 GB."""
    problem = size_problem(args.pp, mbs, args.chunks, doing="to simulate here")
    if problem is not None:
        raise ScheduleError(f"{problem}: lower --pp or --microbatches")
    wanted = [f"--{name}" for name in ("json", "png", "trace", "grid") if getattr(args, name)]
    if wanted and schedule_size(args.pp, mbs, args.chunks) > MAX_TIMELINE_SIZE:
        raise ScheduleError(
            f"{', '.join(wanted)} keep every action's times, several GB at PP={args.pp} x {mbs} "
            f"micro-batches: drop {'them' if len(wanted) > 1 else 'it'} for the figures alone, "
            f"or keep PP x micro-batches at most {MAX_TIMELINE_SIZE:,}"
        )


def _microbatches(args: argparse.Namespace) -> int:
    """``--microbatches``, by default 2 PP + 2."""
    return args.microbatches if args.microbatches is not None else 2 * args.pp + 2


def _load(path: Path) -> Schedule:
    """``--load``'s schedule, its errors named by the flag."""
    try:
        return load_schedule(path)
    except ScheduleError as err:
        raise ScheduleError(f"--load: {err}") from None


def _cost_for(schedule: Schedule, *, args: argparse.Namespace) -> CostModel:
    """The cost model of ``--cost``, ``--latency`` and ``--cost-per`` for ``schedule``."""
    per = args.cost_per or ("stage" if args.profile else "rank")
    return cost_for(schedule, args.cost, args.latency, per)


def _write_outputs(results: list, args: argparse.Namespace, extra: dict | None) -> None:
    for line in write_outputs(
        results, grid=args.grid, png=args.png, trace=args.trace, json_path=args.json, extra=extra
    ):
        print(line)


def _save(schedule: Schedule, args: argparse.Namespace) -> None:
    if args.save:
        args.save.write_text(schedule.to_text(), encoding="utf-8")
        print(f"wrote {args.save}")


def _read_profile(args: argparse.Namespace) -> TraceCosts:
    """``--profile``: read the trace, print its figures, and make its cost model the
    ``--cost`` of what follows."""
    from ..planner.profile_trace import read_profile

    if args.cost != _DEFAULT_COST:
        raise ScheduleError("--cost and --profile both give the costs: drop one")
    if args.load and args.config:
        raise ScheduleError("--load does not apply with --profile and --config: drop it")
    profile = read_profile(args.profile)
    print(profile.report())
    args.cost = profile.cost_text()
    return profile


def _run_profile_config(args: argparse.Namespace, profile: TraceCosts) -> None:
    """``simulate --profile --config``: the profile's costs over the config's split and
    the advisor's (:func:`megatron_dualpipe.planner.profile_comparison.profile_comparison`)."""
    import json

    from ..planner.config_advice import ConfigModel
    from ..planner.profile_comparison import profile_comparison

    if args.optimize:
        raise ScheduleError(
            "--optimize does not apply with --profile and --config: drop it (or --config, "
            "to optimise on the profile's costs)"
        )
    model = ConfigModel.read(args.config, args.overrides)
    lines, payload = profile_comparison(
        profile,
        model,
        schedule=args.schedule,
        microbatches=args.microbatches,
        latency=args.latency,
        memory_cap_gib=args.memory_cap,
    )
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(payload), encoding="utf-8")
        print(f"wrote {args.json}")


def _run_advisor(args: argparse.Namespace) -> None:
    """``simulate --config``: the balance advisor (pure Python, as the rest of simulate)."""
    from ..planner.config_advice import ConfigModel, advice_text, advise_config, write_advice

    if args.pp is not None:
        raise ScheduleError(
            f"--pp does not apply with --config (the advisor runs the config's "
            f"pipeline_model_parallel_size): drop it, or set --set "
            f"pipeline_model_parallel_size={args.pp}"
        )
    others = {"--load": args.load, "--grid": args.grid, "--trace": args.trace, "--save": args.save}
    given = [flag for flag, value in others.items() if value]
    if given or args.latency or args.cost != _DEFAULT_COST or args.schedule == "all":
        flag = given[0] if given else "--schedule all" if args.schedule == "all" else "--cost"
        raise ScheduleError(
            f"{flag} does not apply with --config (the advisor takes one schedule and derives "
            "its costs from the model): drop it"
        )
    model = ConfigModel.read(args.config, args.overrides)
    settings = model.memory_settings()
    status = StatusLine()
    try:
        advice = advise_config(
            model,
            settings,
            schedule=args.schedule,
            microbatches=args.microbatches,
            memory_cap_gib=args.memory_cap,
            progress=status,
        )
    finally:
        status.clear()
    for text in advice_text(advice, model, settings, os.environ):
        print(text)
    for line in write_advice(advice, png=args.png, json_path=args.json):
        print(line)


def _run_optimize(args: argparse.Namespace, extra: dict | None = None) -> None:
    """``simulate --optimize``: optimise one schedule's placement and report it."""
    from ..planner.optimize.report import against_1f1b, heading  # imports SciPy

    cap = args.memory_cap
    if cap is not None and (cap != int(cap) or cap < 1):
        raise ScheduleError(
            f"with --optimize, --memory-cap is a whole number of activations per rank, got {cap}"
        )
    if args.load:
        base = _load(args.load)
        validate(base, dry_run=False)
    elif args.schedule == "all":
        raise ScheduleError("--optimize takes one schedule: name it with --schedule, not all")
    else:
        too_large = optimize_size_problem(args.pp, _microbatches(args), args.chunks)
        if too_large is not None:
            raise ScheduleError(f"{too_large}: lower --pp or --microbatches")
        try:
            base = generate_at(
                args.schedule or "dualpipev", args.pp, _microbatches(args), args.chunks
            )
        except ScheduleError as err:
            raise ScheduleError(f"{err}: change --microbatches or --pp") from None
    print(heading(base, args.time_limit))
    result, text, figures = against_1f1b(
        base,
        partial(_cost_for, args=args),
        memory_cap=None if cap is None else int(cap),
        time_limit=args.time_limit,
        warm_start=bool(args.load),
        progress=lambda line: print(f"  {line}", flush=True),
        timeline=any((args.grid, args.png, args.trace, args.json)),
    )
    print(text)
    _write_outputs([result.result], args, {**figures, **(extra or {})})
    if args.save:
        args.save.write_text(result.schedule.to_text(), encoding="utf-8")
        print(f"wrote {args.save}")
