"""Contracts of the pipeline executor on CPU+gloo, against a single-process reference.

For every schedule at PP 2 and 4 (dualpipev also at PP 8), at the fewest micro-batches
it accepts and two more (interleaved: PP more), with dW deferral on and off: the losses
and every parameter gradient equal those of the same model run without a pipeline (fp32,
relative error <= 1e-5); the measured peak of live activations equals the simulator's; forward-only
mode returns the reference outputs; DualPipe's two copies are identical after an
optimizer step. The same holds for stages that pass tuples of tensors (a float path, a
float skip connection over one stage, an integer mask; the float path sent non-contiguous).
All cases of one pipeline size run in one launch of forked workers.
"""

from __future__ import annotations

import copy
import functools
import itertools
import json
import weakref
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from megatron_dualpipe.planner.export import to_png, write_chrome_trace
from megatron_dualpipe.runtime import (
    PipelineExecutor,
    TensorSpec,
    gather_timeline,
    make_deferrable,
    sync_mirror_grads,
)
from megatron_dualpipe.schedules.ir import (
    COMM_KINDS,
    Action,
    Kind,
    Placement,
    Schedule,
    ScheduleError,
)
from megatron_dualpipe.schedules.lowering import lower
from megatron_dualpipe.schedules.nccl_rules import inflight_bound
from megatron_dualpipe.schedules.registry import generate, spec
from megatron_dualpipe.schedules.simulate import SimResult, simulate
from tests.multiproc import one_fast, run_workers, slow_unless
from tests.nccl_emulation import on_the_world

pytestmark = pytest.mark.multiproc

SCHEDULES = ("1f1b", "interleaved-1f1b", "zb1p", "dualpipe", "dualpipev")
HIDDEN, IN_FEATURES, BATCH = 8, 6, 3
TIMEOUT_S = 20.0


@dataclass(frozen=True)
class Case:
    schedule: str
    ranks: int
    microbatches: int
    defer: bool = True
    variable: bool = False  # micro-batches of different sequence lengths
    hook: bool = False  # stage modules plan their passes and interleave FB pairs
    tuples: bool = False  # stages take and return tuples (see SkipStage)
    nccl_rules: bool = False  # gloo under NCCL's ordering rules (the emulation)

    def __str__(self) -> str:
        flags = ["defer" if self.defer else "no-defer"]
        flags += ["varlen"] * self.variable + ["hook"] * self.hook + ["tuples"] * self.tuples
        flags += ["nccl-rules"] * self.nccl_rules
        return f"{self.schedule}-pp{self.ranks}-m{self.microbatches}-{'-'.join(flags)}"

    def build(self) -> Schedule:
        return generate(self.schedule, self.ranks, self.microbatches)


def _cases() -> list[Case]:
    cases = []
    for ranks in (2, 4):
        for name in SCHEDULES:
            least = spec(name).min_microbatches(ranks)
            # Interleaved 1F1B takes only multiples of PP: its next size after the least.
            more = least + (ranks if name == "interleaved-1f1b" else 2)
            for microbatches in (least, more):
                cases += [Case(name, ranks, microbatches, defer) for defer in (True, False)]
    cases.append(Case("dualpipev", 8, 16))
    cases += [Case(name, 2, 4, variable=True) for name in ("1f1b", "dualpipe", "dualpipev")]
    cases += [Case(name, 2, 4, hook=True) for name in ("dualpipe", "dualpipev")]
    for ranks in (2, 4):
        for name in ("1f1b", "zb1p", "dualpipe", "dualpipev"):
            cases.append(Case(name, ranks, spec(name).min_microbatches(ranks) + 2, tuples=True))
    cases += [
        Case("zb1p", 2, 4, defer=False, tuples=True),
        Case("dualpipev", 2, 4, variable=True, tuples=True),
    ]
    for ranks in (2, 4):
        for name in ("zb1p", "dualpipe", "dualpipev"):
            least = spec(name).min_microbatches(ranks)
            cases += [Case(name, ranks, m, nccl_rules=True) for m in (least, least + 2)]
    cases += [
        Case("dualpipev", 2, 4, variable=True, tuples=True, nccl_rules=True),
        Case("dualpipe", 2, 4, hook=True, nccl_rules=True),
    ]
    return cases


