"""The per-rank executor: run one rank's actions of a lowered schedule with torch.

:class:`PipelineExecutor` holds one module per local chunk and runs this rank's F, B, W, BW
and FB actions, exchanging tensors and their gradients with the other ranks by the
schedule's communication plan. A B computes dX and queues the deferrable layers' dW in the
executor's :class:`WeightGradStore`; a W runs its stage's oldest entry. The contracts on
stages, gradients, memory and ``graph_safe``: docs/runtime.md (and docs/megatron.md, "CUDA
graphs"). After an error the executor and its process group must not be reused.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..schedules.comm_plan import CommPlan, Compute, Init, Issue, Wait, comm_plan
from ..schedules.ir import Action, Kind, Placement, Schedule, action_span_name
from ..schedules.nccl_rules import check_nccl
from ..schedules.validate import check_weight_grads_in_b_order, validate
from .p2p import MessageKey, Payload, PipeComm, TensorSpec
from .planned import PlannedStage
from .timeline import RankTimeline, clock_for, start_barrier
from .transport import GroupTransport, Transport
from .watchdog import DEFAULT_TIMEOUT_S, Watchdog
from .weight_grad_store import WeightGradStore, hooks_once

__all__ = ["Activation", "PipelineExecutor", "StageSpec", "StepResult"]

#: What a stage takes and returns: one tensor or a tuple of tensors.
Activation = torch.Tensor | tuple[torch.Tensor, ...]
#: The TensorSpec of a stage's input: one, or one per element of a tuple.
StageSpec = TensorSpec | tuple[TensorSpec, ...]
LossFn = Callable[[Any, int], torch.Tensor]


@dataclass
class StepResult:
    """What one rank got from one step.

    ``losses`` and ``outputs`` (the last stage's outputs as it returned them, detached,
    when asked) are keyed by micro-batch and present only on ranks where a path ends.
    ``peak_activations`` is the measured peak of live (stage, micro-batch) activations,
    ``peak_activation_bytes`` the peak of the bytes their forwards saved for backward
    (distinct storages, parameters excluded; what a recomputation holds for the moment of
    one backward is not counted). ``timeline`` is set when recording was asked for (see
    :func:`~.timeline.gather_timeline`). ``overlapped`` counts the FB actions whose halves
    ran interleaved (planned stages). ``peak_sends`` is the most sent messages whose
    tensors the rank held at once, waiting for their sends to complete.
    """

    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: dict[int, Activation] = field(default_factory=dict)
    peak_activations: int = 0
    peak_activation_bytes: int = 0
    timeline: RankTimeline | None = None
    overlapped: int = 0
    peak_sends: int = 0


class _Counter:
    """Live and peak count of activation tokens, and of the bytes saved under them."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self.live_bytes = 0
        self.peak_bytes = 0

    def token(self) -> _Token:
        self.live += 1
        self.peak = max(self.peak, self.live)
        return _Token(self)

    def restart(self) -> None:
        """A new step: the peaks start from what is live now."""
        self.peak, self.peak_bytes = self.live, self.live_bytes


class _Token:
    """Alive exactly as long as something still holds one micro-batch's activations; counts
    the bytes of the distinct storages saved for its backward (parameters excluded)."""

    __slots__ = ("counter", "nbytes", "storages")

    def __init__(self, counter: _Counter):
        self.counter = counter
        self.nbytes = 0
        self.storages: set[int] = set()

    def saved(self, tensor: torch.Tensor) -> None:
        if isinstance(tensor, nn.Parameter) or tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        if storage.data_ptr() in self.storages:
            return
        self.storages.add(storage.data_ptr())
        self.nbytes += storage.nbytes()
        counter = self.counter
        counter.live_bytes += storage.nbytes()
        counter.peak_bytes = max(counter.peak_bytes, counter.live_bytes)

    def __del__(self) -> None:
        self.counter.live -= 1
        self.counter.live_bytes -= self.nbytes


@dataclass
class _Unit:
    """A forwarded (stage, micro-batch) awaiting its backward: its input elements whose
    gradients go back (none where data enters), the tensors its backward starts from (the
    loss, or the output elements that get a gradient), its token, and for a planned stage
    the handle its backward takes."""

    inputs: Payload
    roots: Payload
    token: _Token | None
    handle: Any = None


