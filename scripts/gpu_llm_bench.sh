#!/usr/bin/env bash
# On the GPU host, after ../shared/device stage1/stage2 (see docs/performance.md): build the
# random-weight Qwen2.5-shaped benchmark LLMs (genai builder -e cuda: GQA, shared KV buffer)
# and print decode tok/s of the MLX EP (compiled) next to PyTorch eager and mlx-lm, the HBM
# limit, the EP's host<->device bytes per token, and where a decode call's time goes.
#   bash scripts/gpu_llm_bench.sh [0.5b] [1.5b]      (logs also under $OUT when set)
set -u
sizes=("$@"); [ ${#sizes[@]} -eq 0 ] && sizes=(0.5b)
log=${OUT:-out/gpu}/gpu_llm_bench.log; mkdir -p "$(dirname "$log")"
step() { local lim=$1; shift; echo "+ [$(date +%T)] $* (limit ${lim}s)"; timeout "$lim" "$@"; echo "  rc=$?"; }
# MLX's CUDA backend JIT-compiles its kernels on first use (minutes for a fresh host) and keeps the
# PTX under $TMPDIR/mlx: a cache carried in .dev/p/ptx.tgz is unpacked first and the grown one is
# packed back into $OUT (carry it next time: copy $OUT/ptx.tgz to .dev/p/).
[ -f .dev/p/ptx.tgz ] && tar xzf .dev/p/ptx.tgz -C "${TMPDIR:-/tmp}"
{
python3 setup.py build_ext --inplace > /dev/null 2>&1 || echo "build_ext failed"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
for s in "${sizes[@]}"; do
  step 150 python3 scripts/bench_models.py --size "$s"
  m=models/out/qwen2-$s-fp16-gqa
  step "${BENCH_LIMIT:-240}" python3 scripts/bench.py --no-graphs --no-cpu-ep --device gpu --model "$m" \
      --hf "models/out/hf/qwen2-$s" --torch --mlx-lm --new-tokens 128 --rounds "${ROUNDS:-2}" --bytes-run "${BYTES_RUN:-1024}"
  step 90 python3 scripts/generate.py "$m" --max-new-tokens 128 --option device=gpu --option verbose=1
done
} 2>&1 | tee -a "$log"
[ -n "${OUT:-}" ] && tar czf "$OUT/ptx.tgz" -C "${TMPDIR:-/tmp}" mlx 2>/dev/null
exit 0