CASES = _cases()


def _params(cases: list[Case]) -> list:
    """Cases as parameters; those over more than two ranks (one launch per PP for all their
    tests) marked slow: PP2 runs the same schedules fast."""
    return slow_unless(lambda c: c.ranks == 2, cases, ids=str)


# -- the model, its data, the reference ------------------------------------------------
class PlannedSequential(nn.Sequential):
    """A planned stage (the runtime's ``PlannedStage``): each layer runs as an autograd
    island of its own, as Megatron's schedule-plan nodes do, and an FB pair runs layer by
    layer, one backward layer then one forward layer, noted in ``order``."""

    order: list[str] = []

    def plans(self) -> bool:
        return True

    def _forward_layer(self, i: int, h: torch.Tensor, islands: list) -> torch.Tensor:
        inp = h if i == 0 else h.detach().requires_grad_()
        out = self[i](inp)
        islands.append((inp, out))
        return out

    def forward_planned(self, x: torch.Tensor) -> tuple[torch.Tensor, list]:  # one tensor
        islands: list = []
        for i in range(len(self)):
            x = self._forward_layer(i, x, islands)
        return x, islands

    @staticmethod
    def _backward_layer(islands: list, roots: list, grad: torch.Tensor | None):
        """One island's backward: from the loss (``grad`` None) or from its output."""
        inp, out = islands.pop()
        torch.autograd.backward(out if grad is not None else roots[0], grad)
        return inp.grad

    def backward_planned(self, islands: list, roots: list, grads: list | None) -> None:
        grad = None if grads is None else grads[0]
        while islands:
            grad = self._backward_layer(islands, roots, grad)

    def forward_backward_planned(self, args, backward_stage, islands, roots, grads):
        (x,) = args
        grad = None if grads is None else grads[0]
        forward_islands: list = []
        for i in range(max(len(self), len(islands))):
            if islands:
                type(self).order.append(f"B{len(islands) - 1}")
                grad = self._backward_layer(islands, roots, grad)
            if i < len(self):
                type(self).order.append(f"F{i}")
                x = self._forward_layer(i, x, forward_islands)
        return x, forward_islands


