"""Layer 2: execute a lowered schedule on one rank with torch (CPU+gloo or CUDA+NCCL).

- :class:`PipelineExecutor` runs one rank's actions: F, B (dX), W (dW), BW, FB and the
  point-to-point messages between them (:mod:`.p2p`), with a watchdog on every wait.
  Stages take and return a tensor or a tuple of tensors (:class:`TensorSpec` per element).
- :class:`WeightGradStore`, :class:`DeferrableLinear`, :func:`make_deferrable`: the dX/dW
  split; :class:`DeferrableLayer` is the protocol other layers follow to join it.
- :class:`MirrorPair`, :func:`sync_mirror_grads`: DualPipe's two model copies, made equal
  and their gradients summed over the pipeline group.
- :func:`gather_timeline`: measured timelines in the simulator's result format;
  :func:`p2p_latency_s`: the one-way latency between two ranks, by ping-pong.
- :func:`~.launch.run_ranks` (in :mod:`.launch`): fork N CPU+gloo ranks and collect results.

The runtime reports through :mod:`logging` (loggers named after its modules) and never
prints: the entry point that runs it decides what users see.
"""

from .deferrable import DeferrableLayer, DeferrableLinear, make_deferrable
from .executor import Activation, PipelineExecutor, StageSpec, StepResult
from .latency import p2p_latency_s
from .mirror import MirrorPair, sync_mirror_grads
from .p2p import TensorSpec
from .planned import PlannedStage
from .timeline import RankTimeline, gather_timeline
from .watchdog import DEFAULT_TIMEOUT_S, PipelineCommError, PipelineWaitError
from .weight_grad_store import WeightGradStore, active_store

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "Activation",
    "DeferrableLayer",
    "DeferrableLinear",
    "MirrorPair",
    "PipelineCommError",
    "PipelineExecutor",
    "PipelineWaitError",
    "PlannedStage",
    "RankTimeline",
    "StageSpec",
    "StepResult",
    "TensorSpec",
    "WeightGradStore",
    "active_store",
    "gather_timeline",
    "make_deferrable",
    "p2p_latency_s",
    "sync_mirror_grads",
]
