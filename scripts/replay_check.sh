#!/usr/bin/env bash
# The decode replay (tuning replay) end to end on an NVIDIA host with onnxruntime-gpu and onnxruntime-genai-cuda,
# from the repository root with the shim built in place (python3 setup.py build_ext --inplace): the GPU tests of the
# kernels it takes, replay_probe.py on a synthetic step (plain and programmatic launches) and on the pruned fp16 and
# int4 builds (serving against not, in one process, tokens compared, every refusal's arguments named), then
# bench_llm.py's decode and accuracy cases with it on, ORT's CUDA EP beside, and a new host's first minute with it
# on. Each step has a time limit (~35 min in all on an H100 with the builds cached); the log and the JSON go to $R
# (results/replay).
#   bash scripts/replay_check.sh [0.5b|1.5b]
set -u
size=${1:-0.5b}
R=${R:-results/replay}
mkdir -p "$R"
step() { local lim=$1; shift; echo "+ [$(date +%T)] $* (limit ${lim}s)"; timeout "$lim" "$@"; echo "  rc=$?"; }
{
  # the replay's own tests first, alone, so that their failures print before any limit
  step 240 python3 -m pytest -q -p no:cacheprovider -rfE --tb=long tests/test_cuda_replay.py
  # a synthetic 0.5B step of our kernels (no build): MLX against the replay, plain and programmatic launches
  step 150 python3 scripts/replay_probe.py --decode --pdl --steps 200
  step 600 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_cuda_kernels.py tests/test_cuda_rows.py
  step 360 python3 scripts/bench_models.py --size "$size" --precision fp16 --precision int4 --prune-lm-head
  for p in fp16 int4; do
    step 240 python3 scripts/replay_probe.py --model "models/out/qwen2-$size-$p-gqa-prune" --tokens 64 --rounds 3
    # the guard on MLX's CPU stream, the host inputs staged, the launches programmatic (each part against the above)
    step 240 python3 scripts/replay_probe.py --model "models/out/qwen2-$size-$p-gqa-prune" --tokens 64 --rounds 3 \
        --tuning replay_host_guard=1 --tuning replay_staged_feed=1 --tuning replay_pdl=1
  done
  step 480 python3 scripts/bench_llm.py --sizes "$size" --precisions fp16,int4 --prune-lm-head \
      --only decode,accuracy --mlx-option tuning=replay=1 --json "$R/bench_llm.json" --time-budget 450
  # a new host's first minute with it on (empty kernel caches): a generation far slower than its neighbours is a stall
  step 300 python3 scripts/bench_llm.py --sizes "$size" --precisions fp16,int4 --prune-lm-head --only cold \
      --cold-variants "" --cold-window 20 --engines mlx --mlx-option tuning=replay=1 --json "$R/cold.json"
} 2>&1 | tee -a "$R/replay_check.log"
