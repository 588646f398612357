#!/usr/bin/env bash
# GPU validation and measurement, the source of BENCHMARKS.md's GPU rows. Run from the repository root on a GPU
# machine where `python -m rlaif` works (and, for the peer benchmarks, where TRL is importable: see bench/).
#   scripts/gpu_check.sh pipeline   the demo end to end on the GPU (bf16 autocast, NCCL group), per-stage times;
#                                   then PPO under DeepSpeed ZeRO-2 and ZeRO-3 with DeepSpeed's fused AdamW (JIT)
#   scripts/gpu_check.sh micro      gae and the PPO update's model FLOPs utilisation against the bf16 matmul peak
#   scripts/gpu_check.sh ppo-vs-trl SIZE...   PPO iteration vs TRL PPOTrainer (needs trl==1.12.0 importable)
#   scripts/gpu_check.sh rm-vs-trl  reward-model training vs TRL RewardTrainer (needs trl==1.16.0; after pipeline)
#   scripts/gpu_check.sh revalidate the GPU tests, generation throughput, update MFU at 0.5B+, PPO vs TRL 1.12.0 at the
#                                   demo size, and GRPO vs TRL's GRPOTrainer where $TRL16 (a PYTHONPATH entry holding
#                                   trl==1.16.0) is set: one lease's re-measurement of every GPU row at the current code
#   scripts/gpu_check.sh decode     the static decoder's tests on CUDA, generation throughput at the demo size and
#                                   at h512x8 (static decoder with CUDA graph vs eager vs generate), PPO phases with
#                                   each decoder, update MFU at 0.5B+
# Each step's full log goes to $LOGS/<step>.log (default runs/gpu-check); the benches append to BENCHMARKS.md.
set -uo pipefail
PY=${PY:-python3}
LOGS=${LOGS:-runs/gpu-check}
mkdir -p "$LOGS"

step() {  # step NAME COMMAND...: runs it, logs it, prints its exit code, time and last lines; never stops the script
    local name=$1 start rc
    shift
    start=$(date +%s)
    "$@" >"$LOGS/$name.log" 2>&1
    rc=$?
    echo "== $name: exit $rc in $(($(date +%s) - start)) s"
    grep -E "done in|cache hit|win rate|reward .* -> |s/iteration|Error|error:" "$LOGS/$name.log" | tail -n 12
    [ "$rc" = 0 ] || tail -n 25 "$LOGS/$name.log"
}

case "${1:-}" in
pipeline)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    $PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'transformers', transformers.__version__)"
    step demo $PY -m rlaif run --config configs/demo.yaml --run-id gpu-demo
    step zero2 $PY -m rlaif run --config configs/demo.yaml --run-id gpu-demo --set ppo.strategy=deepspeed \
        --set ppo.zero_stage=2 --set ppo.iterations=12 --set evaluate.n_prompts=64
    step zero3 $PY -m rlaif run --config configs/demo.yaml --run-id gpu-demo --set ppo.strategy=deepspeed \
        --set ppo.zero_stage=3 --set ppo.iterations=12 --set evaluate.n_prompts=64
    ;;
micro)
    step gae $PY bench/bench_gae.py --append
    step mfu $PY bench/bench_ppo_update.py --append
    ;;
ppo-vs-trl)
    shift
    for size in "$@"; do step "ppo-$size" $PY bench/bench_ppo.py --trials 3 --iterations 6 --size "$size"; done
    ;;
decode)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    step decode-tests $PY -m pytest -q tests/unit/test_decode.py
    step generation $PY bench/bench_generation.py --trials 3
    step generation-h512 $PY bench/bench_generation.py --trials 3 --set policy.tiny.hidden_size=512 \
        --set policy.tiny.num_layers=8 --set policy.tiny.num_heads=8 --set policy.tiny.intermediate_size=1536 \
        --set policy.tiny.sft_steps=20
    step ppo-phases-static $PY bench/bench_ppo_scaling.py --points 3 --work "$LOGS/../ppo-work"
    step ppo-phases-generate env RLAIF_DECODER=generate $PY bench/bench_ppo_scaling.py --points 3 \
        --work "$LOGS/../ppo-work"
    step mfu-large $PY bench/bench_ppo_update.py --large --trials 3
    ;;
revalidate)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    $PY -c "import torch, transformers, trl; print('torch', torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__)"
    step gpu-tests timeout 120 $PY -m pytest -q tests/unit/test_decode.py tests/unit/test_logprobs_math.py \
        tests/unit/test_lean_decode.py
    step generation timeout 150 $PY bench/bench_generation.py --trials 3 --append
    step mfu-large timeout 150 $PY bench/bench_ppo_update.py --large --trials 3 --append
    step ppo-demo timeout 150 $PY bench/bench_ppo.py --trials 3 --iterations 6 --fixed-length --size demo --lora-rank 0
    [ -n "${TRL16:-}" ] && step grpo-demo timeout 150 env PYTHONPATH="$TRL16:${PYTHONPATH:-}" $PY bench/bench_grpo.py \
        --trials 3 --iterations 6 --fixed-length --size demo
    ;;
rm-vs-trl)
    step rm $PY bench/bench_reward_model.py --source-run runs/gpu-demo --trials 3
    ;;
*)
    sed -n 2,10p "$0"
    exit 2
    ;;
esac
