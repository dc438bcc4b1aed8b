"""``CUDA_DEVICE_MAX_CONNECTIONS`` by Megatron-LM's rule (``validate_args`` in
``megatron/training/arguments.py``, core_v0.16.1 and core_v0.19.0): 1 with tensor
parallelism, never forced to 1 with ``overlap_moe_expert_parallel_comm`` (its all-to-all
runs beside compute, nor with FSDP or the UCC backend), no requirement otherwise; ``train``
sets it from the config before anything asks CUDA and keeps what the launching shell
exported, with a warning where that works against the rule."""

from __future__ import annotations

import os

import pytest

from megatron_dualpipe.megatron.schedule.checks import cuda_device_max_connections


@pytest.mark.parametrize(
    ("tp", "overlap", "current", "value", "warns"),
    [
        (2, False, None, "1", False),  # TP: one hardware queue, as Megatron-LM requires
        (1, False, None, None, False),  # no TP: CUDA's default
        (1, True, None, None, False),  # overlap: never 1
        (2, True, None, None, False),  # TP and overlap: Megatron-LM only warns; not 1
        (1, True, "1", None, True),  # 1 defeats the all-to-all overlap
        (2, False, "8", None, True),  # Megatron-LM asserts 1 with TP before Blackwell
        (2, False, "1", None, False),
        (1, False, "8", None, False),
    ],
)
def test_megatron_lms_rule(
    tp: int, overlap: bool, current: str | None, value: str | None, warns: bool
) -> None:
    got, warning = cuda_device_max_connections(tensor_parallel=tp, overlap=overlap, current=current)
    assert got == value and (warning is not None) is warns
    if warning is not None:
        assert "\n" not in warning and warning.startswith("CUDA_DEVICE_MAX_CONNECTIONS=")


def test_train_sets_it_before_any_rank_and_keeps_an_exported_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from megatron_dualpipe.megatron import lm_launch

    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    lm_launch.set_cuda_device_max_connections({"tensor_model_parallel_size": 2})
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    for fsdp in ({"use_torch_fsdp2": True}, {"pipeline_model_parallel_comm_backend": "ucc"}):
        lm_launch.set_cuda_device_max_connections({"tensor_model_parallel_size": 2, **fsdp})
        assert "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ  # Megatron asserts it is not 1
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    said = lm_launch.set_cuda_device_max_connections({"overlap_moe_expert_parallel_comm": True})
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"  # the shell's, kept
    assert "cannot run beside compute" in said
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")  # a size Megatron-LM's parser refuses
    lm_launch.set_cuda_device_max_connections({"tensor_model_parallel_size": "two"})
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ  # was a ValueError's traceback
