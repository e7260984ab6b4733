#!/usr/bin/env bash
# One GPU, world size 1: what thunder_overlap's machinery costs where there is nothing to hide.
# Runs none and block buckets, ZeRO3 and ZeRO2, on Llama-2-7B shapes (4 layers, sequence 4096,
# bf16), one process each, and prints block against none: peak (in block-sized buffers) and
# step time. Needs the 'bench' extra (litgpt) and a CUDA device.
#
#   benchmarks/gpu_ws1.sh OUT_DIR [more benchmark_fsdp.py options]
#
# MODEL_ARGS overrides the model and step counts (e.g. a tiny model to try the script on CPU
# with "--device cpu"); SHARDINGS the ZeRO stages run ("zero3 zero2"); CUDA_PEAK=1 also writes
# what one more step had alive at its peak (<run>.peak.json); PYTHON picks the interpreter;
# RUN_TIMEOUT_S bounds each run.
set -u
out=${1:?usage: benchmarks/gpu_ws1.sh OUT_DIR [benchmark_fsdp.py options]}
shift
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-python3}
model_args=${MODEL_ARGS:---model_name Llama-2-7b-hf --n_layers 4 --micro_batch_size 1 --max_iters 20 --warmup_iters 6}
mkdir -p "$out"
for shard in ${SHARDINGS:-zero3 zero2}; do
    for bucketing in none block; do
        name="llama_${shard/zero/z}_thunder_overlap_${bucketing}"
        echo "== $name" >>"$out/runs.log"
        peak_args=()
        [ "${CUDA_PEAK:-0}" = 1 ] && peak_args=(--cuda_peak_json "$out/$name.peak.json")
        # shellcheck disable=SC2086  # model_args is a list of options
        timeout "${RUN_TIMEOUT_S:-180}" "$python" -m torch.distributed.run --standalone --nproc_per_node=1 \
            "$here/benchmark_fsdp.py" $model_args --shard_mode "$shard" --impl thunder_overlap \
            --bucketing_mode "$bucketing" --json_path "$out/$name.json" "${peak_args[@]}" "$@" >>"$out/runs.log" 2>&1 ||
            echo "$name failed (exit $?): see $out/runs.log"
    done
done
"$python" "$here/ws1_table.py" "$out"/llama_*_none.json "$out"/llama_*_block.json | tee "$out/table.md"
