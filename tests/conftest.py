"""Session fixtures in place of import-time side effects, switched on by the markers
registered in pyproject.toml (``slow``, ``multiproc``, ``megatron``, ``route``; the fast
loop is ``python -m pytest -m "not slow"``):

- a session that runs a test marked ``megatron`` first applies Megatron-Core's CPU
  compatibility layer (:func:`~megatron_dualpipe.megatron.compat.cpu_compat.apply_cpu_compat`,
  a no-op with CUDA) and, on CPU, torch.compile's eager stance, once and before any worker
  forks, so every worker inherits both;
- a session that runs a test marked ``multiproc`` first pays torch's lazy imports, once in
  the parent rather than once per forked worker.

Both are session-scoped and autouse, so they run before any module-scoped fixture forks.
A test marked ``route`` (it runs ``train``: Megatron-LM's loop) is skipped where the
megatron-core installed does not ship the ``megatron/training`` it runs (0.16 to 0.18).
``--write-golden`` makes the tests that compare with checked-in losses write them instead.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--write-golden",
        action="store_true",
        help="write the checked-in losses of tests/golden/ from this run instead of comparing "
        "with them (review the diff before committing it)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the ``route`` tests where Megatron-LM's loop cannot run (read from disk, nothing
    of megatron imported)."""
    from megatron_dualpipe.megatron.compat.version import route_training_installed

    if route_training_installed():
        return
    skip = pytest.mark.skip(reason="Megatron-LM's loop needs megatron-core 0.19 (Python 3.12)")
    for item in items:
        if item.get_closest_marker("route") is not None:
            item.add_marker(skip)


def _runs_marked(session: pytest.Session, marker: str) -> bool:
    return any(item.get_closest_marker(marker) is not None for item in session.items)


@pytest.fixture(scope="session", autouse=True)
def cpu_compat(request: pytest.FixtureRequest) -> Iterator[None]:
    """Megatron-Core's CPU compatibility layer, where the session runs Megatron tests, and
    on CPU ``torch.compile`` turned off for the session as ``train`` turns it off in its
    ranks (Megatron-Core's fused functions run eagerly: compiling them cost each forked rank
    of an MoE test about 6 s)."""
    if _runs_marked(request.session, "megatron"):
        from megatron_dualpipe.megatron.compat.cpu_compat import apply_cpu_compat
        from megatron_dualpipe.megatron.compat.cpu_compat_training import eager_on_cpu

        apply_cpu_compat()
        with eager_on_cpu():
            yield
        return
    yield


@pytest.fixture(scope="session", autouse=True)
def torch_warm_up(request: pytest.FixtureRequest) -> None:
    """Where the session forks workers: the first backward from a non-scalar output imports
    torch.fx (~1 s), the first optimizer step torch._dynamo (~2 s); pay both here."""
    if _runs_marked(request.session, "multiproc"):
        param = torch.nn.Parameter(torch.ones(2))
        torch.autograd.backward(param * 2, torch.ones(2))
        torch.optim.SGD([param], lr=0.1).step()


def pytest_unconfigure(config: pytest.Config) -> None:
    """Leave torch's and Megatron-Core's module graphs to the process's end instead of a
    last garbage collection over them (about 2 s of every run's exit)."""
    gc.freeze()
