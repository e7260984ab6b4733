#!/usr/bin/env bash
# One GPU, world size 1, both sides compiled: thunder_overlap under Thunder's torchcompile
# executor against FSDP2 with every block torch.compile'd (torchtitan's way), and Thunder alone
# with the same executors (compute_only: no sharding, no collectives) for what is Thunder's.
# ZeRO3 and ZeRO2, Llama-2-7B shapes (4 layers, sequence 4096, bf16), one process each; prints
# step and peak side by side. Needs the 'bench' extra (litgpt) and a CUDA device.
#
#   benchmarks/gpu_compile_ws1.sh OUT_DIR [more benchmark_fsdp.py options]
#
# NSYS names an nsys binary: the ZeRO3 runs then run under Nsight Systems, which records two
# untimed warm-up iterations (5 and 6) of each (<run>.nsys-rep, and its NVTX and CUDA kernel
# summaries as CSV); the timed iterations come after the capture. MODEL_ARGS overrides the
# model and step counts; SHARDINGS the ZeRO stages run ("zero3 zero2"); EXECUTORS Thunder's
# executor sets ("torchcompile"; also "thunder_inductor", torchcompile ahead of the defaults);
# BUCKETING thunder_overlap's buckets ("block"); PYTHON the interpreter; RUN_TIMEOUT_S bounds
# each run. About a minute a run on an H200, most of it compiling.
set -u
out=${1:?usage: benchmarks/gpu_compile_ws1.sh OUT_DIR [benchmark_fsdp.py options]}
shift
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-python3}
model_args=${MODEL_ARGS:---model_name Llama-2-7b-hf --n_layers 4 --micro_batch_size 1 --max_iters 16 --warmup_iters 8}
bucketing=${BUCKETING:-block}
mkdir -p "$out"
runs=()
first_shard=1
for shard in ${SHARDINGS:-zero3 zero2}; do
    runs+=("fsdp2_compile $shard default")
    for executors in ${EXECUTORS:-torchcompile}; do
        # Thunder alone has no sharding: once, beside the first ZeRO stage.
        [ $first_shard = 1 ] && runs+=("compute_only $shard $executors")
        runs+=("thunder_overlap $shard $executors")
    done
    first_shard=0
done
for run in "${runs[@]}"; do
    read -r impl shard executors <<<"$run"
    run_args=(--impl "$impl" --shard_mode "$shard")
    name="llama_${shard/zero/z}_${impl}"
    [ "$executors" != default ] && run_args+=(--executors "$executors") && name="${name}_${executors}"
    if [ "$impl" = thunder_overlap ]; then
        run_args+=(--bucketing_mode "$bucketing")
        name="${name}_${bucketing}"
    fi
    wrap=()
    if [ -n "${NSYS:-}" ] && [ "$shard" = zero3 ]; then
        wrap=("$NSYS" profile -t cuda,nvtx,osrt,cublas -s none --capture-range=cudaProfilerApi
            --capture-range-end=stop -f true -o "$out/$name")
        run_args+=(--nsys_enabled --profiler_start 5 --profiler_stop 6)
    fi
    echo "== $name" >>"$out/runs.log"
    # shellcheck disable=SC2086  # model_args is a list of options
    timeout "${RUN_TIMEOUT_S:-240}" "${wrap[@]}" "$python" -m torch.distributed.run --standalone --nproc_per_node=1 \
        "$here/benchmark_fsdp.py" $model_args "${run_args[@]}" --json_path "$out/$name.json" "$@" >>"$out/runs.log" 2>&1 ||
        echo "$name failed (exit $?): see $out/runs.log"
    if [ ${#wrap[@]} -gt 0 ] && [ -f "$out/$name.nsys-rep" ]; then
        "$NSYS" stats -q -r nvtx_sum,cuda_gpu_kern_sum -f csv -o "$out/$name" "$out/$name.nsys-rep" >>"$out/runs.log" 2>&1 ||
            echo "nsys stats of $name failed: see $out/runs.log"
    elif [ ${#wrap[@]} -gt 0 ] && [ -f "$out/$name.qdstrm" ]; then
        # nsys could not import its own capture (seen with the nsys inside Nsight Compute
        # 2025.3.1): the raw stream is gigabytes and no tool here reads it.
        rm -f "$out/$name.qdstrm"
        echo "nsys made no report for $name (its .qdstrm could not be imported; removed): see $out/runs.log"
    fi
done
"$python" "$here/ws1_table.py" "$out"/llama_*.json --against fsdp2_compile | tee "$out/table.md"
