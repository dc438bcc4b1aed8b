"""The per-rank executor: run one rank's actions of a lowered schedule with torch.

Contracts:

- Each stage is a module taking one tensor and returning one tensor; the executor holds
  one module per local chunk. Data enters (``inputs[microbatch]``) at the first stage of a
  micro-batch's path; ``loss_fn(output, microbatch)`` runs on the stage where the path
  ends and its result is backpropagated as is: scale it (e.g. by 1 / micro-batches) in
  ``loss_fn`` if you want Megatron's averaging.
- F runs a stage; B computes the input gradient (dX) with every deferrable layer's weight
  gradient queued in the executor's :class:`WeightGradStore`; W runs the oldest queued
  entry, which must be its own; BW is an ordinary backward. With ``defer_weight_grads``
  off, B is an ordinary backward too and W only marks the end of the activations' life.
  Gradients accumulate into ``.grad`` and are the same either way.
- A stage module that implements :class:`~.planned.PlannedStage` (and plans this step)
  runs its own forwards and backwards; an FB whose two halves are on planned stages runs
  interleaved by the forward half's stage, every other FB as its forward half, then its
  backward half. :attr:`StepResult.overlapped` counts the interleaved ones.
- A stage's output is freed as soon as it has been sent (its autograd graph stays valid,
  as Megatron's ``deallocate_output_tensor``); a micro-batch's saved activations are
  released at its W or BW. Live activations are *measured*: each (stage, micro-batch)
  carries a token held by its saved tensors and its deferred work, and counts as live
  until the token is garbage; the peak is comparable with the simulator's.
- Devices and dtypes come from the modules, the inputs and the :class:`TensorSpec` s.
- After an error the executor and its process group must not be reused.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..schedules.ir import COMM_KINDS, Action, Kind, Schedule
from ..schedules.lowering import message_key, peer_of
from ..schedules.validate import validate
from .p2p import MessageKey, PipeComm, TensorSpec
from .planned import PlannedStage
from .timeline import RankTimeline
from .watchdog import DEFAULT_TIMEOUT_S, Watchdog
from .weight_grad_store import WeightGradStore

__all__ = ["PipelineExecutor", "StepResult"]

LossFn = Callable[[torch.Tensor, int], torch.Tensor]


@dataclass
class StepResult:
    """What one rank got from one step.

    ``losses`` and ``outputs`` (the last stage's outputs, when asked) are keyed by
    micro-batch and present only on ranks where a path ends. ``peak_activations`` is the
    measured peak of live (stage, micro-batch) activations. ``timeline`` is set when
    recording was asked for (see :func:`~.timeline.gather_timeline`). ``overlapped``
    counts the FB actions whose halves ran interleaved (planned stages).
    """

    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)
    peak_activations: int = 0
    timeline: RankTimeline | None = None
    overlapped: int = 0


class _Counter:
    """Live and peak count of activation tokens."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0

    def token(self) -> _Token:
        self.live += 1
        self.peak = max(self.peak, self.live)
        return _Token(self)


class _Token:
    """Alive exactly as long as something still holds one micro-batch's activations."""

    __slots__ = ("counter",)

    def __init__(self, counter: _Counter):
        self.counter = counter

    def __del__(self) -> None:
        self.counter.live -= 1


@dataclass
class _Unit:
    """A forwarded (stage, micro-batch) awaiting its backward: its input (None where data
    enters), the tensor to backpropagate from (output, or loss), its token, and for a
    planned stage the handle its backward takes."""

    input: torch.Tensor | None
    root: torch.Tensor
    token: _Token | None
    handle: Any = None


@dataclass
class _Comm:
    """A run of adjacent communication actions, and the receives of the next run."""

    sends: list[Action]
    receives: list[Action]
    next_receives: list[Action]


@dataclass
class _Step:
    """State of one ``run`` call."""

    inputs: Mapping[int, torch.Tensor] | Sequence[torch.Tensor]
    training: bool
    return_outputs: bool
    timeline: RankTimeline | None
    action_context: Callable[[Action], AbstractContextManager[None]] | None = None
    inbox: dict[MessageKey, torch.Tensor] = field(default_factory=dict)
    outbox: dict[MessageKey, torch.Tensor] = field(default_factory=dict)
    units: dict[tuple[int, int], _Unit] = field(default_factory=dict)
    result: StepResult = field(default_factory=StepResult)


def _module_device(module: nn.Module) -> torch.device | None:
    first = next(itertools.chain(module.parameters(), module.buffers()), None)
    return None if first is None else first.device


def _freed(tensor: torch.Tensor) -> torch.Tensor:
    """A one-element stand-in with ``tensor``'s shape, dtype and device."""
    return torch.empty((), dtype=tensor.dtype, device=tensor.device).expand(tensor.shape)


class PipelineExecutor:
    """Runs pipeline rank ``rank`` of ``schedule``, which is validated (and lowered if it
    is not yet) here: a faulty schedule raises ScheduleError before any communication.

    ``modules[c]`` is the module of local chunk ``c``. ``specs[stage]`` describes the
    activation ``stage`` receives (needed where it comes from another rank, and for the
    gradient a stage receives from the next one). ``group`` is the pipeline group:
    pipeline rank i is its rank i; on backends that ignore tags (NCCL) also pass
    ``backward_group``, a second group over the same ranks. ``timeout_s`` bounds every
    wait (see :mod:`.watchdog`). ``variable_shapes`` sends each activation's shape
    ahead of it, so micro-batches may differ in shape (specs then give only the
    number of dimensions and the dtype). ``prepost_receives`` posts the next run of
    receives before computing, so their data lands during compute (at the price of
    one receive buffer per channel held early).
    """

    def __init__(
        self,
        schedule: Schedule,
        rank: int,
        modules: Sequence[nn.Module],
        *,
        specs: Mapping[int, TensorSpec] | None = None,
        loss_fn: LossFn | None = None,
        group: dist.ProcessGroup | None = None,
        backward_group: dist.ProcessGroup | None = None,
        defer_weight_grads: bool = True,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        variable_shapes: bool = False,
        prepost_receives: bool = True,
    ):
        placement = schedule.placement
        if not 0 <= rank < placement.num_ranks:
            raise ValueError(
                f"rank {rank} is not a rank of this {placement.num_ranks}-rank schedule"
            )
        if len(modules) != placement.num_chunks:
            raise ValueError(
                f"rank {rank} needs {placement.num_chunks} stage modules (one per chunk), "
                f"got {len(modules)}"
            )
        self.schedule = validate(schedule)
        self.placement = placement
        self.rank = rank
        self.modules = list(modules)
        self._planned = [m if isinstance(m, PlannedStage) else None for m in modules]
        self.loss_fn = loss_fn
        self.defer_weight_grads = defer_weight_grads
        self.store = WeightGradStore()
        self._counter = _Counter()
        self._watchdog = Watchdog(rank, timeout_s)
        self._group = group
        self._prepost = prepost_receives
        self._specs = dict(specs or {})
        self._variable_shapes = variable_shapes
        self._comm = PipeComm(
            placement,
            rank,
            self._resolve_specs(self._specs),
            self._watchdog,
            group=group,
            backward_group=backward_group,
            variable_shapes=variable_shapes,
        )
        self._programs: dict[bool, list[Action | _Comm]] = {}

    # -- set-up ------------------------------------------------------------------------
    def _resolve_specs(self, specs: Mapping[int, TensorSpec]) -> dict[tuple[Kind, int], TensorSpec]:
        """Receive-buffer specs by (receive kind, local stage), devices filled in."""
        p = self.placement
        resolved = {}
        for action in self.schedule.ranks[self.rank]:
            if action.kind not in (Kind.RECV_F, Kind.RECV_B):
                continue
            owner = action.stage if action.kind is Kind.RECV_F else p.next_stage(action.stage)
            if owner not in specs:
                raise ValueError(
                    f"no TensorSpec for the input of stage {owner}: rank {self.rank} receives "
                    f"it; pass specs={{{owner}: TensorSpec(shape, dtype)}}"
                )
            spec = specs[owner]
            device = spec.device or _module_device(self.modules[action.chunk])
            if device is None:
                raise ValueError(
                    f"stage {action.stage} has no parameters or buffers to take a device "
                    f"from: give TensorSpec(device=...) for stage {owner}"
                )
            resolved[(action.kind, action.stage)] = TensorSpec(spec.shape, spec.dtype, device)
        return resolved

    def _program(self, training: bool) -> list[Action | _Comm]:
        """This rank's actions with each run of communication grouped (forward-only: the
        forwards and their messages only)."""
        if training not in self._programs:
            actions = self._actions(self.schedule.ranks[self.rank], training)
            program: list[Action | _Comm] = []
            for is_comm, run in itertools.groupby(actions, key=lambda a: a.kind in COMM_KINDS):
                if not is_comm:
                    program += run
                    continue
                run = list(run)
                program.append(
                    _Comm(
                        [a for a in run if a.kind in (Kind.SEND_F, Kind.SEND_B)],
                        [a for a in run if a.kind in (Kind.RECV_F, Kind.RECV_B)],
                        [],
                    )
                )
            comms = [item for item in program if isinstance(item, _Comm)]
            if self._prepost:
                for current, following in itertools.pairwise(comms):
                    current.next_receives = following.receives
            self._programs[training] = program
        return self._programs[training]

    @staticmethod
    def _actions(actions: list[Action], training: bool) -> list[Action]:
        if training:
            return actions
        forward_kinds = (Kind.F, Kind.SEND_F, Kind.RECV_F)
        return [
            half
            for action in actions
            for half in (action.sub[:1] if action.kind is Kind.FB else (action,))
            if half.kind in forward_kinds
        ]

    # -- the step ----------------------------------------------------------------------
    def run(
        self,
        inputs: Mapping[int, torch.Tensor] | Sequence[torch.Tensor] = (),
        *,
        forward_only: bool = False,
        return_outputs: bool = False,
        record_timeline: bool = False,
        action_context: Callable[[Action], AbstractContextManager[None]] | None = None,
    ) -> StepResult:
        """Run this rank's part of one step and return its :class:`StepResult`.

        ``inputs[mb]`` must exist for each micro-batch entering on this rank.
        ``forward_only`` runs the forwards (no graph, no backward) of the same schedule.
        ``record_timeline`` aligns the ranks with a barrier first, then records every
        compute action's start and end and every message's times. ``action_context``, if
        given, is entered around every backward (B, BW, an FB's backward half) and every
        W: the Megatron adapter uses it to let DDP see a chunk's final gradients.
        """
        training = not forward_only
        program = self._program(training)
        comm = self._comm
        comm.reset()
        timeline = None
        if record_timeline:
            dist.barrier(group=self._group)
            timeline = RankTimeline(self.rank)
        step = _Step(inputs, training, return_outputs, timeline, action_context)
        self._counter.peak = self._counter.live
        with torch.set_grad_enabled(training):
            for item in program:
                if isinstance(item, _Comm):
                    self._communicate(item, step, comm)
                elif timeline is None:
                    self._compute(item, step)
                else:
                    start = timeline.now()
                    self._compute(item, step)
                    timeline.add(item, start, timeline.now())
            comm.finish()
        leftovers = [*step.units, *step.inbox, *step.outbox]
        if leftovers or len(self.store):
            raise RuntimeError(
                f"rank {self.rank} ended the step with work left: {leftovers[:4]}, "
                f"{len(self.store)} deferred weight gradients"
            )
        step.result.peak_activations = self._counter.peak
        if timeline is not None:
            timeline.peak_activations = self._counter.peak
            step.result.timeline = timeline
        return step.result

    def _communicate(self, item: _Comm, step: _Step, comm: PipeComm) -> None:
        sends = []
        for action in item.sends:
            key = message_key(action, self.placement)
            tensor = step.outbox.pop(key)
            if not self._variable_shapes:
                self._check_outgoing(action, key, tensor)
            sends.append((action, tensor.detach()))
            if step.training and action.kind is Kind.SEND_F:
                tensor.data = _freed(tensor)  # the graph stays; the send holds the data
        if step.timeline is not None:
            now = step.timeline.now()
            step.timeline.sent += [
                (message_key(a, self.placement), peer_of(a, self.placement), now)
                for a in item.sends
            ]
        received = comm.exchange(sends, item.receives)
        for action, tensor in zip(item.receives, received, strict=True):
            step.inbox[message_key(action, self.placement)] = tensor
        if step.timeline is not None:
            now = step.timeline.now()
            step.timeline.received += [
                (message_key(a, self.placement), peer_of(a, self.placement), now)
                for a in item.receives
            ]
        if item.next_receives:
            comm.prepost(item.next_receives)

    def _check_outgoing(self, action: Action, key: MessageKey, tensor: torch.Tensor) -> None:
        """A message must match its receiver's TensorSpec, or the receiver fails with an
        obscure size error (different shapes per micro-batch need variable_shapes)."""
        kind, stage, _ = key
        owner = stage if kind is Kind.RECV_F else self.placement.next_stage(stage)
        spec = self._specs.get(owner)
        if spec is not None and (tensor.shape, tensor.dtype) != (tuple(spec.shape), spec.dtype):
            raise ValueError(
                f"{action} sends a {tuple(tensor.shape)} {tensor.dtype} tensor but the "
                f"TensorSpec of stage {owner}'s input says {tuple(spec.shape)} {spec.dtype}: fix "
                "the spec, or pass variable_shapes=True if shapes differ per micro-batch"
            )

    def _compute(self, action: Action, step: _Step) -> None:
        if action.kind is Kind.F:
            self._forward(action, step)
        elif action.kind in (Kind.B, Kind.BW):
            self._backward(action, step)
        elif action.kind is Kind.W:
            if self.defer_weight_grads:
                with self._around(action, step):
                    self.store.run((action.stage, action.microbatch))
        else:
            self._forward_backward(action, step)

    def _forward_input(self, action: Action, step: _Step) -> tuple[torch.Tensor, bool]:
        """The input of a forward and whether it came from another stage."""
        stage, mb = action.stage, action.microbatch
        if self.placement.prev_stage(stage) is None:
            return self._input(step, mb, stage), False
        x = step.inbox.pop((Kind.RECV_F, stage, mb))
        if step.training:
            x.requires_grad_()
        return x, True

    def _planned_stage(self, chunk: int, step: _Step) -> PlannedStage | None:
        planned = self._planned[chunk]
        return planned if step.training and planned is not None and planned.plans() else None

    def _forward(self, action: Action, step: _Step) -> None:
        stage, mb = action.stage, action.microbatch
        nxt = self.placement.next_stage(stage)
        x, received = self._forward_input(action, step)
        module = self.modules[action.chunk]
        if not step.training:
            self._finish_forward(module(x), stage, mb, nxt, step)
            return
        planned = self._planned_stage(action.chunk, step)
        token = self._counter.token()
        with self._recording(token):
            if planned is None:
                out, handle = module(x), None
            else:
                out, handle = planned.forward_planned(x)
            root = self._finish_forward(out, stage, mb, nxt, step)
        step.units[(stage, mb)] = _Unit(x if received else None, root, token, handle)

    def _input(self, step: _Step, mb: int, stage: int) -> torch.Tensor:
        try:
            return step.inputs[mb]
        except (KeyError, IndexError):
            raise ValueError(
                f"micro-batch {mb} enters at stage {stage} on rank {self.rank}: pass it in inputs"
            ) from None

    def _recording(self, token: _Token) -> ExitStack:
        """Tag every tensor saved for backward with ``token``; make the store visible."""
        stack = ExitStack()
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(lambda t: (t, token), _unpack))
        if self.defer_weight_grads:
            stack.enter_context(self.store.active())
        return stack

    def _finish_forward(
        self, out: torch.Tensor, stage: int, mb: int, nxt: int | None, step: _Step
    ) -> torch.Tensor:
        """Route a stage's output (to the loss, a local stage or a send); returns the
        tensor its backward starts from."""
        if nxt is None:
            if step.return_outputs:
                step.result.outputs[mb] = out.detach()
            if self.loss_fn is None:
                if step.training:
                    raise ValueError(
                        f"stage {stage} ends the pipeline on rank {self.rank}: pass loss_fn"
                    )
                return out
            loss = self.loss_fn(out, mb)
            step.result.losses[mb] = loss.detach()
            return loss
        if self.placement.rank_of(nxt) == self.rank:
            step.inbox[(Kind.RECV_F, nxt, mb)] = out.detach()
        else:
            step.outbox[(Kind.RECV_F, nxt, mb)] = out
        return out

    @staticmethod
    def _around(action: Action, step: _Step) -> AbstractContextManager[None]:
        return nullcontext() if step.action_context is None else step.action_context(action)

    def _backward(self, action: Action, step: _Step) -> None:
        with self._around(action, step):
            self._run_backward(action, step)

    def _run_backward(self, action: Action, step: _Step) -> None:
        stage, mb = action.stage, action.microbatch
        unit = step.units.pop((stage, mb))
        grad = self._output_grad(action, step)
        if self.defer_weight_grads and action.kind is Kind.B:
            with self.store.capture((stage, mb), owner=unit.token):
                self._run_unit_backward(action.chunk, unit, grad)
        else:
            self._run_unit_backward(action.chunk, unit, grad)
        self._send_input_grad(action, unit, step)

    def _output_grad(self, action: Action, step: _Step) -> torch.Tensor | None:
        """The gradient of a stage's output (None where it ends in a loss)."""
        if self.placement.next_stage(action.stage) is None:
            return None
        return step.inbox.pop((Kind.RECV_B, action.stage, action.microbatch))

    def _run_unit_backward(self, chunk: int, unit: _Unit, grad: torch.Tensor | None) -> None:
        if unit.handle is None:
            torch.autograd.backward(unit.root, grad)
        else:
            self._planned[chunk].backward_planned(unit.handle, unit.root, grad)

    def _send_input_grad(self, action: Action, unit: _Unit, step: _Step) -> None:
        """Route the gradient of a backwarded stage's input to the stage that fed it."""
        p = self.placement
        stage, mb = action.stage, action.microbatch
        prev = p.prev_stage(stage)
        if prev is None:
            return
        x = unit.input
        dx = x.grad if x.grad is not None else torch.zeros_like(x)
        box = step.inbox if p.rank_of(prev) == self.rank else step.outbox
        box[(Kind.RECV_B, prev, mb)] = dx

    def _forward_backward(self, action: Action, step: _Step) -> None:
        forward, backward = action.sub
        forward_stage = self._planned_stage(forward.chunk, step)
        backward_unit = step.units.get((backward.stage, backward.microbatch))
        if forward_stage is None or backward_unit is None or backward_unit.handle is None:
            self._forward(forward, step)
            self._backward(backward, step)
            return
        stage, mb = forward.stage, forward.microbatch
        x, received = self._forward_input(forward, step)
        del step.units[(backward.stage, backward.microbatch)]
        grad = self._output_grad(backward, step)
        token = self._counter.token()
        with self._around(backward, step), self._recording(token):
            out, handle = forward_stage.forward_backward_planned(
                x, self._planned[backward.chunk], backward_unit.handle, backward_unit.root, grad
            )
            root = self._finish_forward(out, stage, mb, self.placement.next_stage(stage), step)
        step.units[(stage, mb)] = _Unit(x if received else None, root, token, handle)
        self._send_input_grad(backward, backward_unit, step)
        step.result.overlapped += 1


def _unpack(packed: tuple[torch.Tensor, _Token]) -> torch.Tensor:
    return packed[0]
