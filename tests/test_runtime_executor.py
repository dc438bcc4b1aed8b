"""Contracts of the pipeline executor on CPU+gloo, against a single-process reference.

For every schedule at PP 2 and 4 (dualpipev also at PP 8), at the fewest micro-batches
it accepts and two more (interleaved: PP more), with dW deferral on and off: the losses
and every parameter gradient equal those of the same model run without a pipeline (fp32,
relative error <= 1e-5); the measured peak of live activations equals the simulator's; forward-only
mode returns the reference outputs; DualPipe's two copies are identical after an
optimizer step. All cases of one pipeline size run in one launch of forked workers.
"""

from __future__ import annotations

import copy
import functools
import itertools
import json
import weakref
from dataclasses import dataclass, field

import pytest
import torch
from torch import nn

from megatron_dualpipe.runtime import (
    PipelineExecutor,
    TensorSpec,
    gather_timeline,
    make_deferrable,
    sync_mirror_grads,
)
from megatron_dualpipe.schedules.ir import COMM_KINDS, Kind, Placement, Schedule, ScheduleError
from megatron_dualpipe.schedules.lowering import lower
from megatron_dualpipe.schedules.registry import generate, spec
from megatron_dualpipe.schedules.simulate import SimResult, simulate
from tests.multiproc import run_workers


def _warm_up() -> None:
    """Pay lazy imports once, before the workers fork, not once per worker: the first
    backward from a non-scalar output imports torch.fx (~1 s), the first optimizer step
    torch._dynamo (~2 s)."""
    param = nn.Parameter(torch.ones(2))
    torch.autograd.backward(param * 2, torch.ones(2))
    torch.optim.SGD([param], lr=0.1).step()


_warm_up()

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

    def __str__(self) -> str:
        flags = ["defer" if self.defer else "no-defer"]
        flags += ["varlen"] * self.variable + ["hook"] * self.hook
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
    return cases


CASES = _cases()


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

    def forward_planned(self, x: torch.Tensor) -> tuple[torch.Tensor, list]:
        islands: list = []
        for i in range(len(self)):
            x = self._forward_layer(i, x, islands)
        return x, islands

    @staticmethod
    def _backward_layer(islands: list, root: torch.Tensor, grad: torch.Tensor | None):
        inp, out = islands.pop()
        torch.autograd.backward(out if grad is not None else root, grad)
        return inp.grad

    def backward_planned(self, islands: list, root: torch.Tensor, grad) -> None:
        while islands:
            grad = self._backward_layer(islands, root, grad)

    def forward_backward_planned(self, x, backward_stage, islands, root, grad):
        forward_islands: list = []
        for i in range(max(len(self), len(islands))):
            if islands:
                type(self).order.append(f"B{len(islands) - 1}")
                grad = self._backward_layer(islands, root, grad)
            if i < len(self):
                type(self).order.append(f"F{i}")
                x = self._forward_layer(i, x, forward_islands)
        return x, forward_islands


def build_stages(num_model_stages: int, hook: bool = False) -> list[nn.Sequential]:
    """Stage 0: a bias-free input projection; every stage: norm, linear, tanh, linear."""
    torch.manual_seed(0)
    kind = PlannedSequential if hook else nn.Sequential
    stages = []
    for s in range(num_model_stages):
        first = nn.Linear(IN_FEATURES, HIDDEN, bias=False) if s == 0 else nn.LayerNorm(HIDDEN)
        stages.append(kind(first, nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN)))
    return stages


def make_data(case: Case) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    inputs, targets = [], []
    for mb in range(case.microbatches):
        lead = (2 + mb % 3, BATCH) if case.variable else (BATCH,)
        inputs.append(torch.randn(*lead, IN_FEATURES, generator=generator))
        targets.append(torch.randn(*lead, HIDDEN, generator=generator))
    return inputs, targets


def mse(targets: list[torch.Tensor]):
    return lambda output, mb: ((output - targets[mb]) ** 2).mean()


@dataclass
class Reference:
    losses: dict[int, torch.Tensor]
    outputs: dict[int, torch.Tensor]
    grads: dict[int, list[torch.Tensor]]  # per model stage


