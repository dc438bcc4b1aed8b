"""Every line of the package that only a CUDA run executes is on an explicit, short list.

The CPU suite runs the code a GPU run runs (the pipeline group, the batched transport and
its set-up, the mirror's slices, TE's graph buffers modelled): what it cannot run are the
device calls themselves. ``tests/device_lines.py`` finds, in the source, every branch
taken only where CUDA is there (or only where it is not, with the rest of the function
after it); this test holds that set to :data:`ALLOWED`, each entry a raw device call or
choice with the reason it cannot run here. A new device-only branch fails this test until
it is listed (or, better, made a parameter the CPU tests take). At bcbafdb, before issue
35, the same finder counted 53 such lines in 22 functions; after it, 20 in 16.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from tests.device_lines import device_branches, source_branches

PACKAGE = Path(__file__).resolve().parent.parent / "megatron_dualpipe"

#: ``path:function``: device-only lines, and what they do.
ALLOWED: dict[str, tuple[int, str]] = {
    "megatron_dualpipe/megatron/compat/cpu_compat.py:apply_cpu_compat": (
        1,
        "returns at once with CUDA: the CPU patches are not applied",
    ),
    "megatron_dualpipe/megatron/compat/cpu_compat_training.py:_cuda_device_is_cpu": (
        1,
        "the CPU compat layer maps a requested CUDA device to the CPU",
    ),
    "megatron_dualpipe/megatron/compat/cpu_compat_training.py:megatron_training_on_cpu": (
        2,
        "a null context with CUDA",
    ),
    "megatron_dualpipe/megatron/grads/loss_reports.py:_pipeline_mtp_sum": (
        1,
        "the MTP tracker's sum on torch.cuda.current_device()",
    ),
    "megatron_dualpipe/megatron/model/seeding.py:_random_state_kept": (
        1,
        "torch.cuda.get_rng_state_all(), put back after the 1F1B replay",
    ),
    "megatron_dualpipe/megatron/compat/cpu_compat_training.py:eager_on_cpu": (
        1,
        "torch.compile stays on with CUDA (a null context)",
    ),
    "megatron_dualpipe/runtime/latency.py:p2p_latency_s": (
        1,
        "the probe's tensors on CUDA where the backend is NCCL",
    ),
    "megatron_dualpipe/runtime/timeline.py:clock_for": (
        1,
        "CUDA events as the timeline's clock",
    ),
    "megatron_dualpipe/runtime/transport.py:GroupTransport.__init__": (
        1,
        "waits on a device are stream waits watched by the hang monitor (the tests' "
        "NCCL-rules emulation runs that path on CPU)",
    ),
}


def test_the_device_only_lines_are_the_listed_ones() -> None:
    found = {b.where: len(b.lines) for b in device_branches(PACKAGE)}
    allowed = {where: count for where, (count, _) in ALLOWED.items()}
    new = {w: n for w, n in found.items() if allowed.get(w) != n}
    gone = sorted(set(allowed) - set(found))
    assert not new, f"device-only lines not listed (or grown): {new}"
    assert not gone, f"listed, no longer device-only: {gone}"
    print(f"\n{sum(found.values())} device-only lines in {len(found)} functions")
    assert sum(found.values()) <= 20


def test_the_finder_sees_each_kind_of_device_branch() -> None:
    source = textwrap.dedent(
        """
        def plain(x):
            if x.device.type == "cuda":
                sync()
                record()
            return x

        def early(device):
            if device.type == "cpu":
                return None
            make_group()
            return True

        def negated():
            if not torch.cuda.is_available():
                return "cpu"
            else:
                return torch.cuda.current_device()

        def expression(group):
            return "cuda" if dist.get_backend(group) == "nccl" else "cpu"

        def neither(backend):
            if backend == "nccl":
                check()
        """
    )
    found = {b.where: b.lines for b in source_branches(source, "m")}
    assert found == {
        "m:plain": (4, 5),
        "m:early": (11, 12),
        "m:negated": (18,),
        "m:expression": (21,),
    }
