"""Large schedules: the linear-time checks agree with the reference checks, the figures-only
simulation agrees with the full one, and ``simulate`` refuses sizes it cannot do, in one
sentence, before any work; long runs draw a progress line on terminals only.

Speed and memory at PP=1000 are measured by bench/simulate_scale.py (docs/schedules.md).
"""

from __future__ import annotations

import io
import random
import time
from array import array
from collections import defaultdict

import pytest

from megatron_dualpipe.cli import main
from megatron_dualpipe.progress import Progress
from megatron_dualpipe.schedules.ir import Action, Kind, Schedule, ScheduleError
from megatron_dualpipe.schedules.registry import SCHEDULES, generate, spec
from megatron_dualpipe.schedules.simulate import simulate
from megatron_dualpipe.schedules.validate import (
    _check_complete,
    _check_order,
    _check_placement,
    _rank_is_sound,
    check,
)


def _reference_accepts(rank: int, actions: list[Action], schedule: Schedule) -> bool:
    p = schedule.placement
    alone = Schedule("x", p, [actions if r == rank else [] for r in range(p.num_ranks)])
    try:
        _check_placement(alone)
        _check_complete(rank, _check_order(rank, actions, p), p)
    except ScheduleError:
        return False
    return True


def _edit(rng: random.Random, actions: list[Action], num_stages: int, mbs: int) -> None:
    """One random edit of the kind a hand-written or buggy schedule has."""
    i = rng.randrange(len(actions))
    a = actions[i]
    edit = rng.choice(["swap", "neighbours", "drop", "twice", "microbatch", "chunk", "stage"])
    if edit == "swap":
        j = rng.randrange(len(actions))
        actions[i], actions[j] = actions[j], a
    elif edit == "neighbours" and i + 1 < len(actions):
        actions[i], actions[i + 1] = actions[i + 1], a
    elif edit == "drop":
        actions.pop(i)
    elif edit == "twice":
        actions.insert(rng.randrange(len(actions)), a)
    elif a.sub:
        f, b = a.sub
        actions[i : i + 1] = [b, f]  # an FB split, in the wrong order
    elif edit == "microbatch":
        actions[i] = a._replace(microbatch=rng.choice([a.microbatch + 1, -1, mbs]))
    elif edit == "chunk":
        actions[i] = a._replace(chunk=1 - a.chunk)
    else:
        actions[i] = a._replace(stage=rng.randrange(num_stages))


def test_the_linear_checks_accept_exactly_what_the_reference_checks_accept() -> None:
    rng = random.Random(12)
    trials = 0
    for name in SCHEDULES:
        for ranks in (2, 3, 4):
            for extra in (0, 1, ranks):
                try:
                    schedule = generate(name, ranks, spec(name).min_microbatches(ranks) + extra)
                except ScheduleError:
                    continue
                p = schedule.placement
                for _ in range(40):
                    rank = rng.randrange(ranks)
                    actions = list(schedule.ranks[rank])
                    if rng.random() < 0.9:
                        _edit(rng, actions, p.num_stages, p.num_microbatches)
                    channels = defaultdict(lambda: array("q")), defaultdict(lambda: array("q"))
                    fast = _rank_is_sound(rank, actions, p, *channels)
                    assert fast == _reference_accepts(rank, actions, schedule), (name, actions)
                    trials += 1
    assert trials > 1000


def test_a_compute_only_schedule_whose_ranks_disagree_on_message_order() -> None:
    """Rank 1 runs micro-batch 1 before 0: locally fine, but rank 0 sends 0 first."""
    schedule = generate("1f1b", 2, 4)
    ranks = [list(acts) for acts in schedule.ranks]
    assert ranks[1][:4] == [Action(Kind.F, 1, 0), Action(Kind.BW, 1, 0),
                            Action(Kind.F, 1, 1), Action(Kind.BW, 1, 1)]  # fmt: skip
    ranks[1][:4] = ranks[1][2:4] + ranks[1][:2]
    with pytest.raises(
        ScheduleError,
        match=r"^rank 0 -> rank 1 \(F\): message 0 is sent for "
        r"1RECV_F0 but received as 1RECV_F1: the two ranks must agree",
    ):
        check(Schedule("swapped", schedule.placement, ranks))  # fmt: skip


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_figures_only_simulation_gives_the_same_figures(name: str) -> None:
    schedule = generate(name, 4, 16)
    full, figures = simulate(schedule), simulate(schedule, timeline=False)
    assert figures.makespan == full.makespan
    assert [(r.busy, r.peak_activations) for r in figures.ranks] == [
        (r.busy, r.peak_activations) for r in full.ranks
    ]
    assert figures.messages == [] and all(r.actions == [] for r in figures.ranks)


@pytest.mark.slow
def test_progress_is_reported_in_actions() -> None:
    schedule = generate("dualpipev", 64, 1600)  # about 400,000 actions
    seen: list[int] = []
    simulate(schedule, timeline=False, progress=seen.append)
    total = sum(map(len, schedule.ranks))
    assert seen and seen == sorted(seen) and seen[-1] <= total


def test_sizes_beyond_a_minute_are_refused_before_any_work(capsys) -> None:
    started = time.monotonic()
    assert main(["simulate", "--pp", "2000", "--microbatches", "4000"]) == 2
    assert time.monotonic() - started < 10.0  # the work: over a minute
    assert capsys.readouterr().err == (
        "megatron-dualpipe: error: PP=2000 x 4000 micro-batches is too large to simulate "
        "here: PP x micro-batches must be at most 2,000,000 (PP=1000 x 2000 takes about a "
        "minute and 1.5 GB): lower --pp or --microbatches\n"
    )


def test_timelines_of_large_schedules_are_refused_before_any_work(capsys) -> None:
    assert main(["simulate", "--pp", "600", "--microbatches", "1200", "--json", "x.json"]) == 2
    assert capsys.readouterr().err == (
        "megatron-dualpipe: error: --json keep every action's times, several GB at PP=600 x "
        "1200 micro-batches: drop it for the figures alone, or keep PP x micro-batches at most "
        "250,000\n"
    )


class _Terminal(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_the_progress_line_shows_on_terminals_only_after_the_delay(monkeypatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    for tty in (True, False):
        stream = _Terminal(tty)
        with Progress(stream, delay_s=0.05, every_s=0.01) as bar:
            bar.phase("simulating dualpipev", total=200)
            bar.done = 50
            time.sleep(0.3)
        drawn = stream.getvalue()
        if tty:
            assert "]  25% simulating dualpipev (0 s)" in drawn
            assert drawn.endswith("\r\x1b[K")  # erased at the end
        else:
            assert drawn == ""
    quick = _Terminal(True)
    with Progress(quick, delay_s=5.0):
        pass
    assert quick.getvalue() == ""  # nothing for work shorter than the delay
    monkeypatch.setenv("CI", "1")
    assert not Progress(_Terminal(True)).enabled
