"""Layer 2: execute a lowered schedule on one rank with torch (CPU+gloo or CUDA+NCCL).

:class:`PipelineExecutor` runs one rank's actions and the point-to-point messages between
them (:mod:`.p2p`), with a watchdog on every wait; :class:`WeightGradStore` and
:class:`DeferrableLinear` split dX from dW; :class:`MirrorPair` keeps DualPipe's two model
copies equal; :func:`gather_timeline` measures a step. The runtime logs and never prints.
What each part does: docs/runtime.md; its modules: docs/architecture.md.
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
