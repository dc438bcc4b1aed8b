"""The megatron-core releases this adapter supports, and every difference between them.

Supported: megatron-core ``>=0.16.1,<0.20`` (:data:`SUPPORTED_MEGATRON_CORE`; tested:
:data:`TESTED_MEGATRON_CORE`). Importing the adapter with another release raises
:class:`MegatronVersionError` before any of its code meets megatron-core
(:func:`refuse_unsupported_at_import`). Every difference between the supported releases
that this package meets is a gate here, named by what differs (e.g.
:func:`mtp_inner_layer_name`, :func:`cuda_graph_setting`, :func:`megatron_lm_tag`); the
module that needs one calls it and holds no release check of its own. The list, what each
difference broke, and the differences taken without a gate: docs/megatron-versions.md.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import DualPipeError

if TYPE_CHECKING:
    from packaging.version import Version

__all__ = [
    "MEGATRON_LM_TAGS",
    "SUPPORTED_MEGATRON_CORE",
    "TESTED_MEGATRON_CORE",
    "MegatronVersionError",
    "clean_mtp_tracker",
    "common_state_in_dcp",
    "cuda_graph_setting",
    "installed_megatron_core",
    "layer_plan_attention_node",
    "layer_plan_nodes",
    "megatron_lm_tag",
    "mtp_block_on_any_chunk",
    "mtp_inner_layer_name",
    "mtp_tracker_fields",
    "refuse_unsupported_at_import",
    "route_training_installed",
    "save_mtp_metrics",
    "unsupported_megatron_core",
    "version_on_disk",
]

#: The megatron-core releases the adapter supports (setup.py's extras say the same).
SUPPORTED_MEGATRON_CORE = ">=0.16.1,<0.20"
#: One release of each supported minor, the ones CI runs.
TESTED_MEGATRON_CORE = ("0.16.1", "0.17.1", "0.18.2", "0.19.2")


#: The Megatron-LM tag of each supported minor release, whose patch
#: (``patches/megatron-lm-<tag>.patch``) goes with it; the wheels of 0.17 and newer ship
#: that tag's ``megatron/training`` (0.19.2's is core_v0.19.0's).
MEGATRON_LM_TAGS = {
    "0.16": "core_v0.16.1",
    "0.17": "core_v0.17.1",
    "0.18": "core_v0.18.2",
    "0.19": "core_v0.19.0",
}
#: The tag whose ``megatron/training`` (shipped in that megatron-core's wheel) Megatron-LM's
#: loop runs (``train``, ``megatron.pretrain_gpt``).
ROUTE_MEGATRON_LM_TAG = "core_v0.19.0"


class MegatronVersionError(DualPipeError, RuntimeError):
    """The installed megatron-core is outside :data:`SUPPORTED_MEGATRON_CORE`."""


def installed_megatron_core() -> str:
    """The release of the megatron-core imported in this process: its ``__version__``
    without a local part (from 0.19, a megatron-core installed inside a git work tree, a
    venv in a project's checkout say, appends that tree's commit: ``0.19.2+90aaa6a``)."""
    from megatron import core

    return _release(str(core.__version__)).public


def _release(version: str) -> Version:
    from packaging.version import Version  # a dependency of megatron-core

    return Version(version)


def unsupported_megatron_core(version: str) -> str | None:
    """The one-sentence refusal of megatron-core ``version``, or None when it is supported."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion

    try:
        if SpecifierSet(SUPPORTED_MEGATRON_CORE).contains(_release(version), prereleases=True):
            return None
    except InvalidVersion:
        pass
    return (
        f"megatron-dualpipe supports megatron-core {SUPPORTED_MEGATRON_CORE} but megatron-core "
        f"{version} is installed: pip install 'megatron-core{SUPPORTED_MEGATRON_CORE}' "
        f"(the releases tested are {', '.join(TESTED_MEGATRON_CORE[:-1])} and "
        f"{TESTED_MEGATRON_CORE[-1]})"
    )


