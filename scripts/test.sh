#!/usr/bin/env bash
# The test command: set up .venv (scripts/setup_env.sh), then run the default suite.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
bash scripts/setup_env.sh
. .venv/bin/activate
exec python -m pytest -q -p no:cacheprovider "$@"