def non_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` laid out column-major: not contiguous, and not a view."""
    strides = [1]
    for size in tensor.shape[:-1]:
        strides.append(strides[-1] * size)
    out = torch.empty_strided(tensor.shape, strides, dtype=tensor.dtype)
    return out.copy_(tensor)


class SkipStage(nn.Module):
    """A stage of the tuple model: ``(h, skip, mask) -> (mask * (block(h) + skip), h, mask)``.

    ``skip`` is the previous stage's input, so one float path skips a stage; the integer
    ``mask`` is forwarded unchanged. Stage 0 takes ``(x, mask)`` and projects ``x`` first.
    The float path leaves non-contiguous (it must be made contiguous to be sent).
    """

    def __init__(self, first: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(IN_FEATURES, HIDDEN, bias=False) if first else None
        self.block = nn.Sequential(
            nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN)
        )

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.proj is not None:
            x, mask = args
            h, skip = self.proj(x), 0
        else:
            h, skip, mask = args
        return non_contiguous(mask * (self.block(h) + skip)), h, mask


def build_stages(
    num_model_stages: int, hook: bool = False, tuples: bool = False
) -> list[nn.Module]:
    """Stage 0: a bias-free input projection; every stage: norm, linear, tanh, linear (with
    ``tuples``, a :class:`SkipStage`)."""
    torch.manual_seed(0)
    if tuples:
        return [SkipStage(first=s == 0) for s in range(num_model_stages)]
    kind = PlannedSequential if hook else nn.Sequential
    stages = []
    for s in range(num_model_stages):
        first = nn.Linear(IN_FEATURES, HIDDEN, bias=False) if s == 0 else nn.LayerNorm(HIDDEN)
        stages.append(kind(first, nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN)))
    return stages


def make_data(case: Case) -> tuple[list[Any], list[torch.Tensor]]:
    """Inputs (with ``tuples``, an input and an integer mask) and targets per micro-batch."""
    generator = torch.Generator().manual_seed(1)
    inputs, targets = [], []
    for mb in range(case.microbatches):
        lead = (2 + mb % 3, BATCH) if case.variable else (BATCH,)
        x = torch.randn(*lead, IN_FEATURES, generator=generator)
        if case.tuples:
            x = (x, (torch.rand(*lead, 1, generator=generator) > 0.2).long())
        inputs.append(x)
        targets.append(torch.randn(*lead, HIDDEN, generator=generator))
    return inputs, targets


def loss_fn(case: Case, targets: list[torch.Tensor]):
    """Mean squared error of the output (with ``tuples``: of the float path, plus a term
    on the skip connection, so that both get a gradient at the last stage)."""
    if case.tuples:
        return lambda out, mb: ((out[0] - targets[mb]) ** 2).mean() + (out[1] ** 2).mean() / 2
    return lambda output, mb: ((output - targets[mb]) ** 2).mean()


def stage_specs(case: Case, placement: Placement) -> dict[int, Any]:
    lead = (0, BATCH) if case.variable else (BATCH,)
    hidden = TensorSpec((*lead, HIDDEN))
    spec = (hidden, hidden, TensorSpec((*lead, 1), torch.int64)) if case.tuples else hidden
    return dict.fromkeys(range(placement.num_stages), spec)


@dataclass
class Reference:
    losses: dict[int, torch.Tensor]
    outputs: dict[int, Any]
    grads: dict[int, list[torch.Tensor]]  # per model stage


@functools.cache
def reference(case: Case) -> Reference:
    """The same model on the same data, one micro-batch after another, no pipeline."""
    placement = case.build().placement
    stages = build_stages(placement.num_model_stages, tuples=case.tuples)
    inputs, targets = make_data(case)
    losses, outputs = {}, {}
    for mb, x in enumerate(inputs):
        for stage in stages:
            x = stage(*x) if isinstance(x, tuple) else stage(x)
        outputs[mb] = tuple(t.detach() for t in x) if isinstance(x, tuple) else x.detach()
        loss = loss_fn(case, targets)(x, mb)
        loss.backward()
        losses[mb] = loss.detach()
    grads = {s: [p.grad for p in stage.parameters()] for s, stage in enumerate(stages)}
    return Reference(losses, outputs, grads)


# -- the workers -----------------------------------------------------------------------
@dataclass
class Outcome:
    """What one rank reports for one case."""

    losses: dict[int, torch.Tensor]
    grads: dict[tuple[int, int], list[torch.Tensor]]  # (model stage, chunk) -> grads
    peak: int
    simulated_peak: int
    outputs: dict[int, Any] = field(default_factory=dict)  # forward-only
    stepped: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # chunk -> params
    overlapped: int = 0
    fb_order: list[str] = field(default_factory=list)
    peak_sends: int = 0
    inflight_bound: int = 0


def rank_modules(case: Case, placement: Placement, rank: int) -> list[nn.Module]:
    stages = build_stages(placement.num_model_stages, case.hook, case.tuples)
    modules = []
    for chunk in range(placement.num_chunks):
        module = stages[placement.model_stage(placement.stage_of(rank, chunk))]
        if placement.kind == "mirror" and chunk == 1:
            module = copy.deepcopy(module)  # the second copy, starting from the same weights
        if case.defer:
            make_deferrable(module)
        modules.append(module)
    return modules


def run_case(rank: int, case: Case) -> Outcome:
    schedule = case.build()
    placement = schedule.placement
    modules = rank_modules(case, placement, rank)
    inputs, targets = make_data(case)
    executor = PipelineExecutor(
        schedule,
        rank,
        modules,
        specs=stage_specs(case, placement),
        loss_fn=loss_fn(case, targets),
        defer_weight_grads=case.defer,
        timeout_s=TIMEOUT_S,
        variable_shapes=case.variable,
        transport=on_the_world() if case.nccl_rules else None,
    )
    PlannedSequential.order = []
    result = executor.run(inputs)
    if placement.kind == "mirror":
        sync_mirror_grads(modules, placement, rank, timeout_s=TIMEOUT_S)
    grads = {
        (placement.model_stage(placement.stage_of(rank, c)), c): [p.grad for p in m.parameters()]
        for c, m in enumerate(modules)
    }
    outcome = Outcome(
        result.losses,
        {key: [g.clone() for g in gs] for key, gs in grads.items()},
        result.peak_activations,
        simulate(schedule).ranks[rank].peak_activations,
        overlapped=result.overlapped,
        fb_order=PlannedSequential.order,
        peak_sends=result.peak_sends,
        inflight_bound=inflight_bound(executor.plan())[rank],
    )
    if case.defer and not case.variable:
        outcome.outputs = executor.run(inputs, forward_only=True, return_outputs=True).outputs
    if placement.kind == "mirror":
        torch.optim.SGD([p for m in modules for p in m.parameters()], lr=0.1).step()
        outcome.stepped = {
            c: [p.detach().clone() for p in m.parameters()] for c, m in enumerate(modules)
        }
    return outcome


def run_cases(rank: int, world_size: int, cases: list[Case]) -> dict[Case, Outcome]:
    return {case: run_case(rank, case) for case in cases}


@functools.cache
def launch(ranks: int) -> dict[Case, list[Outcome]]:
    """Run every case of pipeline size ``ranks`` in one launch; outcomes per rank."""
    cases = [case for case in CASES if case.ranks == ranks]
    results = run_workers(run_cases, ranks, args=(cases,), timeout_s=120)
    return {case: [outcomes[case] for outcomes in results] for case in cases}


def outcomes_of(case: Case) -> list[Outcome]:
    return launch(case.ranks)[case]


def relative_error(actual: Any, expected: Any) -> float:
    """The relative error of a tensor, or the largest over a tuple's float elements (its
    other elements must be equal)."""
    if isinstance(expected, tuple):
        assert len(actual) == len(expected)
        pairs = list(zip(actual, expected, strict=True))
        assert all(torch.equal(a, e) for a, e in pairs if not e.is_floating_point())
        return max(relative_error(a, e) for a, e in pairs if e.is_floating_point())
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


# -- the contracts ---------------------------------------------------------------------
@pytest.mark.parametrize("case", _params(CASES))
def test_losses_and_gradients_match_the_single_process_reference(case: Case) -> None:
    ref = reference(case)
    outcomes = outcomes_of(case)
    losses = {mb: loss for o in outcomes for mb, loss in o.losses.items()}
    assert sorted(losses) == list(range(case.microbatches))
    for mb, loss in losses.items():
        assert relative_error(loss, ref.losses[mb]) <= 1e-5, f"loss of micro-batch {mb}"
    seen = set()
    for rank, outcome in enumerate(outcomes):
        for (stage, chunk), grads in outcome.grads.items():
            seen.add(stage)
            for i, (grad, expected) in enumerate(zip(grads, ref.grads[stage], strict=True)):
                error = relative_error(grad, expected)
                assert error <= 1e-5, f"rank {rank} chunk {chunk} parameter {i}: {error:.2e}"
    assert seen == set(ref.grads)


@pytest.mark.parametrize("case", _params([c for c in CASES if c.nccl_rules]))
def test_sends_in_flight_stay_within_the_plans_bound_under_nccl_rules(case: Case) -> None:
    """Sends complete only once received (rendezvous), and each is released as soon as it
    is seen complete: the sent messages held at once never exceed the plan's bound."""
    outcomes = outcomes_of(case)
    for rank, outcome in enumerate(outcomes):
        assert 0 < outcome.peak_sends <= outcome.inflight_bound, f"rank {rank}"


@pytest.mark.parametrize("case", _params(CASES))
def test_measured_peak_activations_equal_the_simulated_ones(case: Case) -> None:
    measured = [o.peak for o in outcomes_of(case)]
    simulated = [o.simulated_peak for o in outcomes_of(case)]
    splits = any(a.kind is Kind.B for acts in case.build().ranks for a in acts for a in a.computes)
    if case.defer or not splits:
        assert measured == simulated
    else:  # without deferral a B frees its activations at once, before the W
        assert all(m <= s for m, s in zip(measured, simulated, strict=True))


@pytest.mark.parametrize("case", _params([c for c in CASES if c.defer and not c.variable]))
def test_forward_only_returns_the_reference_outputs(case: Case) -> None:
    ref = reference(case)
    outputs = {mb: out for o in outcomes_of(case) for mb, out in o.outputs.items()}
    assert sorted(outputs) == list(range(case.microbatches))
    for mb, out in outputs.items():
        assert relative_error(out, ref.outputs[mb]) <= 1e-5


@pytest.mark.parametrize("case", _params([c for c in CASES if c.schedule == "dualpipe"]))
def test_dualpipe_copies_are_identical_after_an_optimizer_step(case: Case) -> None:
    outcomes = outcomes_of(case)
    for rank in range(case.ranks):
        mine, partner = outcomes[rank].stepped[0], outcomes[case.ranks - 1 - rank].stepped[1]
        assert all(torch.equal(a, b) for a, b in zip(mine, partner, strict=True))


@pytest.mark.parametrize("case", _params([c for c in CASES if c.hook]))
def test_planned_stages_interleave_every_fb_action(case: Case) -> None:
    schedule = case.build()
    layers = len(build_stages(1)[0])
    pair = []
    for back, forth in zip(range(layers - 1, -1, -1), range(layers), strict=True):
        pair += [f"B{back}", f"F{forth}"]
    for rank, outcome in enumerate(outcomes_of(case)):
        expected = sum(a.kind is Kind.FB for a in schedule.ranks[rank])
        assert outcome.overlapped == expected > 0
        assert outcome.fb_order == pair * expected


TIMELINE_CASE = Case("dualpipev", 2, 4)


def record_timeline(
    rank: int, world_size: int, trace_dir: str, case: Case, wall_skew_s: float = 0.0
) -> SimResult | None:
    """One recorded step, gathered; rank 0's wall-clock origin read ``wall_skew_s`` late (as
    if it were descheduled between reading its two origins)."""
    schedule = case.build()
    placement = schedule.placement
    inputs, targets = make_data(case)
    executor = PipelineExecutor(
        schedule,
        rank,
        rank_modules(case, placement, rank),
        specs=stage_specs(case, placement),
        loss_fn=loss_fn(case, targets),
        timeout_s=TIMEOUT_S,
    )
    result = executor.run(inputs, record_timeline=True)
    if rank == 0:
        result.timeline.wall_origin += wall_skew_s
    measured = gather_timeline(result.timeline, executor.schedule)
    if measured is not None:  # the planner's exports write it as they write a simulated step
        write_chrome_trace(measured, f"{trace_dir}/measured.json")
        to_png(measured, f"{trace_dir}/measured.png", title="measured", unit="ms")
    return measured


def test_ranks_on_one_host_align_on_the_monotonic_clock_not_the_wall_clock(tmp_path) -> None:
    """Rank 0's wall origin 200 ms off (a rank descheduled between its two reads) moves
    nothing: ranks of one host align on their monotonic origins, so every message is seen
    arriving after it was sent."""
    result, _ = run_workers(
        record_timeline, 2, args=(str(tmp_path), TIMELINE_CASE, 0.2), timeout_s=60
    )
    assert result.messages
    assert all(m.sent <= m.arrived for m in result.messages)
    assert min(m.arrived - m.sent for m in result.messages) < 200


@pytest.mark.parametrize("interleaved", one_fast([False, True], False), ids=["plain", "planned"])
def test_measured_timeline_exports_like_a_simulated_one(tmp_path, interleaved: bool) -> None:
    """What ran is recorded: plain modules run an FB as its forward half, then its backward
    half (two actions); planned stages interleave it (one FB)."""
    case = replace(TIMELINE_CASE, hook=interleaved)
    result, nothing = run_workers(record_timeline, 2, args=(str(tmp_path), case), timeout_s=60)
    assert nothing is None  # only rank 0 gathers
    schedule = lower(case.build())
    simulated = simulate(schedule)
    assert any(a.kind is Kind.FB for a in schedule.ranks[0])
    for rank, stats in enumerate(result.ranks):
        computes = [a for a in schedule.ranks[rank] if a.kind not in COMM_KINDS]
        ran = computes if interleaved else [h for a in computes for h in a.computes]
        assert [t.action for t in stats.actions] == ran
        assert all(0 <= t.start <= t.end for t in stats.actions)
        assert all(a.end <= b.start for a, b in itertools.pairwise(stats.actions))
        assert stats.peak_activations == simulated.ranks[rank].peak_activations
    assert len(result.messages) == len(simulated.messages)
    assert all(m.sent <= m.arrived for m in result.messages)
    assert result.cost.f > 0 and result.makespan > 0
    assert json.loads((tmp_path / "measured.json").read_text())["traceEvents"]
    assert (tmp_path / "measured.png").read_bytes()[:4] == b"\x89PNG"


class Spy(nn.Linear):
    """Keeps every output it returns (which keeps its graph alive) and a weak reference to
    each output's storage, or only a weak reference to every input it gets. With ``tanh``
    it returns tanh of its linear output (tanh's backward reads that result)."""

    def __init__(self, keep_outputs: bool, tanh: bool = False) -> None:
        super().__init__(HIDDEN, HIDDEN)
        self.keep_outputs = keep_outputs
        self.tanh = tanh
        self.outputs: list[torch.Tensor] = []
        self.storages: list[StorageWeakRef] = []
        self.inputs: list[weakref.ref] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.tanh:
            out = out.tanh()
        if self.keep_outputs:
            self.outputs.append(out)
            self.storages.append(StorageWeakRef(out.untyped_storage()))
        else:
            self.inputs.append(weakref.ref(x))
        return out


def spy_on_memory(rank: int, world_size: int) -> dict[bool, list[Any]]:
    """1F1B at PP 2, with free_outputs on and off: rank 0 reports, for each output it sent,
    the bytes it still holds and whether its original storage was released; rank 1, for
    each input it received, whether it is still alive after the step."""
    report = {}
    for free in (True, False):
        spy = Spy(keep_outputs=rank == 0)
        executor = PipelineExecutor(
            generate("1f1b", 2, 3),
            rank,
            [spy],
            specs={1: TensorSpec((BATCH, HIDDEN))},
            loss_fn=lambda out, mb: out.sum(),
            timeout_s=TIMEOUT_S,
            free_outputs=free,
        )
        executor.run([torch.randn(BATCH, HIDDEN) for _ in range(3)])
        if rank == 0:
            report[free] = [
                (out.untyped_storage().nbytes(), ref.expired())
                for out, ref in zip(spy.outputs, spy.storages, strict=True)
            ]
        else:
            report[free] = [ref() is not None for ref in spy.inputs]
    return report


def test_sent_outputs_are_freed_and_received_activations_released() -> None:
    sent, alive = run_workers(spy_on_memory, 2, timeout_s=60)
    # Freed: a one-element stand-in is all that is left, and the storage is gone.
    assert sent[True] == [(4, True)] * 3
    # Not freed: the output keeps its storage (the stage still holds it).
    assert sent[False] == [(BATCH * HIDDEN * 4, False)] * 3
    assert alive == {True: [False] * 3, False: [False] * 3}


def tanh_stages() -> list[Spy]:
    torch.manual_seed(0)
    return [Spy(keep_outputs=True, tanh=True) for _ in range(2)]


def tanh_inputs() -> list[torch.Tensor]:
    return [
        torch.randn(BATCH, HIDDEN, generator=torch.Generator().manual_seed(mb)) for mb in range(3)
    ]


def run_tanh_stages(rank: int, world_size: int) -> tuple[list[torch.Tensor], list[bool]]:
    """1F1B at PP 2 over :func:`tanh_stages`: this rank's gradients, and per output it sent,
    whether its storage was released."""
    stage = tanh_stages()[rank]
    executor = PipelineExecutor(
        generate("1f1b", 2, 3),
        rank,
        [stage],
        specs={1: TensorSpec((BATCH, HIDDEN))},
        loss_fn=lambda out, mb: out.square().sum(),
        timeout_s=TIMEOUT_S,
    )
    executor.run(tanh_inputs())
    released = [ref.expired() for ref in stage.storages] if rank == 0 else []
    return [p.grad for p in stage.parameters()], released


def test_an_output_its_own_backward_reads_is_kept_and_gradients_stay_exact() -> None:
    stages = tanh_stages()
    for x in tanh_inputs():
        stages[1](stages[0](x)).square().sum().backward()
    outcomes = run_workers(run_tanh_stages, 2, timeout_s=60)
    for stage, (grads, _) in zip(stages, outcomes, strict=True):
        for grad, param in zip(grads, stage.parameters(), strict=True):
            assert relative_error(grad, param.grad) <= 1e-6
    assert outcomes[0][1] == [False] * 3  # tanh's backward needs them: not freed


class ViewSpy(nn.Linear):
    """``nn.Linear`` whose output is a view (a slice of the layer's result: ``F.linear`` on a
    3-d input gave a view itself until torch 2.15); at each forward notes whether the
    storage of the previous output (sent by then, its backward not run) still exists."""

    def __init__(self) -> None:
        super().__init__(HIDDEN, HIDDEN)
        self.storages: list[StorageWeakRef] = []
        self.released: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.storages:
            self.released.append(self.storages[-1].expired())
        out = super().forward(x).narrow(0, 0, x.shape[0])
        assert out._base is not None, "the test needs a view output"
        self.storages.append(StorageWeakRef(out.untyped_storage()))
        return out


def send_a_view(rank: int, world_size: int, free: bool) -> tuple[list, list[bool]]:
    """1F1B at PP 2 with stages that return a view: this rank's gradients and, on rank 0,
    whether the first output's storage was gone when the second forward ran."""
    torch.manual_seed(rank)
    stage = ViewSpy()
    executor = PipelineExecutor(
        generate("1f1b", 2, 2),
        rank,
        [stage],
        specs={1: TensorSpec((2, BATCH, HIDDEN))},
        loss_fn=lambda out, mb: out.square().sum(),
        timeout_s=TIMEOUT_S,
        free_outputs=free,
    )
    inputs = [
        torch.randn(2, BATCH, HIDDEN, generator=torch.Generator().manual_seed(m)) for m in (0, 1)
    ]
    executor.run(inputs)
    return [p.grad.clone() for p in stage.parameters()], stage.released if rank == 0 else []


def test_a_view_output_is_sent_viewless_and_freed() -> None:
    freed = run_workers(send_a_view, 2, args=(True,), timeout_s=60)
    kept = run_workers(send_a_view, 2, args=(False,), timeout_s=60)
    for (grads, _), (expected, _) in zip(freed, kept, strict=True):
        assert all(torch.equal(g, e) for g, e in zip(grads, expected, strict=True))
    assert kept[0][1] == [False]  # not freed: the sent output still holds the storage


def test_a_view_less_alias_frees_the_storage_of_a_view() -> None:
    from megatron_dualpipe.runtime.executor import _freed, _viewless

    layer = nn.Linear(HIDDEN, HIDDEN)
    x = torch.randn(2, BATCH, HIDDEN)
    layer(x).square().sum().backward()
    expected = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    view = layer(x).narrow(0, 0, x.shape[0])  # a view (F.linear's 3-d output was one until 2.15)
    assert view._base is not None
    alias = _viewless(view)
    assert alias._base is None and alias.data_ptr() == view.data_ptr()
    storage = StorageWeakRef(view.untyped_storage())
    del view
    alias.square().sum().backward()  # gradients pass through the alias unchanged
    assert all(torch.equal(p.grad, e) for p, e in zip(layer.parameters(), expected, strict=True))
    alias.data = _freed(alias)  # what the executor does once the alias is sent
    assert storage.expired()


# -- configuration errors, before any process-group work ------------------------------
def test_a_schedule_with_an_unmatched_receive_is_rejected_at_construction() -> None:
    schedule = lower(generate("1f1b", 2, 2))
    broken = [a for a in schedule.ranks[0] if a.kind is not Kind.SEND_F or a.microbatch != 1]
    schedule = Schedule(schedule.name, schedule.placement, [broken, schedule.ranks[1]])
    with pytest.raises(ScheduleError, match="SEND_F1"):
        PipelineExecutor(schedule, 1, [nn.Linear(2, 2)], specs={1: TensorSpec((2,))})


class Pair(nn.Linear):
    """Returns its output and the output plus one: two tensors."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = super().forward(x)
        return out, out + 1


def send_against_a_wrong_spec(rank: int, world_size: int, wrong: str) -> str:
    """1F1B at PP 2 whose stage 0 sends what stage 1's spec does not describe."""
    hidden = TensorSpec((BATCH, HIDDEN))
    specs = {"shape": TensorSpec((BATCH, HIDDEN + 1)), "count": (hidden,) * 3}
    executor = PipelineExecutor(
        generate("1f1b", 2, 2),
        rank,
        [Pair(HIDDEN, HIDDEN) if wrong == "count" else nn.Linear(HIDDEN, HIDDEN)],
        specs={1: specs[wrong]},
        loss_fn=lambda out, mb: out.sum(),
        timeout_s=TIMEOUT_S,
    )
    try:
        executor.run([torch.randn(BATCH, HIDDEN)] * 2)
    except Exception as error:  # report it, so that both ranks' outcomes come back
        return f"{type(error).__name__}: {error}"
    return "finished"


@pytest.mark.parametrize(
    ("wrong", "start", "advice"),
    [
        (
            "shape",
            "ValueError: 0SEND_F0 sends a (3, 8) torch.float32 tensor but the TensorSpec",
            "variable_shapes=True",
        ),
        (
            "count",
            "ValueError: 0SEND_F0 sends 2 tensors but the spec of stage 1's input lists 3",
            "give one TensorSpec per tensor the stage returns",
        ),
    ],
)
def test_a_message_that_does_not_match_its_spec_fails_on_the_sender(wrong, start, advice) -> None:
    sender, receiver = run_workers(send_against_a_wrong_spec, 2, args=(wrong,), timeout_s=60)
    assert sender.startswith(start) and advice in sender.splitlines()[0]
    assert receiver.startswith("PipelineWaitError: pipeline rank 1 gave up on 1RECV_F0")


def test_wrong_module_count_or_missing_spec_is_rejected_at_construction() -> None:
    schedule = generate("dualpipev", 2, 4)
    with pytest.raises(ValueError, match="needs 2 stage modules"):
        PipelineExecutor(schedule, 0, [nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="no TensorSpec for the input of stage 3"):
        PipelineExecutor(
            schedule, 0, [nn.Linear(2, 2), nn.Linear(2, 2)], specs={1: TensorSpec((2,))}
        )


def test_w_out_of_b_order_is_refused_before_any_communication() -> None:
    """Deferred weight gradients run first-in first-out per stage: a schedule whose W do not
    follow their stage's B order is refused when the executor is made (no process group
    exists here), not mid-step."""
    ordered = generate("zb1p", 2, 4)
    late = [a for a in ordered.ranks[0] if str(a) != "0W2"] + [Action(Kind.W, 0, 2)]
    swapped = Schedule("swapped", ordered.placement, [late, ordered.ranks[1]])
    specs = {s: TensorSpec((1, 2)) for s in range(2)}
    with pytest.raises(ScheduleError, match=r"^rank 0: 0W3 runs where .* first-in first-out"):
        PipelineExecutor(swapped, 0, [nn.Linear(2, 2)], specs=specs)