def version_on_disk() -> str | None:
    """The ``__version__`` of the megatron-core that ``import megatron.core`` would load, read
    from its ``package_info.py`` as text (nothing of megatron is imported or run); None when
    there is none or the file does not say."""
    try:
        spec = importlib.util.find_spec("megatron")  # a top-level name: nothing is imported
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    cores = [Path(loc) / "core" for loc in locations if (Path(loc) / "core").is_dir()]
    if not cores:
        return None
    try:
        tree = ast.parse((cores[0] / "package_info.py").read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None
    values: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    values[target.id] = node.value.value
    if not all(isinstance(values.get(k), int) for k in ("MAJOR", "MINOR", "PATCH")):
        return None
    return f"{values['MAJOR']}.{values['MINOR']}.{values['PATCH']}{values.get('PRE_RELEASE', '')}"


def _version_to_import() -> str | None:
    """The ``__version__`` of the megatron-core this process has imported, else of the one
    it would import (:func:`version_on_disk`); None without one."""
    import sys

    loaded = sys.modules.get("megatron.core")
    version = getattr(loaded, "__version__", None) if loaded is not None else version_on_disk()
    return None if version is None else str(version)


def _minor(version: str) -> str:
    """``0.19`` of ``0.19.2`` (the key of :data:`MEGATRON_LM_TAGS`)."""
    major, minor = _release(version).release[:2]
    return f"{major}.{minor}"


def route_training_installed() -> bool:
    """Whether the megatron-core this process would import (or has imported) is the release
    whose wheel's ``megatron/training`` Megatron-LM's loop runs (:data:`ROUTE_MEGATRON_LM_TAG`);
    read from its ``package_info.py`` when not imported yet, nothing of megatron run."""
    version = _version_to_import()
    return version is not None and MEGATRON_LM_TAGS.get(_minor(version)) == ROUTE_MEGATRON_LM_TAG


def refuse_unsupported_at_import() -> None:
    """Called when the adapter package is imported: raise :class:`MegatronVersionError` when
    the megatron-core this process would import (or has imported) is not supported. Without
    megatron-core nothing is said here (its import fails where it is needed, and the CLI
    names the missing packages)."""
    version = _version_to_import()
    if version is not None:
        problem = unsupported_megatron_core(version)
        if problem is not None:
            raise MegatronVersionError(problem)


def megatron_lm_tag() -> str:
    """The Megatron-LM tag (:data:`MEGATRON_LM_TAGS`) of the imported megatron-core."""
    return MEGATRON_LM_TAGS[_minor(installed_megatron_core())]


def _since(release: str) -> bool:
    """Whether the imported megatron-core is ``release`` or newer."""
    return _release(installed_megatron_core()).release >= _release(release).release


# --------------------------------------------------------------------------------------
# The gates, each named by what differs.


def layer_plan_attention_node() -> str:
    """The name (attribute and node name) of a ``TransformerLayerSchedulePlan``'s attention
    node: ``attn``; from 0.19 ``pre_dispatch_computation``."""
    return "pre_dispatch_computation" if _since("0.19") else "attn"


def layer_plan_nodes(layer: Any) -> list[Any]:
    """A ``TransformerLayerSchedulePlan``'s two compute nodes with a ``backward_dw``:
    attention (:func:`layer_plan_attention_node`), then MLP."""
    return [getattr(layer, layer_plan_attention_node()), layer.mlp]


def mtp_inner_layer_name() -> str:
    """The attribute (and parameter-name part) of an MTP layer's transformer layer:
    ``transformer_layer``; from 0.17 ``mtp_model_layer``."""
    return "mtp_model_layer" if _since("0.17") else "transformer_layer"


@contextlib.contextmanager
def mtp_block_on_any_chunk() -> Iterator[None]:
    """Build model chunks inside this block. From 0.17 ``MultiTokenPredictionBlock``
    asserts it is built on the last virtual pipeline stage (``is_vp_last_stage``, whose only
    use in its module that assertion is); our placements put the MTP block where the loss
    is, which under dualpipe is chunk 0 of the last rank. Inside the block the assertion
    holds for any chunk; outside, Megatron's function is back."""
    if not _since("0.17"):
        yield
        return
    from megatron.core.transformer import multi_token_prediction

    original = multi_token_prediction.is_vp_last_stage
    multi_token_prediction.is_vp_last_stage = lambda *args, **kwargs: True
    try:
        yield
    finally:
        multi_token_prediction.is_vp_last_stage = original


def mtp_tracker_fields() -> tuple[str, ...]:
    """The entries of ``MTPLossLoggingHelper.tracker`` holding per-MTP-layer sums, the loss
    first: ``("values",)``; from 0.19 ``("loss_values", "correct_values", "total_values")``
    (the acceptance counts beside the loss)."""
    if _since("0.19"):
        return ("loss_values", "correct_values", "total_values")
    return ("values",)


def clean_mtp_tracker() -> None:
    """Zero Megatron's MTP tracker (``clean_loss_in_tracker``; 0.19:
    ``clean_metrics_in_tracker``)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    if _since("0.19"):
        MTPLossLoggingHelper.clean_metrics_in_tracker()
    else:
        MTPLossLoggingHelper.clean_loss_in_tracker()


def save_mtp_metrics(values: list[Any], layer: int, num_layers: int, avg_group: Any) -> None:
    """Record one MTP layer's sums in Megatron's tracker, ``values`` in the order of
    :func:`mtp_tracker_fields` (``save_loss_to_tracker``; 0.19: ``save_metrics_to_tracker``
    with the acceptance counts)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    if _since("0.19"):
        loss, correct, total = values
        MTPLossLoggingHelper.save_metrics_to_tracker(
            loss, correct, total, layer, num_layers, avg_group=avg_group
        )
    else:
        (loss,) = values
        MTPLossLoggingHelper.save_loss_to_tracker(loss, layer, num_layers, avg_group=avg_group)


def common_state_in_dcp() -> bool:
    """Whether ``dist_checkpointing.save`` writes the common (non-sharded) state inside the
    DCP checkpoint (a ShardedObject, 0.19) rather than into ``common.pt``. Loading reads
    both in 0.19 (``load_common_state_dict``)."""
    return _since("0.19")


def cuda_graph_setting(args: Any) -> tuple[str, tuple[str, ...]]:
    """The CUDA-graph implementation and the graphed parts of Megatron-LM's validated
    ``args`` (or a ``TransformerConfig``), in megatron-core 0.18's names: 0.18 and newer
    read ``cuda_graph_impl`` and ``cuda_graph_modules``; before, ``cuda_graph_scope``, where
    ``full_iteration`` under ``local`` is the implementation full_iteration. Enum members
    are read by name; ``full`` (Megatron's old spelling of the whole layer) is dropped."""
    impl = getattr(args, "cuda_graph_impl", "none") or "none"
    key = "cuda_graph_modules" if _since("0.18") else "cuda_graph_scope"
    raw = getattr(args, key, None) or []
    if isinstance(raw, str):
        raw = raw.split(",")
    names = tuple(getattr(m, "name", str(m)) for m in raw)
    names = tuple(n for n in names if n != "full")
    if impl == "local" and "full_iteration" in names:
        return "full_iteration", tuple(n for n in names if n != "full_iteration")
    return impl, names
