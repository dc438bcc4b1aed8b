"""``preprocess`` at Megatron-LM's level and under faults: ``--workers`` (the files do not
depend on it), ``--json-keys`` (one dataset per key, Megatron-LM's names), the run's
throughput line; a bad line named by its line number (a non-UTF-8 one included, in any
chunk, with any number of workers), a document past ``--max-document-chars``, an output
that cannot be written (a file in the way, a read-only file system, a full disk: one
sentence naming the dataset, nothing left), a second run onto a locked prefix, SIGTERM.

The read-only and full file systems are real: a tmpfs mounted in a private mount namespace
(``unshare -rm``); those tests are skipped where the kernel does not allow one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from megatron_dualpipe.megatron.data.preprocess import (
    CHUNK_BYTES,
    PreprocessError,
    dataset_prefix,
    preprocess,
)
from tests.corpus import train_tokenizer, write_corpus

pytestmark = [pytest.mark.megatron]

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tokenizer")
    return train_tokenizer(write_corpus(root / "corpus.jsonl"), root / "tokenizer")


@pytest.fixture(scope="module")
def big_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 2.6 MB: three chunks of lines."""
    path = tmp_path_factory.mktemp("big") / "big.jsonl"
    write_corpus(path, documents=15_000, seed=1)
    assert path.stat().st_size > 2 * CHUNK_BYTES
    return path


def _files(prefix: str) -> tuple[bytes, bytes]:
    return Path(prefix + ".bin").read_bytes(), Path(prefix + ".idx").read_bytes()


def _one_sentence(err: BaseException, *parts: str) -> str:
    text = str(err)
    assert "\n" not in text and all(p in text for p in parts), text
    return text


def _cli(*args: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "megatron_dualpipe", "preprocess", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


# --------------------------------------------------------------------------------------
# Megatron-LM's flags.


@pytest.mark.slow
def test_two_workers_write_the_same_bytes_as_one(
    tokenizer: Path, big_corpus: Path, tmp_path: Path
) -> None:
    one = preprocess(big_corpus, tokenizer, str(tmp_path / "one"), workers=1)
    two = preprocess(big_corpus, tokenizer, str(tmp_path / "two"), workers=2)
    assert one.written[0].documents == two.written[0].documents == 15_000
    assert one.written[0].tokens == two.written[0].tokens > 15_000 * 10
    assert _files(one.written[0].prefix) == _files(two.written[0].prefix)
    assert two.workers == 2 and two.bytes_read == big_corpus.stat().st_size


def test_json_keys_write_one_dataset_per_key_as_megatron_names_them(
    tokenizer: Path, tmp_path: Path
) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.tokenizers import MegatronTokenizer

    corpus = tmp_path / "pairs.jsonl"
    records = [{"text": f"the cat sees {n} boats", "title": f"boat {n}"} for n in range(5)]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    made = preprocess(corpus, tokenizer, str(tmp_path / "out" / "p"), json_keys=["text", "title"])
    assert [w.prefix for w in made.written] == [
        str(tmp_path / "out" / "p_text_document"),
        str(tmp_path / "out" / "p_title_document"),
    ]
    megatron_tokenizer = MegatronTokenizer.from_pretrained(
        str(tokenizer), metadata_path={"library": "huggingface"}, use_fast=True
    )
    for written in made.written:
        dataset = IndexedDataset(written.prefix)
        assert len(dataset) == written.documents == 5
        expected = [*megatron_tokenizer.tokenize(records[3][written.key]), megatron_tokenizer.eod]
        assert list(dataset[3]) == expected
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "p_text_document.bin",
        "p_text_document.idx",
        "p_title_document.bin",
        "p_title_document.idx",
    ]


@pytest.mark.slow
def test_the_command_prints_each_dataset_and_the_throughput(
    tokenizer: Path, big_corpus: Path, tmp_path: Path
) -> None:
    proc = _cli(
        "--input", str(big_corpus), "--tokenizer", str(tokenizer),
        "--output-prefix", str(tmp_path / "c"), "--workers", "2",
    )  # fmt: skip
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    lines = out.splitlines()
    assert lines[0].startswith(f"wrote {tmp_path}/c_text_document.bin and ")
    assert ": 15,000 documents, " in lines[0]
    assert " MB in " in lines[1] and " with 2 worker(s): " in lines[1]
    assert lines[1].endswith(" MB/s") and " documents/s, " in lines[1]


