#!/usr/bin/env bash
# The demo command: set up .venv (scripts/setup_env.sh), then run scripts/demo.py.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
bash scripts/setup_env.sh
. .venv/bin/activate
exec python scripts/demo.py "$@"
