#!/usr/bin/env bash
# The test command: set up .venv (scripts/setup_env.sh: ortmlx installed from a wheel of this checkout), then
# run the default suite against the installed package (python -P: the checkout's own ortmlx/ is not importable).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
bash scripts/setup_env.sh
. .venv/bin/activate
export ORTMLX_TEST_INSTALLED=1
exec python -P -m pytest -q -p no:cacheprovider "$@"