# --------------------------------------------------------------------------------------
# Bad lines: the line number, in any chunk, with any number of workers.


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.slow
def test_a_bad_line_in_a_later_chunk_is_named_by_its_line_number(
    tokenizer: Path, big_corpus: Path, tmp_path: Path, workers: int
) -> None:
    lines = big_corpus.read_bytes().splitlines(keepends=True)
    lines[12_345] = b'{"text": "caf\xe9 latin-1"}\n'
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"".join(lines))
    with pytest.raises(PreprocessError) as info:
        preprocess(bad, tokenizer, str(tmp_path / "out" / "bad"), workers=workers)
    _one_sentence(
        info.value,
        f"{bad} line 12346: not UTF-8 text (invalid continuation byte at byte 14 of the line)",
        "save the corpus as UTF-8",
    )
    assert not list((tmp_path / "out").iterdir())


def test_a_document_past_max_document_chars_is_refused_naming_the_line(
    tokenizer: Path, tmp_path: Path
) -> None:
    corpus = tmp_path / "long.jsonl"
    corpus.write_text(
        '{"text": "short"}\n\n' + json.dumps({"text": "ab " * 1_400_000}) + "\n", "utf-8"
    )
    began = time.monotonic()
    with pytest.raises(PreprocessError) as info:
        preprocess(corpus, tokenizer, str(tmp_path / "out" / "long"))
    assert time.monotonic() - began < 30  # refused before the tokenizer sees it
    _one_sentence(
        info.value,
        f"{corpus} line 3: ",
        '"text" document is 4,200,000 characters, more than --max-document-chars 4,000,000',
        "raise --max-document-chars",
    )
    assert not list((tmp_path / "out").iterdir())


# --------------------------------------------------------------------------------------
# The output: locked, written as a pair, one sentence when it cannot be written.


def test_a_second_run_onto_a_locked_prefix_is_refused_in_one_sentence(
    tokenizer: Path, tmp_path: Path
) -> None:
    corpus = write_corpus(tmp_path / "c.jsonl", documents=3)
    prefix = dataset_prefix(str(tmp_path / "out" / "c"), "text")
    (tmp_path / "out").mkdir()
    with open(prefix + ".lock", "w") as held:  # what a running preprocess holds
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(PreprocessError) as info:
            preprocess(corpus, tokenizer, str(tmp_path / "out" / "c"))
    _one_sentence(
        info.value,
        f"--output-prefix: another preprocess is writing {prefix}.bin and .idx",
        "choose another --output-prefix",
    )
    assert not Path(prefix + ".bin").exists()
    made = preprocess(corpus, tokenizer, str(tmp_path / "out" / "c"))  # released: it runs
    assert made.written[0].documents == 3
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "c_text_document.bin",
        "c_text_document.idx",
    ]


def test_a_rerun_replaces_both_files_of_the_pair(tokenizer: Path, tmp_path: Path) -> None:
    small = write_corpus(tmp_path / "small.jsonl", documents=3)
    large = write_corpus(tmp_path / "large.jsonl", documents=30, seed=5)
    preprocess(small, tokenizer, str(tmp_path / "a"))
    again = preprocess(large, tokenizer, str(tmp_path / "a"))
    fresh = preprocess(large, tokenizer, str(tmp_path / "b"))
    assert _files(again.written[0].prefix) == _files(fresh.written[0].prefix)


def test_a_file_in_the_way_of_the_output_folder_is_one_sentence(
    tokenizer: Path, tmp_path: Path
) -> None:
    corpus = write_corpus(tmp_path / "c.jsonl", documents=3)
    (tmp_path / "data").write_text("not a folder")
    with pytest.raises(PreprocessError) as info:
        preprocess(corpus, tokenizer, str(tmp_path / "data" / "corpus"))
    text = _one_sentence(
        info.value,
        f"--output-prefix: cannot write {tmp_path}/data/corpus_text_document.bin/.idx: ",
        f"{tmp_path}/data is a file, not a folder",
        "choose another --output-prefix",
    )
    assert "Errno" not in text


def _unshare_available() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0
    except OSError:
        return False


needs_mount = pytest.mark.skipif(
    not _unshare_available(), reason="no private mount namespace (unshare -rm) here"
)


def _on_tmpfs(options: str, tokenizer: Path, corpus: Path, folder: Path) -> tuple[str, str]:
    """Run preprocess onto a tmpfs mounted at ``folder`` with ``options``, in a private
    mount namespace; its stderr and what the tmpfs holds afterwards."""
    script = (
        f'mount -t tmpfs -o {options} tmpfs "$1" || exit 99; '
        f'"$2" -m megatron_dualpipe preprocess --input "$3" --tokenizer "$4" '
        '--output-prefix "$1/corpus" --workers 2; '
        'echo "rc=$?"; ls -A "$1"'
    )
    proc = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, "sh", str(folder), sys.executable,
         str(corpus), str(tokenizer)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stderr.strip(), proc.stdout.strip()


