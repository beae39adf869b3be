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
exec python -m pytest -q -p no:cacheprovider "$@"
