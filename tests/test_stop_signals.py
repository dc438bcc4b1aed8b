"""SIGTERM to a whole task (srun ends a step so, and ``--kill-on-bad-exit`` does when a rank
dies): the process stops with its one line, not a traceback. Before, torch's DataLoader
handler for SIGCHLD raised over the unwinding once srun's SIGTERM had ended a worker, and a
rank that had already reported its lost peer lost that report to ``terminated``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from megatron_dualpipe.cli import command, common
from megatron_dualpipe.cli.common import Terminated
from megatron_dualpipe.runtime import PipelineWaitError

#: A process with two DataLoader workers made inside ``unwind_on_stop_signals``, as a
#: rank's are; once stopped, it waits for both workers to have ended (without reaping them,
#: so that a SIGCHLD handler still sees them) and then runs on.
WORKERS_THEN_STOP = textwrap.dedent("""
    import os, sys, torch
    from megatron_dualpipe.cli.common import Terminated, unwind_on_stop_signals
    try:
        with unwind_on_stop_signals():
            batches = iter(torch.utils.data.DataLoader(range(8), num_workers=2))
            next(batches)
            workers = [worker.pid for worker in batches._workers]
            print("ready", flush=True)
            sys.stdin.read()
    except Terminated:
        ended = [os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT) for pid in workers]
        print("workers ended by", sorted({info.si_status for info in ended}))
""")


@pytest.mark.slow
def test_sigterm_to_the_whole_task_unwinds_without_the_dataloader_s_traceback(
    tmp_path: Path,
) -> None:
    script = tmp_path / "workers_then_stop.py"
    script.write_text(WORKERS_THEN_STOP)
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "ready"
        os.killpg(proc.pid, signal.SIGTERM)  # from outside the group, as slurmstepd's
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out
    assert out.strip() == f"workers ended by [{int(signal.SIGTERM)}]", out


def test_a_fault_reported_before_the_stop_is_said_first(monkeypatch, capsys) -> None:
    def lose_the_peer_then_stop(args: object) -> None:
        try:
            raise PipelineWaitError(0, "RECV_F3", 1, 0.2, "the connection broke")
        except PipelineWaitError:
            raise Terminated(signal.SIGTERM) from None

    fake = types.SimpleNamespace(
        add=lambda sub: sub.add_parser("train"), run=lose_the_peer_then_stop
    )
    monkeypatch.setitem(command.COMMANDS, "train", fake)
    assert command.main(["train"]) == 128 + signal.SIGTERM
    assert capsys.readouterr().err.splitlines() == [
        "megatron-dualpipe: error: pipeline rank 0 gave up on RECV_F3 (peer: rank 1) after "
        "0.2 s: the connection broke",
        "megatron-dualpipe: train terminated (SIGTERM)",
    ]


def test_a_plain_stop_is_one_line(monkeypatch, capsys) -> None:
    def stop(args: object) -> None:
        raise Terminated(signal.SIGHUP)

    fake = types.SimpleNamespace(add=lambda sub: sub.add_parser("train"), run=stop)
    monkeypatch.setitem(command.COMMANDS, "train", fake)
    assert command.main(["train"]) == 128 + signal.SIGHUP
    assert capsys.readouterr().err == "megatron-dualpipe: train terminated (SIGHUP)\n"


def test_torch_s_handler_run_within_the_switch_still_stops_with_terminated(monkeypatch) -> None:
    """A worker ended by the same SIGTERM can run torch's DataLoader SIGCHLD handler within
    the stop's switch of SIGCHLD to its default (its RuntimeError escaped once in a
    clean-clone CI run of the test above): the stop still raises Terminated, SIGCHLD at its
    default."""
    real, before = signal.signal, signal.getsignal(signal.SIGCHLD)
    calls: list[int] = []

    def torch_s_handler_first(signum: int, handler: object) -> object:
        calls.append(signum)
        if len(calls) == 1:
            raise RuntimeError("DataLoader worker (pid 4242) is killed by signal: Terminated.")
        return real(signum, handler)

    monkeypatch.setattr(signal, "signal", torch_s_handler_first)
    try:
        with pytest.raises(Terminated):
            common._terminate(signal.SIGTERM, None)
        assert calls == [signal.SIGCHLD, signal.SIGCHLD]
        assert signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL
    finally:
        real(signal.SIGCHLD, before)
