#!/usr/bin/env bash
# One H200 session's work in one device call (the device tool allows 10 minutes a call
# and 30 a session, and a fresh machine costs minutes to start, so batch).
#
#   bash bench/device_session.sh fetch     # here: the wheels the device image lacks -> .whl/
#   bash bench/device_session.sh run       # on the device (run with carry [".whl"]):
#                                          #   GPU tests, the benchmark, the step profile -> $OUT
#   STEPS="gemv profile" BENCH_ARGS="--batches 1" bash bench/device_session.sh run   # a subset
#   (each step takes its own *_ARGS: DRAFTERS_ARGS, DSTEP_ARGS, GEMV_ARGS, PROFILE_ARGS,
#   ATTN_ARGS, TRAIN_ARGS, PREFIX_ARGS, ...)
#
# The image has torch, transformers, triton, grpcio, protobuf and uvloop; it lacks
# grpcio's health/reflection packages, OpenTelemetry and prometheus-client, all pure
# Python, and py-spy (a static binary in a py2.py3 manylinux wheel). Logs go to
# $OUT/log.txt. The device returns at most 8 files, so keep $OUT small.
set -uo pipefail
cd "$(dirname "$0")/.."

WHEELS=(grpcio-health-checking==1.84.0 grpcio-reflection==1.84.0
        opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2
        opentelemetry-exporter-otlp-proto-grpc==1.45.2
        opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-proto==1.45.2
        opentelemetry-semantic-conventions==0.66b2 googleapis-common-protos prometheus-client
        py-spy==0.4.3)      # a binary wheel, for the pyspy step: where a row's host time goes

case "${1:-}" in
fetch)
    mkdir -p .whl
    python -m pip download -q --no-deps --only-binary :all: --dest .whl "${WHEELS[@]}"
    ls .whl
    ;;