@functools.cache
def reference(case: Case) -> Reference:
    """The same model on the same data, one micro-batch after another, no pipeline."""
    placement = case.build().placement
    stages = build_stages(placement.num_model_stages)
    inputs, targets = make_data(case)
    losses, outputs = {}, {}
    for mb, x in enumerate(inputs):
        for stage in stages:
            x = stage(x)
        outputs[mb] = x.detach()
        loss = mse(targets)(x, mb)
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
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)  # forward-only
    stepped: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # chunk -> params
    overlapped: int = 0
    fb_order: list[str] = field(default_factory=list)


def rank_modules(case: Case, placement: Placement, rank: int) -> list[nn.Module]:
    stages = build_stages(placement.num_model_stages, case.hook)
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
    shape = (0, BATCH, HIDDEN) if case.variable else (BATCH, HIDDEN)
    executor = PipelineExecutor(
        schedule,
        rank,
        modules,
        specs={s: TensorSpec(shape) for s in range(placement.num_stages)},
        loss_fn=mse(targets),
        defer_weight_grads=case.defer,
        timeout_s=TIMEOUT_S,
        variable_shapes=case.variable,
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


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


# -- the contracts ---------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=str)
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


@pytest.mark.parametrize("case", CASES, ids=str)
def test_measured_peak_activations_equal_the_simulated_ones(case: Case) -> None:
    measured = [o.peak for o in outcomes_of(case)]
    simulated = [o.simulated_peak for o in outcomes_of(case)]
    splits = any(a.kind is Kind.B for acts in case.build().ranks for a in acts for a in a.computes)
    if case.defer or not splits:
        assert measured == simulated
    else:  # without deferral a B frees its activations at once, before the W
        assert all(m <= s for m, s in zip(measured, simulated, strict=True))


@pytest.mark.parametrize("case", [c for c in CASES if c.defer and not c.variable], ids=str)
def test_forward_only_returns_the_reference_outputs(case: Case) -> None:
    ref = reference(case)
    outputs = {mb: out for o in outcomes_of(case) for mb, out in o.outputs.items()}
    assert sorted(outputs) == list(range(case.microbatches))
    for mb, out in outputs.items():
        assert relative_error(out, ref.outputs[mb]) <= 1e-5


@pytest.mark.parametrize("case", [c for c in CASES if c.schedule == "dualpipe"], ids=str)
def test_dualpipe_copies_are_identical_after_an_optimizer_step(case: Case) -> None:
    outcomes = outcomes_of(case)
    for rank in range(case.ranks):
        mine, partner = outcomes[rank].stepped[0], outcomes[case.ranks - 1 - rank].stepped[1]
        assert all(torch.equal(a, b) for a, b in zip(mine, partner, strict=True))


@pytest.mark.parametrize("case", [c for c in CASES if c.hook], ids=str)
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


def record_timeline(rank: int, world_size: int, trace_dir: str) -> SimResult | None:
    schedule = TIMELINE_CASE.build()
    placement = schedule.placement
    inputs, targets = make_data(TIMELINE_CASE)
    executor = PipelineExecutor(
        schedule,
        rank,
        rank_modules(TIMELINE_CASE, placement, rank),
        specs={s: TensorSpec((BATCH, HIDDEN)) for s in range(placement.num_stages)},
        loss_fn=mse(targets),
        timeout_s=TIMEOUT_S,
    )
    result = executor.run(inputs, record_timeline=True)
    return gather_timeline(
        result.timeline,
        executor.schedule,
        trace_path=f"{trace_dir}/measured.json",
        png_path=f"{trace_dir}/measured.png",
    )


def test_measured_timeline_exports_like_a_simulated_one(tmp_path) -> None:
    result, nothing = run_workers(record_timeline, 2, args=(str(tmp_path),), timeout_s=60)
    assert nothing is None  # only rank 0 gathers
    schedule = lower(TIMELINE_CASE.build())
    simulated = simulate(schedule)
    for rank, stats in enumerate(result.ranks):
        computes = [a for a in schedule.ranks[rank] if a.kind not in COMM_KINDS]
        assert [t.action for t in stats.actions] == computes
        assert all(0 <= t.start <= t.end for t in stats.actions)
        assert all(a.end <= b.start for a, b in itertools.pairwise(stats.actions))
        assert stats.peak_activations == simulated.ranks[rank].peak_activations
    assert len(result.messages) == len(simulated.messages)
    assert all(m.sent <= m.arrived for m in result.messages)
    assert result.cost.f > 0 and result.makespan > 0
    assert json.loads((tmp_path / "measured.json").read_text())["traceEvents"]
    assert (tmp_path / "measured.png").read_bytes()[:4] == b"\x89PNG"


class Spy(nn.Linear):
    """Keeps every output it returns (which keeps its graph alive) or only a weak
    reference to every input it gets."""

    def __init__(self, keep_outputs: bool) -> None:
        super().__init__(HIDDEN, HIDDEN)
        self.keep_outputs = keep_outputs
        self.outputs: list[torch.Tensor] = []
        self.inputs: list[weakref.ref] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.keep_outputs:
            self.outputs.append(out)
        else:
            self.inputs.append(weakref.ref(x))
        return out


def spy_on_memory(rank: int, world_size: int) -> list[int]:
    """1F1B at PP 2: rank 0, the bytes left in each output it sent; rank 1, for each
    input it received, whether it is still alive after the step."""
    spy = Spy(keep_outputs=rank == 0)
    executor = PipelineExecutor(
        generate("1f1b", 2, 3),
        rank,
        [spy],
        specs={1: TensorSpec((BATCH, HIDDEN))},
        loss_fn=lambda out, mb: out.sum(),
        timeout_s=TIMEOUT_S,
    )
    executor.run([torch.randn(BATCH, HIDDEN) for _ in range(3)])
    if rank == 0:
        return [out.untyped_storage().nbytes() for out in spy.outputs]
    return [ref() is not None for ref in spy.inputs]


def test_sent_outputs_are_freed_and_received_activations_released() -> None:
    sent, alive = run_workers(spy_on_memory, 2, timeout_s=60)
    assert sent == [4] * 3  # a one-element stand-in is all that is left of each
    assert alive == [False] * 3


# -- configuration errors, before any process-group work ------------------------------
def test_a_schedule_with_an_unmatched_receive_is_rejected_at_construction() -> None:
    schedule = lower(generate("1f1b", 2, 2))
    broken = [a for a in schedule.ranks[0] if a.kind is not Kind.SEND_F or a.microbatch != 1]
    schedule = Schedule(schedule.name, schedule.placement, [broken, schedule.ranks[1]])
    with pytest.raises(ScheduleError, match="SEND_F1"):
        PipelineExecutor(schedule, 1, [nn.Linear(2, 2)], specs={1: TensorSpec((2,))})


def send_against_a_wrong_spec(rank: int, world_size: int) -> str:
    executor = PipelineExecutor(
        generate("1f1b", 2, 2),
        rank,
        [nn.Linear(HIDDEN, HIDDEN)],
        specs={1: TensorSpec((BATCH, HIDDEN + 1))},
        loss_fn=lambda out, mb: out.sum(),
        timeout_s=TIMEOUT_S,
    )
    try:
        executor.run([torch.randn(BATCH, HIDDEN)] * 2)
    except Exception as error:  # report it, so that both ranks' outcomes come back
        return f"{type(error).__name__}: {error}"
    return "finished"


def test_a_message_that_does_not_match_its_spec_fails_on_the_sender() -> None:
    sender, receiver = run_workers(send_against_a_wrong_spec, 2, timeout_s=60)
    assert sender.startswith("ValueError: 0SEND_F0 sends a (3, 8) torch.float32 tensor but")
    assert "variable_shapes=True" in sender
    assert receiver.startswith("PipelineWaitError: pipeline rank 1 gave up on 1RECV_F0")


def test_wrong_module_count_or_missing_spec_is_rejected_at_construction() -> None:
    schedule = generate("dualpipev", 2, 4)
    with pytest.raises(ValueError, match="needs 2 stage modules"):
        PipelineExecutor(schedule, 0, [nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="no TensorSpec for the input of stage 3"):
        PipelineExecutor(
            schedule, 0, [nn.Linear(2, 2), nn.Linear(2, 2)], specs={1: TensorSpec((2,))}
        )