@dataclass
class _Step:
    """State of one ``run`` call."""

    inputs: Mapping[int, Activation] | Sequence[Activation]
    training: bool
    return_outputs: bool
    timeline: RankTimeline | None
    action_context: Callable[[Action], AbstractContextManager[None]] | None = None
    inbox: dict[MessageKey, Payload] = field(default_factory=dict)
    outbox: dict[MessageKey, Payload] = field(default_factory=dict)
    freeable: dict[MessageKey, Payload] = field(default_factory=dict)
    units: dict[tuple[int, int], _Unit] = field(default_factory=dict)
    result: StepResult = field(default_factory=StepResult)


def _module_device(module: nn.Module) -> torch.device | None:
    first = next(itertools.chain(module.parameters(), module.buffers()), None)
    return None if first is None else first.device


def _freed(tensor: torch.Tensor) -> torch.Tensor:
    """A one-element stand-in with ``tensor``'s shape, dtype and device."""
    return torch.empty((), dtype=tensor.dtype, device=tensor.device).expand(tensor.shape)


def _carries_grad(tensor: torch.Tensor | TensorSpec) -> bool:
    """Whether an element gets a gradient: floating-point and complex ones do."""
    return tensor.dtype.is_floating_point or tensor.dtype.is_complex


def _elements(value: Any, what: str) -> Payload:
    """``value`` (a tensor, or a tuple or list of tensors) as a tuple of tensors."""
    elements = tuple(value) if isinstance(value, tuple | list) else (value,)
    if not elements or not all(isinstance(t, torch.Tensor) for t in elements):
        kinds = ", ".join(type(t).__name__ for t in elements) or "nothing"
        raise TypeError(f"{what} is {kinds}: it must be a tensor or a tuple of tensors")
    return elements


def _stage_specs(stage: int, spec: StageSpec) -> tuple[TensorSpec, ...]:
    """A stage's spec as one TensorSpec per input element."""
    elements = tuple(spec) if isinstance(spec, tuple | list) else (spec,)
    if not elements or not all(isinstance(s, TensorSpec) for s in elements):
        raise TypeError(
            f"the spec of stage {stage} must be a TensorSpec or a non-empty tuple of "
            f"TensorSpecs, got {spec!r}"
        )
    return elements