run)
    : "${OUT:?run on the device, where \$OUT is set}"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    # the checkout as the installed package sees it: treespec.<folder> -> ./<folder>
    mkdir -p /tmp/site/treespec
    for pkg in common kernels draft_service verify_service protos; do
        ln -sfn "$PWD/$pkg" "/tmp/site/treespec/$pkg"
    done
    export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
    log="$OUT/log.txt"
    nvidia-smi --query-gpu=name,memory.total --format=csv >"$log" 2>&1
    # STEPS picks and orders the work; BENCH_ARGS go to bench/h200.py
    for step in ${STEPS:-tests bench profile}; do
        echo "== $step ($(date +%T))" >>"$log"
        case "$step" in
        tests) TRITON_INTERPRET=0 timeout "${TESTS_S:-240}" python3 -P -m pytest -q -p no:cacheprovider \
                   ${TESTS:-tests/test_cuda_graph.py tests/test_eagle3_gpu.py \
                   tests/test_draft_model_gpu.py tests/test_dflash_gpu.py tests/test_triton_kernels.py \
                   tests/test_triton_gemv.py tests/test_triton_ancestors.py tests/test_triton_noise.py \
                   tests/test_triton_candidates.py tests/test_triton_rejection.py \
                   tests/test_triton_vocab.py} >>"$log" 2>&1 ;;
        gemv) timeout "${GEMV_S:-180}" python3 bench/gemv_probe.py --out "$OUT" ${GEMV_ARGS:-} \
                  >>"$log" 2>&1 ;;
        bench)   # once per ';'-separated part of BENCH_ARGS -> h200.json, h200_2.json, ...
            IFS=';' read -ra variants <<<"${BENCH_ARGS:-}"
            for i in "${!variants[@]}"; do
                name=h200$([ "$i" -gt 0 ] && echo "_$((i + 1))").json
                echo "-- $name: ${variants[$i]}" >>"$log"
                timeout "${BENCH_S:-300}" python3 bench/h200.py --out "$OUT/$name" \
                    --work /tmp/bw ${variants[$i]} >>"$log" 2>&1
            done ;;
        drafters|pyspy)   # pyspy: the same under py-spy, every process sampled (collapsed
                          # stacks, read by bench/pyspy_top.py: each service's host time by
                          # function); where py-spy can't trace there, the plain step
            spy=()
            if [ "$step" = pyspy ]; then
                spy=(/tmp/site/bin/py-spy record --subprocesses --rate "${PYSPY_RATE:-250}"
                     --format raw -o "$OUT/pyspy.txt" --)
                "${spy[@]}" python3 -c "import time; time.sleep(1)" >>"$log" 2>&1 || spy=()
            fi
            timeout -s INT -k 30 "${DRAFTERS_S:-560}" "${spy[@]}" python3 bench/drafters.py \
                --out "$OUT/drafters.json" --work /tmp/bw-drafters ${DRAFTERS_ARGS:-} \
                >>"$log" 2>&1
            if [ -f "$OUT/pyspy.txt" ]; then gzip -f "$OUT/pyspy.txt"; fi
            tail -n 120 /tmp/bw-drafters/*.log >"$OUT/services.log" 2>&1 ;;
        dstep) timeout "${DSTEP_S:-240}" python3 bench/drafter_step.py \
                   --out "$OUT/drafter_step.json" --work /tmp/bw-drafters ${DSTEP_ARGS:-} \
                   >>"$log" 2>&1 ;;
        prefix)   # prefix caching at the 8B shape: 16 five-turn chats, cache on and off
            timeout "${PREFIX_S:-240}" python3 bench/prefix_cache.py --out "$OUT/prefix_cache.json" \
                --target-shape qwen3-8b --draft-shape qwen3-0.6b --device cuda \
                --work /tmp/bw-prefix ${PREFIX_ARGS:-} >>"$log" 2>&1
            r=$?; rm -rf /tmp/bw-prefix; (exit $r) ;;   # 17 GB of checkpoints: the disk holds 64 GB
        long) timeout "${LONG_S:-480}" python3 bench/long_prompt.py --out "$OUT/long_prompt.json" \
                  --work /tmp/bw-long ${LONG_ARGS:-} >>"$log" 2>&1
              r=$?; rm -rf /tmp/bw-long; (exit $r) ;;
        sampled) timeout "${SAMPLED_S:-90}" python3 bench/sampled_step.py \
                     --out "$OUT/sampled_step.json" >>"$log" 2>&1 ;;
        profile) timeout "${PROFILE_S:-200}" python3 bench/profile_step.py --out "$OUT" ${PROFILE_ARGS:-} \
                     >>"$log" 2>&1 ;;
        igemm)   # the invariant GEMM's configs, written where the services read them
            timeout "${IGEMM_S:-200}" python3 bench/invariant_gemm_probe.py \
                --out "$OUT/igemm.json" --write-config kernels/invariant_gemm_configs.json \
                ${IGEMM_ARGS:-} >>"$log" 2>&1
            cp kernels/invariant_gemm_configs.json "$OUT/" 2>>"$log" ;;
        attninv) timeout "${ATTNINV_S:-200}" python3 bench/attention_invariance_gpu.py \
                     --out "$OUT/attn_inv.json" ${ATTNINV_ARGS:-} >>"$log" 2>&1 ;;
        attention) timeout "${ATTN_S:-150}" python3 bench/attention_probe.py ${ATTN_ARGS:-} \
                       --out "$OUT/attention_probe.json" >>"$log" 2>&1 ;;
        accept) timeout "${ACCEPT_S:-120}" python3 bench/bench_accept.py --device cuda --files 4 \
                    --prompt-tokens 128 --max-tokens 48 --envelopes chain4,tree-small \
                    --methods model,eagle3 --json "$OUT/accept.json" ${ACCEPT_ARGS:-} \
                    >>"$log" 2>&1 ;;
        dflash-train)   # the tiny DFlash drafter retrained, once per ';'-separated part of
                        # TRAIN_ARGS (v1, v2, ...); each one's files come back as a tar, to
                        # be judged here by the CPU bench-accept on all 20 held-out files
                        # (an 8-file GPU bench-accept here misled twice: NOTES, s35)
            IFS=';' read -ra variants <<<"${TRAIN_ARGS:-}"
            for i in "${!variants[@]}"; do
                v=/tmp/dft/v$((i + 1))
                echo "-- v$((i + 1)): ${variants[$i]}" >>"$log"
                timeout "${TRAIN_S:-400}" python3 bench/train_tiny.py --out "$v" --device cuda \
                    --only dflash --base common/model/checkpoints ${variants[$i]} >>"$log" 2>&1
                tar -cf "$OUT/dflash_v$((i + 1)).tar" -C "$v/tiny-code-dflash" \
                    config.json model.safetensors TRAINING.json
            done ;;
        esac
        echo "rc=$? ($(date +%T))" >>"$log"
    done
    ;;
*)
    echo "usage: $0 fetch|run" >&2
    exit 2
    ;;
esac
