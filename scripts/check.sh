#!/usr/bin/env bash
# The code's shape, then the tests. What CI runs (.ci/run), after installing '.[test,bench,hf]'.
#
#   scripts/check.sh             ruff, mypy and the import-layer test, then the whole pytest suite
#   scripts/check.sh -m 'not slow' tests/unit   arguments are passed to the pytest run
#   scripts/check.sh --static    ruff, mypy and the import-layer test only (no servers, ~1 min)
#
# pytest runs on CHECK_PYTEST_WORKERS (default 2) pytest-xdist workers, one test file per worker at a
# time (--dist loadfile: a file's module-scoped clusters are started once and its tests keep their
# order). Most of a test's time is spent waiting on the server processes it started, so two files
# side by side roughly halve the wall time on CI's 2 cores. The few files marked 'serial' (timing
# bounds that a neighbour on 2 cores can break; see [tool.pytest.ini_options]) run first, alone
# (PDP_SERIAL=only, then PDP_SERIAL=skip: tests/conftest.py). CHECK_PYTEST_WORKERS=0 runs everything
# in one process (also what happens when pytest-xdist is not installed).
#
# Every step runs even when an earlier one fails, so one run reports everything; the exit status
# is non-zero when any step failed. Configuration: [tool.ruff] and [tool.mypy] in pyproject.toml.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${CHECK_PYTHON:-.venv/bin/python}

static_only=0
if [ "${1:-}" = "--static" ]; then
  static_only=1
  shift
fi

failed=()
step() {
  local name=$1
  shift
  echo "== $name: $*" >&2
  if ! "$@"; then
    failed+=("$name")
  fi
}

step ruff "$PY" -m ruff check .
step mypy "$PY" -m mypy
step layers "$PY" -m pytest -q -p no:cacheprovider tests/unit/test_layers.py
if [ "$static_only" = 0 ]; then
  workers=${CHECK_PYTEST_WORKERS:-2}
  parallel=()
  if [ "$workers" != 0 ] && "$PY" -c 'import xdist' 2>/dev/null; then
    parallel=(-n "$workers" --dist loadfile)
  elif [ "$workers" != 0 ]; then
    echo "== pytest-xdist is not installed: the suite runs in one process (pip install -e '.[test]')" >&2
  fi
  if [ ${#parallel[@]} = 0 ]; then
    step pytest "$PY" -m pytest "$@"
  else
    # Exit 5 (no test selected) of one pass is fine: the arguments may pick tests of one kind only.
    # Both passes selecting nothing is what one plain run would report: a failure.
    echo "== pytest (the 'serial' tests, alone): $PY -m pytest $*" >&2
    PDP_SERIAL=only "$PY" -m pytest "$@"
    serial_code=$?
    echo "== pytest (the rest, ${parallel[*]}): $PY -m pytest ${parallel[*]} $*" >&2
    PDP_SERIAL=skip "$PY" -m pytest "${parallel[@]}" "$@"
    rest_code=$?
    for code in $serial_code $rest_code; do
      if [ "$code" != 0 ] && [ "$code" != 5 ]; then
        failed+=("pytest")
        break
      fi
    done
    if [ "$serial_code" = 5 ] && [ "$rest_code" = 5 ]; then
      failed+=("pytest (no test selected)")
    fi
  fi
fi

if [ ${#failed[@]} -gt 0 ]; then
  echo "== FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "== all checks passed" >&2