@pytest.mark.slow
@needs_mount
def test_a_full_disk_is_one_sentence_and_leaves_no_partial_file(
    tokenizer: Path, tmp_path: Path
) -> None:
    corpus = write_corpus(tmp_path / "c.jsonl", documents=400)
    (tmp_path / "disk").mkdir()
    stderr, after = _on_tmpfs("size=16k", tokenizer, corpus, tmp_path / "disk")
    assert stderr == (
        f"megatron-dualpipe: error: --output-prefix: cannot write {tmp_path}/disk/"
        f"corpus_text_document.bin/.idx: the disk holding {tmp_path}/disk is full: free space "
        "there, or choose another --output-prefix"
    )
    assert after == "rc=2"  # and nothing on the tmpfs: no .incomplete file, no lock


@pytest.mark.slow
@needs_mount
def test_a_read_only_file_system_is_one_sentence(tokenizer: Path, tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c.jsonl", documents=3)
    (tmp_path / "ro").mkdir()
    stderr, after = _on_tmpfs("ro", tokenizer, corpus, tmp_path / "ro")
    assert stderr == (
        f"megatron-dualpipe: error: --output-prefix: cannot write {tmp_path}/ro/"
        f"corpus_text_document.bin/.idx: {tmp_path}/ro is on a read-only file system: make it "
        "writable, or choose another --output-prefix"
    )
    assert after == "rc=2"


# --------------------------------------------------------------------------------------
# SIGTERM: a clean exit, nothing left, no worker left.


def _processes_naming(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _mid_run(tokenizer: Path, big_corpus: Path, out: Path) -> subprocess.Popen:
    """``preprocess --workers 2`` into ``out``, once its partial file is there (run in
    ``out``'s parent, where a hang report's SIGABRT may leave a core file)."""
    proc = _cli(
        "--input", str(big_corpus), "--tokenizer", str(tokenizer),
        "--output-prefix", str(out / "c"), "--workers", "2", cwd=out.parent,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not list(out.glob("*.incomplete-*")) and proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("no partial file appeared in 120 s")
        time.sleep(0.05)
    return proc


def _hang_report(proc: subprocess.Popen, naming: str) -> str:
    """What a preprocess that did not exit was doing: each of its processes' state and
    kernel wait, then every thread's Python stack (faulthandler's, on SIGABRT)."""
    pids = _processes_naming(naming)
    states = {}
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            states[pid] = f"{stat[0]} ppid {stat[1]} in {Path(f'/proc/{pid}/wchan').read_text()}"
        except OSError as err:
            states[pid] = str(err)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGABRT)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        for pid in _processes_naming(naming):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        err = "(its stderr stayed open)"
    return f"preprocess did not exit 60 s after SIGTERM: {states}\n{err[-8000:]}"


@pytest.mark.slow
def test_sigterm_exits_cleanly_removing_the_partial_files_and_the_workers(
    tokenizer: Path, big_corpus: Path, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("PYTHONFAULTHANDLER", "1")  # a hang's report shows every stack
    out = tmp_path / "sigterm-out"
    proc = _mid_run(tokenizer, big_corpus, out)
    try:
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(_hang_report(proc, str(out)))
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.strip().splitlines()[-1] == "megatron-dualpipe: preprocess terminated (SIGTERM)"
    assert not list(out.iterdir())
    deadline = time.monotonic() + 10
    while _processes_naming(str(out)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_naming(str(out)) == []


def test_a_stop_during_the_forks_ends_the_started_workers(monkeypatch) -> None:
    """A stop signal that comes while the workers are forked (held until the last is
    started) ends every started worker before it leaves ``_Workers``: none is left to run
    unjoined after the unwinding."""
    from multiprocessing.context import ForkProcess

    from megatron_dualpipe.cli.common import Terminated, unwind_on_stop_signals
    from megatron_dualpipe.megatron.data import preprocess as module

    started: list[ForkProcess] = []
    fork = ForkProcess.start

    def start_then_stop(process: ForkProcess) -> None:
        fork(process)
        started.append(process)
        # To the thread that holds it (to the process, another thread could take it).
        signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)

    monkeypatch.setattr(ForkProcess, "start", start_then_stop)
    try:
        with unwind_on_stop_signals(), pytest.raises(Terminated):
            module._Workers(encoder=object(), workers=2)
        assert len(started) == 2
        ended = {-signal.SIGTERM, -signal.SIGKILL}  # SIGKILL: not at its loop within _END_S
        assert [process.exitcode in ended for process in started] == [True, True]
    finally:
        for process in started:
            if process.is_alive():
                process.kill()
                process.join()


def test_a_stop_while_a_chunk_is_queued_leaves_the_queue_free(monkeypatch) -> None:
    """SIGTERM landing in ``Queue.put`` just after its condition's lock is taken (inside
    ``Condition.__enter__``, before the ``with`` holds it) is raised once the put is done:
    the lock is free, and closing the queue does not wait on it for ever."""
    import multiprocessing

    from megatron_dualpipe.cli.common import Terminated, unwind_on_stop_signals
    from megatron_dualpipe.megatron.data import preprocess as module

    tasks = multiprocessing.get_context("fork").Queue()
    enter = threading.Condition.__enter__

    stopped: list[bool] = []

    def enter_then_stop(condition: threading.Condition) -> bool:
        taken = enter(condition)
        if condition is tasks._notempty and not stopped:  # the put's, once
            stopped.append(True)
            signal.raise_signal(signal.SIGTERM)  # handled at the next bytecode: here
        return taken

    monkeypatch.setattr(threading.Condition, "__enter__", enter_then_stop)
    workers = object.__new__(module._Workers)
    workers.processes, workers.tasks, workers.workers = [object()], tasks, 1
    workers.results = multiprocessing.get_context("fork").Queue()
    chunks = iter([module._Chunk(0, 1, [b"{}\n"])])
    with unwind_on_stop_signals(), pytest.raises(Terminated):
        next(workers.encoded(chunks))
    taken = tasks._notempty._lock.locked()
    if taken:  # released here so that a failure does not hang pytest's exit
        tasks._notempty._lock.release()
    tasks.cancel_join_thread()
    tasks.close()  # waits for ever on a lock the stop left taken
    assert not taken


@pytest.mark.slow
@pytest.mark.parametrize("killed", [1, 2])
def test_workers_that_die_are_one_sentence_and_leave_nothing(
    tokenizer: Path, big_corpus: Path, tmp_path: Path, killed: int
) -> None:
    """Workers killed as the first chunk is handed out (the OOM killer, say): with both
    gone the parent says so in one sentence; with one gone it says so, or, where the other
    did all the work before the parent looked, it finishes every document. Either way no
    partial file and no worker is left."""
    import multiprocessing

    def progress(done: int, total: int) -> None:
        if done == 0 or progress.done:
            return
        progress.done = True
        workers = [c for c in multiprocessing.active_children() if c.name.startswith("preprocess")]
        for child in workers[:killed]:
            os.kill(child.pid, signal.SIGKILL)

    progress.done = False
    out = tmp_path / "died"
    message = r"--workers: tokenizing worker preprocess-worker-\d died \(exit code -9, "
    try:
        written = preprocess(big_corpus, tokenizer, str(out / "c"), workers=2, progress=progress)
    except PreprocessError as err:
        assert re.match(message, str(err)), err
        assert not list(out.iterdir())
    else:
        assert killed == 1 and written.written[0].documents == 15_000
    assert progress.done
    assert not [c for c in multiprocessing.active_children() if c.name.startswith("preprocess")]


@pytest.mark.slow
def test_the_workers_die_with_a_parent_killed_mid_run(
    tokenizer: Path, big_corpus: Path, tmp_path: Path
) -> None:
    """``kill -9`` of preprocess mid-run: its workers go too (the kernel's parent-death
    signal; a worker reading a chunk its parent was writing would otherwise wait for ever)."""
    out = tmp_path / "killed-out"
    proc = _mid_run(tokenizer, big_corpus, out)
    try:
        assert len(_processes_naming(str(out))) == 3  # the parent and its two workers
        proc.kill()
        proc.communicate(timeout=60)
    finally:
        proc.kill()
    deadline = time.monotonic() + 30
    while _processes_naming(str(out)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_naming(str(out)) == []


def _stuck_with_stop_signals_held(ready: object) -> None:
    """A worker stuck before its loop unholds the stop signals: SIGTERM never reaches it."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    ready.set()
    while True:
        time.sleep(3600)


def test_a_worker_that_cannot_see_sigterm_is_killed_when_the_workers_end(monkeypatch) -> None:
    """Leaving the workers' block ends a worker that holds SIGTERM (SIGKILL after
    ``_END_S``) instead of waiting for it forever (CI once saw `preprocess` not exit within
    60 s of SIGTERM)."""
    import multiprocessing

    from megatron_dualpipe.megatron.data import preprocess as module

    monkeypatch.setattr(module, "_END_S", 0.2)
    context = multiprocessing.get_context("fork")
    ready = context.Event()
    stuck = context.Process(target=_stuck_with_stop_signals_held, args=(ready,), daemon=True)
    stuck.start()
    try:
        assert ready.wait(60)
        workers = object.__new__(module._Workers)
        workers.processes = [stuck]
        workers.tasks, workers.results = context.Queue(), context.Queue()
        workers.__exit__(None, None, None)
        assert stuck.exitcode == -signal.SIGKILL
    finally:
        if stuck.is_alive():
            stuck.kill()
            stuck.join()
