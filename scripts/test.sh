#!/usr/bin/env bash
# The test command: set up .venv (scripts/setup_env.sh: ortmlx installed from a wheel of this checkout), then
# run the default suite against the installed package: PYTHONSAFEPATH keeps the checkout's own ortmlx/ off
# sys.path, in pytest and in every Python it starts.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
bash scripts/setup_env.sh
. .venv/bin/activate
export ORTMLX_TEST_INSTALLED=1 PYTHONSAFEPATH=1
# one pytest worker per core, at most 4 (pytest-xdist): a fresh machine's MLX kernel builds (g++ on the CPU
# backend, one at a time in a process) then run side by side; ORTMLX_TEST_WORKERS=1 runs in this process
workers=${ORTMLX_TEST_WORKERS:-$(python -c 'import os; print(min(4, len(os.sched_getaffinity(0))))')}
par=(); [ "$workers" -gt 1 ] && par=(-n "$workers")
exec python -m pytest -q -p no:cacheprovider "${par[@]}" "$@"
