#!/usr/bin/env bash
# CI's second leg: Python 3.12 (megatron-core 0.17 and newer publish 3.12 wheels only).
#   - a venv (.ci/venv312) with torch==2.13.0 (PyPI's CUDA build, about 4.5 GB; it runs on
#     CPU) and megatron-core==0.19.2, then scripts/install.sh, which keeps both;
#   - on 0.19.2, every test marked megatron but slow, and the slow ones marked route (they
#     run train: Megatron-LM's own loop, which only 0.19's wheel ships; leg 1 runs every
#     other slow one on 0.16.1: both legs share two cores, and the slow ones twice kept CI
#     over 30 minutes), half of those beside the rest;
#   - smoke runs of 0.17.1 and 0.18.2: each wheel installed without dependencies into its
#     own folder (.ci/megatron-core-X) put first on PYTHONPATH, no second torch: the
#     version tests, every schedule against the non-pipelined reference through Megatron's
#     get_forward_backward_func (PP=2, and five Adam steps against 1F1B's), and the patch of
#     that release's Megatron-LM tag applied to the wheel's megatron/training.
# Usage: bash .ci/py312.sh   (PY312=/path/to/python3.12 to choose the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "py312.sh: $*"; }
# A Python 3.12 that runs: PY312, python3.12 on PATH, or pyenv's (whose python3.12 shim
# answers only where 3.12 is the selected version).
find_py312() {
  local candidate
  for candidate in "${PY312:-}" "$(command -v python3.12 || true)" \
      "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
    if [[ -n $candidate && -x $candidate ]] &&
        "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      echo "$candidate"
      return
    fi
  done
}
py312=$(find_py312)
if [[ -z $py312 ]]; then
  echo "py312.sh: error: no Python 3.12 found: install it (or pyenv's 3.12) or set PY312" >&2
  exit 2
fi
venv=.ci/venv312
if [[ ! -x $venv/bin/python ]]; then
  say "making $venv with $py312"
  "$py312" -m venv "$venv"
fi
export PATH="$PWD/$venv/bin:$PATH"
say "installing torch==2.13.0 and megatron-core==0.19.2 (a CUDA build of torch, about 4.5 GB the first time)"
python -m pip install --no-input --disable-pip-version-check torch==2.13.0 megatron-core==0.19.2
bash scripts/install.sh
# Every part runs even if an earlier one fails; each one's result is printed at the end.
results=()
failed=0
part() {  # part NAME COMMAND...
  local name=$1 rc=0
  shift
  "$@" || rc=$?
  if ((rc == 0)); then results+=("py312.sh: $name: passed"); else
    results+=("py312.sh: $name: failed (exit $rc)"); failed=1; fi
  echo "${results[-1]}"
}
# Two runs side by side: the slow tests of Megatron-LM's own loop in files of ranks,
# faults, dry runs and patches (half A, in the background: its output is printed when it
# ends), and every fast megatron test then the other slow ones (half B). Much of their time
# goes to starting ranks (each a Python importing torch and megatron) and waiting on them,
# which leaves the cores room: side by side CI's whole run took 1,326 s, one after the
# other 1,522 s (docs/megatron-versions.md).
route_a=(tests/test_megatron_lm_loop.py tests/test_fault_orphans.py tests/test_fault_ranks.py
  tests/test_megatron_lm_faults.py tests/test_slurm.py tests/test_megatron_lm_dry_run.py
  tests/test_megatron_lm_patch.py tests/test_profile_trace.py)
python -m pytest -m "route and slow" -p no:cacheprovider "${route_a[@]}" > .ci/route-a.log 2>&1 &
route_a_pid=$!
# Half A goes with the script however it ends (in the background it ignores Ctrl-C).
trap 'kill "$route_a_pid" 2>/dev/null || true' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
part "megatron-core 0.19.2, every test marked megatron but slow" \
  python -m pytest -m "megatron and not slow"
part "megatron-core 0.19.2, the slow tests of Megatron-LM's own loop, half B" \
  python -m pytest -m "route and slow" -p no:cacheprovider "${route_a[@]/#/--ignore=}"
route_a_rc=0
wait "$route_a_pid" || route_a_rc=$?
cat .ci/route-a.log
part "megatron-core 0.19.2, the slow tests of Megatron-LM's own loop, half A" \
  bash -c "exit $route_a_rc"

for release in 0.17.1 0.18.2; do
  target=.ci/megatron-core-$release
  if [[ ! -d $target/megatron/core ]]; then
    say "installing megatron-core==$release into $target (no dependencies: the venv's torch serves)"
    python -m pip install --no-input --disable-pip-version-check --no-deps --target "$target" \
      "megatron-core==$release" || { part "megatron-core $release install" false; continue; }
  fi
  say "smoke run of megatron-core $release"
  part "megatron-core $release smoke run" env PYTHONPATH="$PWD/$target" \
    python -m pytest -m megatron -p no:cacheprovider \
    tests/test_megatron_version.py \
    tests/test_megatron_lm.py::test_the_installed_wheels_training_takes_its_tags_patch \
    tests/test_megatron_schedules.py::test_pp2_matches_reference \
    tests/test_megatron_schedules.py::test_five_adam_steps_follow_1f1b_loss_trajectory
done
printf '%s\n' "${results[@]}"
exit "$failed"
