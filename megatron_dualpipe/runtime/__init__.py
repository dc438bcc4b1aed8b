"""Layer 2: execute a lowered schedule on one rank with torch (CPU+gloo or CUDA+NCCL).

- :class:`PipelineExecutor` runs one rank's actions: F, B (dX), W (dW), BW, FB and the
  point-to-point messages between them (:mod:`.p2p`), with a watchdog on every wait.
- :class:`WeightGradStore`, :class:`DeferrableLinear`, :func:`make_deferrable`: the dX/dW
  split; :class:`DeferrableLayer` is the protocol other layers follow to join it.
- :func:`sync_mirror_grads`: gradient sync of DualPipe's two model copies.
- :func:`gather_timeline`: measured timelines in the simulator's result format.
"""

from .deferrable import DeferrableLayer, DeferrableLinear, make_deferrable
from .executor import OverlapHook, PipelineExecutor, StepResult
from .mirror import sync_mirror_grads
from .p2p import TensorSpec
from .timeline import RankTimeline, gather_timeline
from .watchdog import DEFAULT_TIMEOUT_S, PipelineCommError, PipelineWaitError
from .weight_grad_store import WeightGradStore, active_store

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DeferrableLayer",
    "DeferrableLinear",
    "OverlapHook",
    "PipelineCommError",
    "PipelineExecutor",
    "PipelineWaitError",
    "RankTimeline",
    "StepResult",
    "TensorSpec",
    "WeightGradStore",
    "active_store",
    "gather_timeline",
    "make_deferrable",
    "sync_mirror_grads",
]
