"""Run megatron-core (0.16.1 to 0.19.x) on CPU + gloo, for tests and the demo.

:func:`apply_cpu_compat` (idempotent; a no-op with CUDA) removes the CUDA assumptions that
stop megatron-core from running without a GPU. Every patch is module-scoped and ``torch``
itself is left alone: the name ``torch`` inside each module of ``_TORCH_ON_CPU_SITES`` is
rebound to a CPU view of torch (``torch.cuda`` reports the CPU, streams and events are
stand-ins, ``device="cuda"`` factories make CPU tensors), and a few functions are replaced
or run under a mode. Megatron-LM's training loop needs more: :mod:`.cpu_compat_training`.
Each site and patch, per release, and what is not covered: docs/megatron-on-cpu.md.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from megatron.core.tensor_parallel import random as _mrandom
from torch.overrides import TorchFunctionMode

__all__ = [
    "CpuRNGStatesTracker",
    "apply_cpu_compat",
    "cpu_compat_applied",
    "schedule_plan_context",
]

_CPU = torch.device("cpu")

# Megatron modules whose global name ``torch`` is rebound to the CPU view; what each assumes
# of CUDA: docs/megatron-on-cpu.md's table of the sites (and what later releases add).
_TORCH_ON_CPU_SITES: tuple[str, ...] = (
    "megatron.core.utils",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
    "megatron.core.transformer.utils",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.pipeline_parallel.utils",
    "megatron.core.models.common.model_chunk_schedule_plan",
    "megatron.core.pipeline_parallel.combined_1f1b",
    "megatron.core.models.gpt.fine_grained_callables",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.transformer.multi_token_prediction",
)

# Tensor factories whose ``device="cuda"`` the CPU view maps to the CPU.
_FACTORIES = (
    "arange",
    "as_tensor",
    "empty",
    "empty_strided",
    "full",
    "ones",
    "rand",
    "randint",
    "randn",
    "tensor",
    "zeros",
)

_applied = False


def cpu_compat_applied() -> bool:
    """Whether ``apply_cpu_compat`` has patched megatron in this process."""
    return _applied


def apply_cpu_compat() -> None:
    """Patch megatron-core so it runs on CPU + gloo; idempotent.

    Does nothing when CUDA is available. Call it before building models or running
    schedules; forked children inherit the patches. Imports the megatron modules it
    patches. (An unsupported release was refused when the adapter was imported.)
    """
    global _applied
    if torch.cuda.is_available():
        return
    if _applied:
        return
    for module_name in _TORCH_ON_CPU_SITES:
        importlib.import_module(module_name).torch = _TORCH_ON_CPU
    _install_cpu_rng_tracker()
    _patch_recompute_rng()
    _make_tensor_cuda_identity_in_embedding_setup()
    _patch_moe()
    _patch_mla_without_te()
    _patch_grad_clipping()
    _patch_distributed_optimizer_types()
    _patch_float16_optimizer_types()
    _applied = True


# --------------------------------------------------------------------------------------
# The CPU view of torch.


class _CpuStream(torch.Stream):
    """Stand-in for ``torch.cuda.Stream``: CPU work is synchronous, so waits are no-ops. A
    real (CPU) ``torch.Stream``, so that calls taking a stream accept it."""

    def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> _CpuStream:
        return super().__new__(cls, device="cpu")

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        pass

    @staticmethod
    def priority_range() -> tuple[int, int]:
        """One priority only (0.18's ``set_streams(high_priority=True)`` asks)."""
        return (0, 0)

    def wait_stream(self, stream: Any) -> None:
        """Nothing to wait for."""

    def wait_event(self, event: Any) -> None:
        """Nothing to wait for."""

    def record_event(self, event: _CpuEvent | None = None) -> _CpuEvent:
        """Return ``event`` (or a new one), already complete."""
        return event if event is not None else _CpuEvent()

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def query(self) -> bool:
        """Always complete."""
        return True


class _CpuEvent:
    """Stand-in for ``torch.cuda.Event``: always complete."""

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        """Nothing to record."""

    def wait(self, stream: Any = None) -> None:
        """Nothing to wait for."""

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def query(self) -> bool:
        """Always complete."""
        return True

    def elapsed_time(self, end_event: _CpuEvent) -> float:
        """Events carry no timestamps on CPU."""
        return 0.0


_CURRENT_STREAM = _CpuStream()


def _current_device() -> torch.device:
    return _CPU


def _no_op(*args: Any, **kwargs: Any) -> None:
    return None


def _current_stream(device: Any = None) -> _CpuStream:
    return _CURRENT_STREAM


def _stream(stream: Any) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


#: What the CPU view says of "the device": compute capability 9.0 (Hopper, the GPUs this
#: project's figures are of), so Megatron's checks by architecture take the H100 path.
_DEVICE_PROPERTIES = types.SimpleNamespace(name="cpu", major=9, minor=0, total_memory=0)


def _device_properties(device: Any = None) -> types.SimpleNamespace:
    return _DEVICE_PROPERTIES


def _device_capability(device: Any = None) -> tuple[int, int]:
    return _DEVICE_PROPERTIES.major, _DEVICE_PROPERTIES.minor


class _CudaOnCpu(types.ModuleType):
    """``torch.cuda`` as seen by a patched megatron module."""

    def __init__(self) -> None:
        super().__init__("torch.cuda")
        self.current_device = _current_device
        self.synchronize = _no_op
        self.empty_cache = _no_op
        self.Stream = _CpuStream
        self.Event = _CpuEvent
        self.current_stream = _current_stream
        self.default_stream = _current_stream
        self.stream = _stream
        self.get_device_properties = _device_properties
        self.get_device_capability = _device_capability
        # The device's generator is the CPU's (rerun state machine, checkpoint RNG state).
        self.get_rng_state = torch.get_rng_state
        self.set_rng_state = torch.set_rng_state
        self.nvtx = types.SimpleNamespace(
            range_push=_no_op, range_pop=_no_op, range=lambda *a, **k: contextlib.nullcontext()
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


def _is_cuda(device: Any) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _cuda_to_cpu(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(factory)
    def on_cpu(*args: Any, **kwargs: Any) -> torch.Tensor:
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = _CPU
        return factory(*args, **kwargs)

    return on_cpu


class _TorchOnCpu(types.ModuleType):
    """``torch`` as seen by a patched megatron module: the real one except for
    ``torch.cuda`` and ``device="cuda"`` in tensor factories."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CudaOnCpu()
        for name in _FACTORIES:
            setattr(self, name, _cuda_to_cpu(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


_TORCH_ON_CPU = _TorchOnCpu()


# --------------------------------------------------------------------------------------
# RNG tracker (CudaRNGStatesTracker in tensor_parallel/random.py).


class CpuRNGStatesTracker(_mrandom.CudaRNGStatesTracker):
    """Megatron's RNG tracker with its named states held as CPU generator states.

    ``fork(name)`` swaps the named state into torch's default CPU generator (what
    dropout draws from on CPU) and swaps it back out on exit, nesting as the CUDA
    tracker's ``fork`` does. Same seeds give the same dropout masks. Dropout
    outside a fork draws from the default CPU generator, which the caller seeds.
    ``use_cudagraphable_rng`` (Megatron-LM seeds with it under any CUDA-graph
    implementation) is kept as a flag only: the CUDA tracker asserts that torch can
    register generators with a CUDA graph, which a CPU build cannot and CPU states need
    not.
    """

    def __init__(
        self, use_cudagraphable_rng: bool = False, is_inference_rng_tracker: bool = False
    ) -> None:
        self.reset()
        self.use_cudagraphable_rng = use_cudagraphable_rng
        self.is_inference_rng_tracker = is_inference_rng_tracker

    def add(self, name: str, seed: int) -> None:
        """Track a new state ``name`` seeded with ``seed`` (both must be new)."""
        if seed in self.seeds_:
            raise RuntimeError(f"seed {seed} already exists")
        if name in self.states_:
            raise RuntimeError(f"rng state {name} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = _mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Draw from state ``name`` inside the block; the outer state resumes after."""
        if name not in self.states_:
            raise RuntimeError(f"rng state {name} is not added")
        outer_name = self._current_state_name
        outer_state = torch.get_rng_state()
        if outer_name != "default-rng":
            self.states_[outer_name] = outer_state
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            if outer_name != "default-rng":
                outer_state = self.states_[outer_name]
            torch.set_rng_state(outer_state)
            self._current_state_name = outer_name


def _patch_recompute_rng() -> None:
    """No CUDA generator state to save and restore around a recomputed forward on CPU."""
    _mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    _mrandom._set_cuda_rng_state = lambda *args, **kwargs: None


def _install_cpu_rng_tracker() -> None:
    # Megatron's initialize_rng_tracker instantiates the module's class.
    _mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker
    current = _mrandom._CUDA_RNG_STATE_TRACKER
    if current is not None and not isinstance(current, CpuRNGStatesTracker):
        _mrandom.initialize_rng_tracker(force_reset=True)


# --------------------------------------------------------------------------------------
# Tied embeddings (LanguageModule.setup_embeddings_and_output_layer).


class _TensorMethodOverride(TorchFunctionMode):
    """Within this mode a call of the tensor method ``method`` returns ``result(tensor, *args,
    **kwargs)`` (the mode is off while ``result`` runs, so it may call the method itself)."""

    def __init__(self, method: Callable[..., Any], result: Callable[..., Any]):
        super().__init__()
        self._method, self._result = method, result

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func is self._method:
            return self._result(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def _tensor_cuda_is_identity() -> TorchFunctionMode:
    """Within this mode ``tensor.cuda()`` returns the tensor itself."""
    return _TensorMethodOverride(torch.Tensor.cuda, lambda tensor, *_, **__: tensor)


def _record_stream_is_no_op() -> TorchFunctionMode:
    """Within this mode ``tensor.record_stream(stream)`` does nothing: CPU work runs in
    order, and CPU tensors have no ``record_stream``."""
    return _TensorMethodOverride(torch.Tensor.record_stream, lambda *_, **__: None)


def schedule_plan_context() -> contextlib.AbstractContextManager[None]:
    """Where Megatron's schedule plan runs (MoE all-to-all overlap): on CPU, its nodes'
    ``record_stream`` calls (made on tensors they free) do nothing; a no-op context with
    CUDA or when the compatibility layer is not applied."""
    return _record_stream_is_no_op() if _applied else contextlib.nullcontext()


def _cuda_type_name(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """``tensor.type()`` naming a CPU tensor as its CUDA type; a conversion as it is."""
    result = torch.Tensor.type(tensor, *args, **kwargs)
    if args or kwargs or ".cuda." in result:
        return result
    return result.replace("torch.", "torch.cuda.", 1)


def _cpu_types_look_cuda() -> TorchFunctionMode:
    """Within this mode ``tensor.type()`` names CPU tensors as their CUDA types."""
    return _TensorMethodOverride(torch.Tensor.type, _cuda_type_name)


def _patch_distributed_optimizer_types() -> None:
    """``DistributedOptimizer._build_model_and_main_param_groups`` sorts parameters by
    ``type() == 'torch.cuda.FloatTensor'``."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._build_model_and_main_param_groups
    DistributedOptimizer._build_model_and_main_param_groups = staticmethod(
        _within(_cpu_types_look_cuda, original)
    )


def _patch_float16_optimizer_types() -> None:
    """``Float16OptimizerWithFloat16Params.__init__`` (bf16/fp16 training) sorts parameters
    into fp16/bf16 and fp32 groups by ``param.type()`` naming CUDA tensor types."""
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    original = Float16OptimizerWithFloat16Params.__init__
    Float16OptimizerWithFloat16Params.__init__ = _within(_cpu_types_look_cuda, original)


def _make_tensor_cuda_identity_in_embedding_setup() -> None:
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule.setup_embeddings_and_output_layer
    LanguageModule.setup_embeddings_and_output_layer = _within(
        _tensor_cuda_is_identity, original
    )


def _within(
    mode: Callable[[], TorchFunctionMode], original: Callable[..., Any]
) -> Callable[..., Any]:
    """``original``, called inside a fresh ``mode()``."""

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with mode():
            return original(*args, **kwargs)

    return wrapped


# --------------------------------------------------------------------------------------
# MoE (RouterGatingLinearFunction.forward, MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize).


def _split_sizes_to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """``moe_utils.maybe_move_tensor_to_cpu`` for CPU tensors: numpy when asked."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.detach().cpu().numpy()
    return tensor


def _patch_moe() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    token_dispatcher.maybe_move_tensor_to_cpu = _split_sizes_to_host


def _patch_mla_without_te() -> None:
    """``MLASelfAttention.__init__`` tests ``isinstance(linear_proj, TELinear)`` when its
    module's ``HAVE_TE`` is set, which 0.16.1 sets from importing the TE extension's names;
    without Transformer Engine those are stand-ins, not types."""
    from megatron.core.extensions import transformer_engine
    from megatron.core.transformer import multi_latent_attention

    if not getattr(transformer_engine, "HAVE_TE", False):
        multi_latent_attention.HAVE_TE = False


# --------------------------------------------------------------------------------------
# Gradient clipping (clip_grad_by_total_norm_fp32 in optimizer/clip_grads.py).


def _clip_grad_by_total_norm_fp32(
    parameters: Any, max_norm: float, total_norm: float, use_decoupled_grad: bool = False
) -> None:
    """``clip_grads.clip_grad_by_total_norm_fp32`` with its CUDA-only type assertion
    relaxed to fp32 on any device; scales exactly as its fallback kernel does
    (``local_multi_tensor_scale`` in megatron/core/utils.py: ``dst.copy_(src * scale)``)."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = []
    for param in parameters:
        grad = getattr(param, attr, None)
        if grad is None:
            continue
        allowed = (torch.float32, torch.bfloat16) if use_decoupled_grad else (torch.float32,)
        if grad.dtype not in allowed:
            raise TypeError(f"gradient clipping expects {allowed} gradients, got {grad.dtype}")
        grads.append(grad.detach())
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for grad in grads:
            grad.copy_(grad * clip_coeff)


def _patch_grad_clipping() -> None:
    from megatron.core.optimizer import optimizer

    optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