class _Viewless(torch.autograd.Function):
    """The values of a view as a tensor that is not one (same storage, no ``_base``), so
    that freeing it after its send releases the storage; gradients pass unchanged."""

    @staticmethod
    def forward(ctx: Any, view: torch.Tensor) -> torch.Tensor:
        alias = torch.empty((1,), dtype=view.dtype, device=view.device)
        alias.data = view.data
        return alias

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _viewless(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a view-less alias of it where it is a computed view."""
    if tensor.grad_fn is None or tensor._base is None:
        return tensor
    return _Viewless.apply(tensor)


def _detached(value: Activation) -> Activation:
    return tuple(t.detach() for t in value) if isinstance(value, tuple | list) else value.detach()


class PipelineExecutor:
    """Runs pipeline rank ``rank`` of ``schedule``, which is validated (and lowered if it
    is not yet) here: a faulty schedule raises ScheduleError before any communication.

    ``modules[c]`` is the module of local chunk ``c``. ``specs[stage]`` describes the
    activation ``stage`` receives, a :class:`TensorSpec` or a tuple of them for a stage
    taking several tensors (needed where it comes from another rank, and for the gradient
    a stage receives from the next one). ``group`` is the pipeline group: pipeline rank i
    is its rank i. ``timeout_s`` bounds every wait (see :mod:`.watchdog`).
    ``variable_shapes`` sends each message's shapes ahead of it, so micro-batches may
    differ in shape (specs then give only the number of dimensions and the dtype).
    ``free_outputs`` (Megatron's ``deallocate_pipeline_outputs``)
    frees each sent output's storage once it is sent, and then refuses outputs that are
    views. The attribute ``record_spans`` (off by default; set it between steps) puts each
    compute action in a profiler span, ``F stage=S mb=M`` and so on, one per action and FB
    half. ``watch_paused``: while
    it returns True the hang monitor polls nothing (e.g. Megatron's ``is_graph_capturing``:
    a CUDA graph captured in global mode forbids the event queries of another thread).

    Communication follows the schedule's :func:`~megatron_dualpipe.schedules.comm_plan.
    comm_plan` and nothing else, through ``transport``: by default the pipeline ``group``
    itself on every backend (:class:`~.transport.GroupTransport`: no group is made), or
    the :class:`~.transport.Transport` passed. On every backend the lock-step plan is
    checked here under NCCL's rules in the worst case (every communicator of a rank on one
    stream, the step's data- and expert-parallel collectives on it too, every send waiting
    for its receive; :func:`~megatron_dualpipe.schedules.nccl_rules.check_nccl`), and a
    plan that would deadlock is refused before any work.
    """

    def __init__(
        self,
        schedule: Schedule,
        rank: int,
        modules: Sequence[nn.Module],
        *,
        specs: Mapping[int, StageSpec] | None = None,
        loss_fn: LossFn | None = None,
        group: dist.ProcessGroup | None = None,
        transport: Transport | None = None,
        defer_weight_grads: bool = True,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        variable_shapes: bool = False,
        free_outputs: bool = True,
        graph_safe: bool = False,
        watch_paused: Callable[[], bool] | None = None,
    ):
        placement = schedule.placement
        if graph_safe and variable_shapes:
            raise ValueError(
                "graph_safe needs static shapes, and variable_shapes reads each message's "
                "shapes on the host: pad the micro-batches to one shape"
            )
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
        if defer_weight_grads:
            check_weight_grads_in_b_order(self.schedule)
        self.placement = placement
        self.rank = rank
        self.modules = list(modules)
        self._planned = [m if isinstance(m, PlannedStage) else None for m in modules]
        self.loss_fn = loss_fn
        self.defer_weight_grads = defer_weight_grads
        self.free_outputs = free_outputs
        #: Run each compute action in a ``torch.profiler.record_function`` span (for
        #: ``train --profile``); off, the executor makes no profiler call.
        self.record_spans = False
        self.graph_safe = graph_safe
        self.watch_paused = watch_paused
        self.store = WeightGradStore()
        self._counter = _Counter()
        self._watchdog = Watchdog(rank, timeout_s)
        self._group = group
        self._specs = {stage: _stage_specs(stage, spec) for stage, spec in (specs or {}).items()}
        self._variable_shapes = variable_shapes
        resolved = self._resolve_specs(self._specs)
        self._message_bytes = {
            key: sum(math.prod(s.shape) * s.dtype.itemsize for s in elements)
            for key, elements in resolved.items()
        }
        device = _module_device(self.modules[0]) or torch.device("cpu")
        if transport is None:
            transport = _default_transport(group, device)
        self.transport = transport
        self._plans: dict[bool, CommPlan] = {}
        for forward_only in (False, True):  # the worst case: one stream, every send large
            plan = self.plan(forward_only=forward_only)
            check_nccl(plan, streams="shared", eager_limit=0, bound=False)
        self._failed: str | None = None
        self._comm = PipeComm(
            placement,
            rank,
            resolved,
            self._watchdog,
            transport,
            variable_shapes=variable_shapes,
            graph_safe=graph_safe,
            watch_paused=watch_paused,
        )

    # -- set-up ------------------------------------------------------------------------
    def _resolve_specs(
        self, specs: Mapping[int, tuple[TensorSpec, ...]]
    ) -> dict[tuple[Kind, int], tuple[TensorSpec, ...]]:
        """Receive-buffer specs by (receive kind, local stage), one per element, devices
        filled in: a stage's input elements, or those of them that get a gradient."""
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
            elements = specs[owner]
            if action.kind is Kind.RECV_B:
                elements = tuple(spec for spec in elements if _carries_grad(spec))
            module_device = _module_device(self.modules[action.chunk])
            if module_device is None and any(spec.device is None for spec in elements):
                raise ValueError(
                    f"stage {action.stage} has no parameters or buffers to take a device "
                    f"from: give TensorSpec(device=...) for stage {owner}"
                )
            resolved[(action.kind, action.stage)] = tuple(
                TensorSpec(spec.shape, spec.dtype, spec.device or module_device)
                for spec in elements
            )
        return resolved

    def plan(self, *, forward_only: bool = False) -> CommPlan:
        """The communication plan this executor runs (a training or a forward-only step)."""
        if forward_only not in self._plans:
            sizes = self._message_bytes
            self._plans[forward_only] = comm_plan(
                self.schedule,
                variable_shapes=self._variable_shapes,
                message_bytes=None if self._variable_shapes else (lambda key: sizes.get(key[:2])),
                forward_only=forward_only,
            )
        return self._plans[forward_only]

    @property
    def live_activations(self) -> int:
        """(stage, micro-batch) activations held right now: 0 between steps, unless some
        are leaked (the deferred weight gradients still queued are ``len(self.store)``)."""
        return self._counter.live

    def close(self) -> None:
        """Stop the executor's helper threads; it is not used again."""
        self._comm.close()

    @property
    def peak_activations(self) -> int:
        """The most (stage, micro-batch) activations held at once in the last step."""
        return self._counter.peak

    @property
    def peak_activation_bytes(self) -> int:
        """The most bytes saved for backward held at once in the last step (see
        :class:`StepResult`)."""
        return self._counter.peak_bytes

    # -- the step ----------------------------------------------------------------------
    def run(
        self,
        inputs: Mapping[int, Activation] | Sequence[Activation] = (),
        *,
        forward_only: bool = False,
        return_outputs: bool = False,
        record_timeline: bool = False,
        action_context: Callable[[Action], AbstractContextManager[None]] | None = None,
    ) -> StepResult:
        """Run this rank's part of one step and return its :class:`StepResult`.

        ``inputs[mb]`` (a tensor or a tuple of them) must exist for each micro-batch
        entering on this rank.
        ``forward_only`` runs the forwards (no graph, no backward) of the same schedule.
        ``record_timeline`` aligns the ranks with a barrier first, then records every
        compute action's start and end as it ran (an FB run as its two halves, one after
        the other, as those halves) and every message's times. ``action_context``, if
        given, is entered around every backward (B, BW, an FB's backward half) and every
        W: the Megatron adapter uses it to let DDP see a chunk's final gradients.
        """
        if self._failed is not None:
            raise RuntimeError(
                f"rank {self.rank}'s executor failed in an earlier step ({self._failed}): "
                "its messages may still be in flight; make a new executor and process groups"
            )
        if record_timeline and self.graph_safe:
            raise ValueError(
                "record_timeline reads CUDA events on the host, which a graph-safe step does "
                "not: record the timeline with graph_safe off"
            )
        training = not forward_only
        steps = self.plan(forward_only=forward_only).ranks[self.rank]
        comm = self._comm
        comm.reset()
        timeline = None
        step = _Step(inputs, training, return_outputs, None, action_context)
        try:
            plan = self.plan()
            inits = [s.comm for s in plan.ranks[self.rank] if isinstance(s, Init)]
            comm.setup([(c, plan.peers(self.rank, c)) for c in inits])
            if record_timeline:
                start_barrier(self._group)
                device = _module_device(self.modules[0])
                step.timeline = timeline = RankTimeline(self.rank, clock=clock_for(device))
            self._counter.restart()
            with torch.set_grad_enabled(training):
                self._run_steps(steps, step)
                comm.finish()
        except BaseException as error:
            lines = str(error).strip().splitlines()
            self._failed = f"{type(error).__name__}: {lines[0] if lines else ''}"
            raise
        leftovers = [*step.units, *step.inbox, *step.outbox]
        if leftovers or len(self.store):
            raise RuntimeError(
                f"rank {self.rank} ended the step with work left: {leftovers[:4]}, "
                f"{len(self.store)} deferred weight gradients"
            )
        step.result.peak_activations = self._counter.peak
        step.result.peak_sends = comm.peak_sends
        step.result.peak_activation_bytes = self._counter.peak_bytes
        if timeline is not None:
            timeline.peak_activations = self._counter.peak
            step.result.timeline = timeline.resolve()
        return step.result

    def _run_steps(self, steps: Sequence[Compute | Issue | Wait | Init], step: _Step) -> None:
        """This rank's plan for one step: compute, issue, wait (Init ran at set-up)."""
        timeline = step.timeline
        for item in steps:
            if isinstance(item, Compute):
                self._compute(item.action, step)
            elif isinstance(item, Issue):
                self._issue(item, step)
            elif isinstance(item, Wait):
                step.inbox.update(self._comm.wait(item))
                if timeline is not None:
                    now = timeline.now()
                    timeline.received += [
                        (k, _sender(self.placement, k), now) for k in item.keys if k in step.inbox
                    ]

    def _issue(self, issue: Issue, step: _Step) -> None:
        """Hand one batch of the plan to the backend: sends take their payloads from the
        outbox (checked, contiguous; a shape message reads its message's payload, which
        stays for the data) and free what they computed once the data is issued."""
        payloads: dict[MessageKey, Payload] = {}
        sent: list[tuple[MessageKey, int]] = []
        for op in issue.ops:
            if op.kind != "send":
                continue
            key = op.key[:3]
            if key not in payloads:
                payloads[key] = step.outbox[key]
                if key[0] is Kind.RECV_F:
                    self._check_outgoing(key, payloads[key])
            if len(op.key) == 3:  # the data, not its shape message
                del step.outbox[key]
                payloads[key] = tuple(t.detach().contiguous() for t in payloads[key])
                sent.append((key, op.peer))
        if step.timeline is not None:
            now = step.timeline.now()
            step.timeline.sent += [(key, peer, now) for key, peer in sent]
        self._comm.issue(issue, payloads)
        for key, _ in sent:
            for tensor in step.freeable.pop(key, ()):
                tensor.data = _freed(tensor)  # the graph stays; the send holds the data

    def _check_outgoing(self, key: MessageKey, payload: Payload) -> None:
        """An output must match its receiver's TensorSpecs, or the receiver fails with an
        obscure size error (different shapes per micro-batch need variable_shapes; then
        the number of dimensions and the dtype must match)."""
        owner = key[1]
        action = Action(Kind.SEND_F, self.placement.prev_stage(owner), key[2])
        specs = self._specs.get(owner)
        if specs is None:
            return
        if len(payload) != len(specs):
            raise ValueError(
                f"{action} sends {len(payload)} tensors but the spec of stage {owner}'s input "
                f"lists {len(specs)}: give one TensorSpec per tensor the stage returns"
            )
        for i, (tensor, spec) in enumerate(zip(payload, specs, strict=True)):
            which = "" if len(specs) == 1 else f" as element {i}"
            if self._variable_shapes:
                matches = tensor.dim() == len(spec.shape)
                sent, expected = f"{tensor.dim()}-d", f"{len(spec.shape)}-d"
            else:
                matches = tuple(tensor.shape) == tuple(spec.shape)
                sent, expected = str(tuple(tensor.shape)), str(tuple(spec.shape))
            if not matches or tensor.dtype != spec.dtype:
                raise ValueError(
                    f"{action} sends a {sent} {tensor.dtype} tensor{which} but the TensorSpec "
                    f"of stage {owner}'s input says {expected} {spec.dtype}: fix the spec, or "
                    "pass variable_shapes=True if shapes differ per micro-batch"
                )

    def _compute(self, action: Action, step: _Step, half: bool = False) -> None:
        """Run one compute action, timed into the step's timeline when it records one. An
        FB that cannot run interleaved runs, and is recorded, as what it is then: its
        forward half, then its backward half. With :attr:`record_spans`, the action runs
        inside a profiler span named :func:`_span_name` (``half``: one half of an FB)."""
        if not self.record_spans:
            self._compute_action(action, step)
            return
        with torch.profiler.record_function(_span_name(action, half)):
            self._compute_action(action, step)

    def _compute_action(self, action: Action, step: _Step) -> None:
        if action.kind is Kind.FB and not self._interleaves(action, step):
            for half in action.sub:
                self._compute(half, step, half=True)
            return
        if step.timeline is None:
            self._execute(action, step)
            return
        start = step.timeline.now()
        self._execute(action, step)
        step.timeline.add(action, start, step.timeline.now())

    def _execute(self, action: Action, step: _Step) -> None:
        if action.kind is Kind.F:
            self._forward(action, step)
        elif action.kind in (Kind.B, Kind.BW):
            self._backward(action, step)
        elif action.kind is Kind.W:
            if self.defer_weight_grads:
                with self._around(action, step):
                    self.store.run((action.stage, action.microbatch), lane=action.stage)
        else:
            self._forward_backward(action, step)

    def _forward_input(self, action: Action, step: _Step) -> tuple[Payload, Payload]:
        """A forward's arguments, and those of them whose gradients go back."""
        stage, mb = action.stage, action.microbatch
        if self.placement.prev_stage(stage) is None:
            return self._input(step, mb, stage), ()
        args = step.inbox.pop((Kind.RECV_F, stage, mb))
        grad_inputs = tuple(x for x in args if _carries_grad(x))
        if step.training:
            for x in grad_inputs:
                x.requires_grad_()
        return args, grad_inputs

    def _planned_stage(self, chunk: int, step: _Step) -> PlannedStage | None:
        planned = self._planned[chunk]
        return planned if step.training and planned is not None and planned.plans() else None

    def _forward(self, action: Action, step: _Step) -> None:
        stage, mb = action.stage, action.microbatch
        nxt = self.placement.next_stage(stage)
        args, grad_inputs = self._forward_input(action, step)
        module = self.modules[action.chunk]
        if not step.training:
            self._finish_forward(module(*args), stage, mb, nxt, step)
            return
        planned = self._planned_stage(action.chunk, step)
        token = self._counter.token()
        saved: set[int] = set()
        with self._recording(token, saved):
            if planned is None:
                out, handle = module(*args), None
            else:
                out, handle = planned.forward_planned(*args)
            roots = self._finish_forward(out, stage, mb, nxt, step, saved)
        step.units[(stage, mb)] = _Unit(grad_inputs, roots, token, handle)

    def _input(self, step: _Step, mb: int, stage: int) -> Payload:
        try:
            value = step.inputs[mb]
        except (KeyError, IndexError):
            raise ValueError(
                f"micro-batch {mb} enters at stage {stage} on rank {self.rank}: pass it in inputs"
            ) from None
        return _elements(value, f"inputs[{mb}]")

    def _recording(self, token: _Token, saved: set[int]) -> ExitStack:
        """Tag every tensor saved for backward with ``token`` and put its id in ``saved``;
        make the store visible."""

        measure = not self.graph_safe

        def pack(tensor: torch.Tensor) -> tuple[torch.Tensor, _Token]:
            saved.add(id(tensor))
            if measure:
                token.saved(tensor)
            # Detached: an output its own grad_fn saves would otherwise hold that grad_fn,
            # a reference cycle through autograd's C++ graph that no collector frees.
            return tensor.detach(), token

        stack = ExitStack()
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, _unpack))
        if self.defer_weight_grads:
            stack.enter_context(self.store.active())
        return stack

    def _finish_forward(
        self,
        out: Activation,
        stage: int,
        mb: int,
        nxt: int | None,
        step: _Step,
        saved: set[int] | None = None,
    ) -> Payload:
        """Route a stage's output (to the loss, a local stage or a send; ``saved``: ids of
        the tensors its graph saved); returns the tensors its backward starts from (the
        loss, or the elements that get a gradient)."""
        elements = _elements(out, f"the output of stage {stage}")
        remote = self.placement.remote_neighbours(stage)[1]
        if remote and step.training and self.free_outputs:
            elements = tuple(_viewless(t) for t in elements)
        if nxt is None:
            if step.return_outputs:
                step.result.outputs[mb] = _detached(out)
            if self.loss_fn is None:
                if step.training:
                    raise ValueError(
                        f"stage {stage} ends the pipeline on rank {self.rank}: pass loss_fn"
                    )
                return ()
            loss = self.loss_fn(out, mb)
            step.result.losses[mb] = loss.detach()
            return (loss,)
        if not remote:
            step.inbox[(Kind.RECV_F, nxt, mb)] = tuple(t.detach() for t in elements)
        else:
            key = (Kind.RECV_F, nxt, mb)
            step.outbox[key] = elements
            if step.training and self.free_outputs:
                step.freeable[key] = self._freeable(stage, elements, saved or set())
        return tuple(t for t in elements if _carries_grad(t))

    def _freeable(self, stage: int, elements: Payload, saved: set[int]) -> Payload:
        """The elements to free once sent: those the stage computed (with a ``grad_fn``;
        views arrive here as view-less aliases), except those its own backward reads (saved,
        e.g. tanh's result), whose storage must stay."""
        computed = {id(t): t for t in elements if t.grad_fn is not None and id(t) not in saved}
        return tuple(computed.values())

    @staticmethod
    def _around(action: Action, step: _Step) -> AbstractContextManager[None]:
        return nullcontext() if step.action_context is None else step.action_context(action)

    def _backward(self, action: Action, step: _Step) -> None:
        with self._around(action, step):
            self._run_backward(action, step)

    def _run_backward(self, action: Action, step: _Step) -> None:
        stage, mb = action.stage, action.microbatch
        unit = step.units.pop((stage, mb))
        roots, grads = self._backward_roots(action, unit, step)
        if self.defer_weight_grads and action.kind is Kind.B:
            with self.store.capture((stage, mb), owner=unit.token, lane=stage):
                self._run_unit_backward(action.chunk, unit, roots, grads)
        else:
            with hooks_once():  # a layer's dWs of this backward summed before its hooks
                self._run_unit_backward(action.chunk, unit, roots, grads)
        self._send_input_grads(action, unit, step)

    def _backward_roots(
        self, action: Action, unit: _Unit, step: _Step
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """What a backward starts from: the loss (no gradients) where the path ends, else
        the output elements that require grad with their received gradients."""
        if self.placement.next_stage(action.stage) is None:
            return list(unit.roots), None
        received = step.inbox.pop((Kind.RECV_B, action.stage, action.microbatch))
        pairs = [
            (root, grad)
            for root, grad in zip(unit.roots, received, strict=True)
            if root.requires_grad  # a constant output drops its gradient
        ]
        return [root for root, _ in pairs], [grad for _, grad in pairs]

    def _run_unit_backward(
        self,
        chunk: int,
        unit: _Unit,
        roots: list[torch.Tensor],
        grads: list[torch.Tensor] | None,
    ) -> None:
        if unit.handle is not None:
            self._planned[chunk].backward_planned(unit.handle, roots, grads)
        elif roots:
            torch.autograd.backward(roots, grads)

    def _send_input_grads(self, action: Action, unit: _Unit, step: _Step) -> None:
        """Route the gradients of a backwarded stage's inputs to the stage that fed it."""
        p = self.placement
        prev = p.prev_stage(action.stage)
        if prev is None:
            return
        dx = tuple(x.grad if x.grad is not None else torch.zeros_like(x) for x in unit.inputs)
        box = step.outbox if p.remote_neighbours(action.stage)[0] else step.inbox
        box[(Kind.RECV_B, prev, action.microbatch)] = dx

    def _interleaves(self, action: Action, step: _Step) -> bool:
        """Whether FB ``action`` runs interleaved: both halves on planned stages."""
        forward, backward = action.sub
        backward_unit = step.units.get((backward.stage, backward.microbatch))
        return (
            self._planned_stage(forward.chunk, step) is not None
            and backward_unit is not None
            and backward_unit.handle is not None
        )

    def _forward_backward(self, action: Action, step: _Step) -> None:
        """An FB that :meth:`_interleaves`: one planned forward-and-backward call."""
        forward, backward = action.sub
        forward_stage = self._planned_stage(forward.chunk, step)
        backward_unit = step.units[(backward.stage, backward.microbatch)]
        stage, mb = forward.stage, forward.microbatch
        args, grad_inputs = self._forward_input(forward, step)
        del step.units[(backward.stage, backward.microbatch)]
        roots, grads = self._backward_roots(backward, backward_unit, step)
        token = self._counter.token()
        saved: set[int] = set()
        # hooks_once: a full backward's dWs of one layer summed before its hooks, as in
        # _run_backward (a B defers them to its W, which sums them there).
        with self._around(backward, step), self._recording(token, saved), hooks_once():
            out, handle = forward_stage.forward_backward_planned(
                args, self._planned[backward.chunk], backward_unit.handle, roots, grads
            )
            nxt = self.placement.next_stage(stage)
            forward_roots = self._finish_forward(out, stage, mb, nxt, step, saved)
        step.units[(stage, mb)] = _Unit(grad_inputs, forward_roots, token, handle)
        self._send_input_grads(backward, backward_unit, step)
        step.result.overlapped += 1


def _span_name(action: Action, half: bool) -> str:
    """The profiler span of ``action`` (``simulate --profile`` reads these names back)."""
    if action.kind is Kind.FB:
        forward, backward = action.sub
        other = (backward.stage, backward.microbatch)
        return action_span_name("FB", forward.stage, forward.microbatch, other)
    kind = f"FB/{action.kind.value}" if half else action.kind.value
    return action_span_name(kind, action.stage, action.microbatch)


def _sender(placement: Placement, key: MessageKey) -> int:
    """The rank that sends message ``key``."""
    kind, stage, _ = key
    source = placement.prev_stage(stage) if kind is Kind.RECV_F else placement.next_stage(stage)
    return placement.rank_of(source)


def _default_transport(group: dist.ProcessGroup | None, device: torch.device) -> Transport:
    """The pipeline group itself (default: the world), on every backend."""
    group = group or dist.group.WORLD
    return GroupTransport(group, dist.get_process_group_ranks(group), device=device)


def _unpack(packed: tuple[torch.Tensor, _Token]) -> torch.Tensor:
    return packed[0]
