#!/usr/bin/env bash
# The GPU-machine runs of the open issues, in parts that each fit one device call (at most
# 10 minutes). Run from the repository root on the GPU machine with the repository on PYTHONPATH
# (the machine's image has torch, triton, transformers and numpy; a numpy carried in front of its own
# broke transformers' imports there); results land in $OUT (default benchmarks/results). The bench parts resume:
# rerun a part that ran out of time and it measures only what is missing from its JSON
# (copy the JSON back into $OUT first when $OUT starts empty). The GPU machine's copy of .git keeps
# the commit the session began at: export MIRA_COMMIT=<the commit whose tree travels> in the device
# command, or every result records that stale commit (mira.bench.provenance). On a machine of
# several GPUs, parts can run side by side (CUDA_VISIBLE_DEVICES=0 / 1); say so in $MIRA_RUN_CONTEXT,
# which every result records, and measure first whether the GPUs share host bandwidth
# (python benchmarks/h2d_pair.py).
#
#   bash benchmarks/h200_suite.sh tests     # every test marked gpu, kernels and end to end, but the families (~4 min)
#   bash benchmarks/h200_suite.sh families  # every family under a budget on CUDA, graphs where they replay (~5 min)
#   bash benchmarks/h200_suite.sh pipeline  # copies overlapped with compute, zero-copy misses (3 shapes),
#                                           # store open of 8 GB (~3 min)
#   bash benchmarks/h200_suite.sh tiny      # mira bench, the bundled model, held-out ShareGPT, offload at each
#                                           # budget, beams of 64 in / 256 out (~4 min)
#   bash benchmarks/h200_suite.sh qwen3     # mira bench, Qwen3-30B-A3B shape, 64 in / 256 out, offload at
#                                           # every budget, beams of 256 tokens (~12 min: two resumed calls);
#                                           # its committed runs predate the preset's varied routing (2e51f91)
#   bash benchmarks/h200_suite.sh deepseek  # mira bench, DeepSeek-V2-Lite shape, 64 in / 256 out, what issue #7
#                                           # asks (synthetic-routing-cpu.json: its routing varies); 24 and 48 GiB
#                                           # hold every expert (14.4 GB), so 8 and 12 GiB; with the lagged
#                                           # Mira+P and LRU, which the goals take where faster (~9 min)
#   bash benchmarks/h200_suite.sh mixtral   # mira bench, Mixtral-8x7B shape, 64 in / 256 out as issue #7 asks:
#                                           # every budget, offload at each, beams of 256 tokens (~22 min:
#                                           # three resumed calls)
#   bash benchmarks/h200_suite.sh lagged    # Qwen3 shape and the bundled model, mira and LRU lagged against
#                                           # inline: the measurement behind auto residency (~8 min)
#   bash benchmarks/h200_suite.sh staging   # prefetching staged on the device under lagged residency
#                                           # (mira+p-lagged) against inline Mira+P and lagged Mira: the
#                                           # DeepSeek-V2-Lite shape at 8 / 12 GiB, the bundled model at 10 / 25% (~5 min)
#   bash benchmarks/h200_suite.sh kernels   # kernels_int8.py --autotune, three shapes, and top-2 with the experts
#                                           # spread over 40 GB as in a large model's slot pool; writes the
#                                           # tuning file too (~5 min)
#   bash benchmarks/h200_suite.sh profile   # where a decode step's time goes, mira+p / mira / lru / static:
#                                           # Mixtral shape at 24 GiB (~4 min)
#   bash benchmarks/h200_suite.sh profile-small  # the same for the DeepSeek-V2-Lite shape at 8 GiB, and
#                                           # the bundled model at 10% and all (~4 min)
#   bash benchmarks/h200_suite.sh profile-replay  # where a decode step's time goes, mira against static (both
#                                           # with the CPU's share), Mixtral shape at 25% replaying the real
#                                           # trace: does an admission's copy cost more than the misses it saves
#                                           # (~4 min)
#   bash benchmarks/h200_suite.sh replay    # mira bench, Mixtral-8x7B shape replaying the recorded Mixtral-8x7B-
#                                           # Instruct decode routing (results/traces), 64 in / 64 out, mira
#                                           # (its defaults: auto residency, the CPU's share where it pays),
#                                           # LRU, LFU and static, 3 timed repeats each; BUDGETS=25% then
#                                           # BUDGETS=50% (~5 min each, resumed); INTERLEAVE=1 times them in
#                                           # turns instead (mira bench --interleave: a host whose speed drifts
#                                           # weighs on all alike; one budget a call, ~7 min)
#   bash benchmarks/h200_suite.sh hybrid    # the same replay at 8 and 12 GiB, mira against mira-gpu (the CPU's
#                                           # share off) in one run, each layer's predicted and measured times
#                                           # printed; THREADS=8 adds --cpu-threads 8; CONFIGS=mira,mira-device-
#                                           # calibrated,mira-gpu adds the device's side at its calibration, an
#                                           # A/B of the device's pace in one run (~5 min, ~7 with it);
#                                           # INTERLEAVE=1 as for replay (~7 min); BUDGETS=8GiB runs one budget
#                                           # (about half the time), and a rerun resumes with the other
#   bash benchmarks/h200_suite.sh hybrid-24 # the same replay at 24 GiB: mira (auto's rule decides on the CPU's share),
#                                           # mira-gpu and mira-cpu-split (the split regardless of the rule) in one
#                                           # run (~4 min)
#   bash benchmarks/h200_suite.sh settle    # the deferred settle's A/B: mira bench, OLMoE-1B-7B shape at 25% and
#                                           # 50% of the experts, 64 in / 64 out, mira and static against
#                                           # mira-settle-now and static-settle-now in one run; CONFIGS=... runs
#                                           # them in another order, to tell the deferral from the order (~2 min)
#   bash benchmarks/h200_suite.sh shapes    # mira bench at 25% and 50% of the experts, synthetic routing, 64 in /
#                                           # 64 out, mira against LRU (inline, lagged), LFU and static, 3 timed
#                                           # repeats: DeepSeek-V2-Lite, Qwen3-30B-A3B, OLMoE-1B-7B (~8 min)
#   bash benchmarks/h200_suite.sh shapes-mixtral  # the same for the Mixtral-8x7B shape (~9 min: a resumed
#                                           # second call may be needed)
#   bash benchmarks/h200_suite.sh int4      # mira bench, Mixtral-8x7B shape replaying the same recorded routing,
#                                           # 64 in / 64 out, 12 and 24 GiB, int4 against int8-shared in one run
#                                           # (CONFIGS, default mira,static), 3 timed repeats; the int8 store
#                                           # (45 GB, host memory only) is freed before the int4 one (25 GB) is
#                                           # filled; a rerun resumes, skipping a scheme already measured; the
#                                           # INT4 kernels take the int4-tiles part's tuning where it ran on this
#                                           # machine (~8 min)
#   bash benchmarks/h200_suite.sh int4-hybrid  # the int4 store replaying the same routing at 8 and 12 GiB, 64 in / 64
#                                           # out: mira (auto leaves the CPU's share off for int4: its priced saving
#                                           # is under INLINE_LAYER_S), mira-cpu-split (the share regardless) and
#                                           # mira-gpu in one run, 3 timed repeats: would the share pay there (~6 min)
#   bash benchmarks/h200_suite.sh int4-tiles  # the tiled INT4 layout: its GPU tests, an expert on the CPU (int4
#                                           # against int8-shared, 15 threads), then kernels_int4.py --autotune for
#                                           # the Mixtral shape; the tuning lands in .carry/tuning (kept between
#                                           # calls, read by the int4 part) and in $OUT (~8 min)
#   bash benchmarks/h200_suite.sh cut-columns  # cut jobs of one Mixtral-shaped int8-shared expert on the CPU (15
#                                           # threads) at k/7 of its units, its W2 columns copied against the whole
#                                           # W2, alone and beside copies to the GPU: where the columns pay (~2 min)
#   bash benchmarks/h200_suite.sh graph-share  # the CPU's share inside a replayed CUDA graph, Qwen3-30B-A3B and
#                                           # OLMoE-1B-7B shapes: the round trip's cost a layer and 1-4 experts on
#                                           # the CPU, signalled by host functions and by stream memory operations
#                                           # (1 and 2 lanes); a layer of 6 misses, all read by the device against
#                                           # 1-3 of them computed by the CPU meanwhile (~4 min)
#   bash benchmarks/h200_suite.sh graph-bench  # --cpu-experts graph: its GPU tests, then mira bench, Qwen3-30B-A3B
#                                           # and OLMoE-1B-7B shapes at 25% of the experts, 64 in / 64 out, mira,
#                                           # mira-cpu-graph and mira-gpu in one run each, 3 timed repeats (~8 min)
#   bash benchmarks/h200_suite.sh graph-mixtral  # --cpu-experts graph at the Mixtral-8x7B shape replaying the real
#                                           # trace, BUDGETS (default 8GiB) in turns (--interleave): mira, mira-gpu,
#                                           # mira-cpu-graph (its lane count timed at load: one of every thread or
#                                           # two of half each; CONFIGS=...,mira-cpu-graph-1 forces one); host memory
#                                           # and disk logged every 10 s to $OUT/memory.log (~7 min a budget, resumed)
#   bash benchmarks/h200_suite.sh cpu-lanes  # the same shapes' experts on the host's CPU, several at once on 15 /
#                                           # L threads each (L = 2, 3, 5) against one at a time on 15 (~1 min)
#   bash benchmarks/h200_suite.sh gil       # a Mixtral-shaped expert on the CPU worker (15 threads) with the host
#                                           # idle, launching or spinning: in the worker's thread (as python,
#                                           # TorchScript, a short switch interval) against a child process of
#                                           # its own GIL over shared memory (~2 min)
#   bash benchmarks/h200_suite.sh teams     # a CPU worker's expert (15 threads) while this thread's idle OpenMP team
#                                           # of 16 is kept against let go, Qwen3-30B-A3B and Mixtral-8x7B shapes;
#                                           # then cpu_experts.py's int8-shared experts at 1 token on a worker of 15,
#                                           # which now lets the idle team go (~3 min)
#   bash benchmarks/h200_suite.sh pages     # expert blobs in 4 KiB against 2 MiB host pages at the Mixtral, Qwen3 and
#                                           # OLMoE shapes: the CPU executor (15 threads), the pinned copy and the
#                                           # zero-copy kernel (~3 min)
#   bash benchmarks/h200_suite.sh placement  # is a process whose CPU experts run slowly slow on part of its host
#                                           # memory? 24 GB of it filled with a Mixtral-shaped expert, the executor
#                                           # (15 threads) and the pinned copy timed on every blob, in address order
#                                           # and in reverse; in three processes, one after another (~2 min)
#   bash benchmarks/h200_suite.sh miss-path  # a Mixtral expert in 40 GB of pinned host memory: the decode kernel
#                                           # reading it in place against the copy engine (benchmarks/miss_path.py);
#                                           # tells a VM whose zero-copy reads are slow from the usual kind (~30 s)
#   bash benchmarks/h200_suite.sh ncu-int4  # Nsight Compute on one Mixtral-shaped expert's decode launches at batch
#                                           # 1 (benchmarks/decode_launches.py), the stored tuning's: two INT4
#                                           # calls then two INT8 ones; the details page and the raw metrics
#                                           # (occupancy, issue rate, stall reasons) in $OUT; TUNING_DIR=DIR
#                                           # profiles the launches of the tuning files in DIR instead (~1 min)
#   bash benchmarks/h200_suite.sh replay-tiny  # the same at a 12-layer, 8-expert Mixtral-8x7B-shaped config
#                                           # replaying the bundled model's held-out routing, 64 in / 32 out (~4 min)
#   bash benchmarks/h200_suite.sh hybrid-tiny  # that config at 25% and 50%: mira against mira-gpu (the CPU's share
#                                           # off, lagged) and static in one run, then where a decode step's time
#                                           # goes at 50%, mira and mira-gpu: does the CPU's share pay there; and
#                                           # a Mixtral expert's cut jobs on the CPU against the cost model's
#                                           # linear price, alone and beside copies (~6 min)
#   bash benchmarks/h200_suite.sh rule      # the CPU share's A/B between the budgets measured so far, for auto's
#                                           # rule (benchmarks/hybrid_rule.py): mira against mira-gpu, the 12-layer
#                                           # config at 35%, 40% and 45% (held-out routing), then the Mixtral-8x7B
#                                           # shape replaying the real trace at 20 and 28 GiB (~8 min, resumed)
#   bash benchmarks/h200_suite.sh review    # auto's judgements of its CPU share in decoding (every 16 decode steps,
#                                           # at the paces learnt): the 12-layer config replaying held-out routing at
#                                           # 35% and 45%, mira against mira-gpu; then at 25% and 50%, mira, mira-gpu,
#                                           # lru, lfu and static (~8 min, resumed)
#   bash benchmarks/h200_suite.sh review-long  # the 12-layer config at 25% and 50% as in review, but 128 decode
#                                           # tokens a call (every call replays the same rows): more for the
#                                           # policy to learn from than 64x32's 31; mira, lfu, static (~5 min)
#   bash benchmarks/h200_suite.sh review-mixtral  # the same on the Mixtral-8x7B shape replaying the real trace at
#                                           # 24 GiB, the closest call of the committed runs: mira, mira-gpu (~6 min)
#   bash benchmarks/h200_suite.sh calibrate-ab  # does the process that calibrates the CPU share decode it more
#                                           # slowly? The Mixtral-8x7B shape replaying the real trace at 12 GiB,
#                                           # mira, three processes in a row: the first and third calibrate (the
#                                           # saved calibration deleted first), the second reads the saved one (~7 min)
#   TREES="NAME=DIR=COMMIT ..." bash benchmarks/h200_suite.sh trees  # the Mixtral-8x7B shape replaying the real
#                                           # trace at BUDGETS (default 12GiB), mira, 3 timed repeats, with several
#                                           # trees' mira package, a process each, in the order given:
#                                           # is a difference between two VMs the code's or the machine's? DIR holds
#                                           # a commit's mira/ (git archive COMMIT mira | tar -x -C DIR, carried; the
#                                           # bundled model's assets are copied in here), "." is this tree (~2 min each)
#   bash benchmarks/h200_suite.sh pair A B C  # two GPUs: part A on GPU 0 while parts B, C... run in turn on
#                                           # GPU 1, each result's context saying so; GPU 0's output in
#                                           # $OUT/gpu0.log. Host-bound rows (hf-gpu, inline steps) feel
#                                           # a host-heavy part beside them: pair a bench with kernels or
#                                           # tests where that matters
set -euo pipefail
OUT=${OUT:-benchmarks/results}
export MIRA_CACHE=${MIRA_CACHE:-/tmp/mira-cache}
LIMIT=${LIMIT:-560}  # seconds a bench part may run; rerun it to resume
int4_tuning() {  # the INT4 kernels take the int4-tiles part's tuning where it ran on this machine
  if [ -f .carry/tuning/nvidia-h200-int4.json ]; then cp .carry/tuning/nvidia-h200-int4.json mira/kernels/tuning/; fi
}
case "${1:-}" in
  tests)
    # the GPU machine has neither openai, lm_eval nor pydantic: leave out the modules that import them (no gpu tests
    # there); every family under a budget (test_gpu_families.py) is its own part
    # a test still running after 120 s has every thread's stack written to the log (faulthandler, which needs
    # no Python bytecode to run: a thread stuck in CUDA or a join still shows); after 150 s it fails
    # (pytest-timeout, on the GPU machine's image), and the rest go on
    timeout 400 python -m pytest -q -s -m gpu tests -p no:cacheprovider --timeout 150 -o faulthandler_timeout=120 \
      --ignore=tests/e2e/test_conversation_cli.py \
      --ignore=tests/e2e/test_lm_eval_backend.py --ignore=tests/e2e/test_serve.py \
      --ignore=tests/unit/test_serve_tools.py --ignore=tests/unit/test_serve_reply.py \
      --ignore=tests/unit/test_serve_protocol.py \
      --ignore=tests/e2e/test_gpu_families.py 2>&1 \
      | grep -v "Loading weights\|Writing model" | tee "$OUT/gpu-e2e-h200.log" ;;
  families)
    timeout 500 python -m pytest -q -s -m gpu tests/e2e/test_gpu_families.py -p no:cacheprovider \
      -o faulthandler_timeout=120 2>&1 \
      | grep -v "Loading weights\|Writing model" | tee "$OUT/gpu-families-h200.log" ;;
  pipeline)
    timeout 200 python benchmarks/copy_overlap.py --out "$OUT/copy-overlap-h200.json"
    timeout 200 python benchmarks/store_open.py --gb 8 --dir /tmp
    cp benchmarks/results/store-open-h200.json "$OUT/" ;;
  tiny)
    timeout "$LIMIT" python -m mira.cli bench --prompts .carry/bench/sharegpt-heldout.jsonl --num-prompts 2 \
      --budgets 10%,25%,all --configs mira+p,mira+p-lagged,mira+gate,mira,lru,lru-lagged,static,hf-gpu,hf-offload \
      --heads benchmarks/results/predictor-tiny-heads.safetensors --profile benchmarks/results/traces/profile-train.npz \
      --beams 1,2,4,8 --beam-budget 25% --beam-new-tokens 256 --offload-prompts 2 --offload-new-tokens 64 \
      --out "$OUT/bench-mira-tiny-moe.json" --quiet --resume ;;
  qwen3)
    timeout "$LIMIT" python -m mira.cli bench --synthetic qwen3-30b-a3b --fixed 64x256 \
      --budgets 8GiB,12GiB,24GiB,all --configs mira+p,mira,lru,static,hf-gpu,hf-offload \
      --offload-new-tokens 3 --beams 1,2,4,8 --beam-budget 12GiB --beam-new-tokens 256 \
      --out "$OUT/bench-qwen3-30b-a3b.json" --quiet --resume ;;
  deepseek)
    timeout "$LIMIT" python -m mira.cli bench --synthetic deepseek-v2-lite --fixed 64x256 \
      --budgets 8GiB,12GiB,all --configs mira+p,mira+p-lagged,mira,lru,lru-lagged,static,hf-gpu,hf-offload \
      --offload-new-tokens 3 --beams 1,2,4,8 --beam-budget 8GiB --beam-new-tokens 256 \
      --out "$OUT/bench-deepseek-v2-lite.json" --quiet --resume ;;
  mixtral)
    timeout "$LIMIT" python -m mira.cli bench --synthetic mixtral-8x7b --fixed 64x256 \
      --budgets all,48GiB,24GiB,12GiB,8GiB --configs mira+p,mira,lru,static,hf-gpu,hf-offload \
      --offload-new-tokens 3 --beams 1,2,4,8 --beam-budget 24GiB --beam-new-tokens 256 \
      --out "$OUT/bench-mixtral-8x7b.json" --quiet --resume ;;
  lagged)
    timeout 330 python -m mira.cli bench --synthetic qwen3-30b-a3b --fixed 64x256 --budgets 8GiB,24GiB \
      --configs mira-inline,mira-lagged,lru,lru-lagged,static --out "$OUT/bench-qwen3-30b-a3b-lagged.json" --quiet --resume
    timeout 200 python -m mira.cli bench --prompts .carry/bench/sharegpt-heldout.jsonl --num-prompts 2 \
      --budgets 10%,25% --configs mira,mira-lagged,lru,lru-lagged,static \
      --profile benchmarks/results/traces/profile-train.npz --out "$OUT/bench-mira-tiny-moe-lagged.json" --quiet \
      --resume ;;
  staging)
    timeout 220 python -m mira.cli bench --synthetic deepseek-v2-lite --fixed 64x256 --budgets 8GiB,12GiB \
      --configs mira+p-lagged,mira+p,mira --out "$OUT/bench-deepseek-v2-lite-staging.json" --quiet --resume
    timeout 100 python -m mira.cli bench --prompts .carry/bench/sharegpt-heldout.jsonl --num-prompts 2 \
      --budgets 10%,25% --configs mira+p-lagged,mira+p,mira --heads benchmarks/results/predictor-tiny-heads.safetensors \
      --out "$OUT/bench-mira-tiny-moe-staging.json" --quiet --resume ;;
  kernels)
    # the tuning goes to $OUT, not into mira/kernels/tuning, which a bench on another GPU may be reading
    timeout 500 python benchmarks/kernels_int8.py --autotune --spread-gb 40 --tuning-dir "$OUT" \
      --out "$OUT/kernels-h200.json" 2>&1 | tee "$OUT/kernels-h200-autotune.log" ;;
  profile)
    timeout 330 python benchmarks/profile_decode.py --synthetic mixtral-8x7b --budgets 24GiB \
      --configs mira+p,mira,lru,static --out "$OUT/profile-decode-mixtral-8x7b.json" ;;
  profile-small)
    timeout 330 python benchmarks/profile_decode.py --synthetic deepseek-v2-lite --budgets 8GiB \
      --configs mira+p,mira,lru,static --out "$OUT/profile-decode-deepseek-v2-lite.json"
    timeout 150 python benchmarks/profile_decode.py --budgets 10%,all --configs mira+p,mira,lru,static \
      --heads benchmarks/results/predictor-tiny-heads.safetensors --out "$OUT/profile-decode-mira-tiny-moe.json" ;;
  profile-replay)
    timeout 400 python benchmarks/profile_decode.py --synthetic mixtral-8x7b --budgets 25% --configs mira,static \
      --routing benchmarks/results/traces/mixtral-8x7b-instruct-decode.npz \
      --out "$OUT/profile-decode-mixtral-8x7b-replay-25pct.json" ;;
  replay)
    timeout "$LIMIT" python -m mira.cli bench --synthetic mixtral-8x7b \
      --routing benchmarks/results/traces/mixtral-8x7b-instruct-decode.npz --fixed 64x64 --budgets "${BUDGETS:-25%,50%}" \
      --configs mira,lru,lfu,static --repeats 3 ${INTERLEAVE:+--interleave} \
      --out "$OUT/bench-mixtral-8x7b-replay${INTERLEAVE:+-interleaved}.json" --quiet --resume ;;
  hybrid)
    timeout "$LIMIT" python -m mira.cli bench --synthetic mixtral-8x7b \
      --routing benchmarks/results/traces/mixtral-8x7b-instruct-decode.npz --fixed 64x64 --budgets "${BUDGETS:-8GiB,12GiB}" \
      --configs "${CONFIGS:-mira,mira-gpu}" ${THREADS:+--cpu-threads "$THREADS"} --repeats 3 ${INTERLEAVE:+--interleave} \
      --out "$OUT/bench-mixtral-8x7b-hybrid-budgets${THREADS:+-${THREADS}threads}${INTERLEAVE:+-interleaved}.json" --resume ;;
  hybrid-24)
    timeout "$LIMIT" python -m mira.cli bench --synthetic mixtral-8x7b \
      --routing benchmarks/results/traces/mixtral-8x7b-instruct-decode.npz --fixed 64x64 --budgets 24GiB \
      --configs "${CONFIGS:-mira,mira-gpu,mira-cpu-split}" --repeats 3 --out "$OUT/bench-mixtral-8x7b-hybrid-24gib.json" \
      --resume ;;
  settle)
    timeout "$LIMIT" python -m mira.cli bench --synthetic olmoe-1b-7b --fixed 64x64 --budgets 25%,50% \
      --configs "${CONFIGS:-mira,mira-settle-now,static,static-settle-now}" --repeats 3 \
      --out "$OUT/bench-olmoe-1b-7b-settle${CONFIGS:+-reordered}.json" \
      --quiet --resume ;;
  shapes)
    for preset in deepseek-v2-lite qwen3-30b-a3b olmoe-1b-7b; do
      timeout 200 python -m mira.cli bench --synthetic "$preset" --fixed 64x64 --budgets 25%,50% \
        --configs mira,lru,lru-lagged,lfu,static --repeats 3 --out "$OUT/bench-$preset-policies.json" --quiet --resume
    done ;;
  shapes-mixtral)
    timeout "$LIMIT" python -m mira.cli bench --synthetic mixtral-8x7b --fixed 64x64 --budgets 25%,50% \
      --configs mira,static,lfu,lru,lru-lagged --repeats 3 --out "$OUT/bench-mixtral-8x7b-policies.json" --quiet \
      --resume ;;
  int4-hybrid)
    int4_tuning
    timeout "$LIMIT" python -m mira.cli bench --synthetic mixtral-8x7b \
      --routing benchmarks/results/traces/mixtral-8x7b-instruct-decode.npz --fixed 64x64 --budgets 8GiB,12GiB \
      --configs mira,mira-cpu-split,mira-gpu --quant int4 --repeats 3 \
      --out "$OUT/bench-mixtral-8x7b-int4-hybrid.json" --quiet --resume ;;
  int4-tiles)
    timeout 200 python -m pytest -q -s -m gpu -p no:cacheprovider tests/kernels/test_triton_int4.py \
      tests/kernels/test_cpu_experts.py tests/e2e/test_int4_store.py 2>&1 | grep -v "Loading weights\|Writing model" \
      | tee "$OUT/gpu-int4-h200.log" | tail -20
    timeout 60 python benchmarks/cpu_experts.py --threads 15 --shapes mixtral-8x7b --schemes int8-shared,int4 \
      --tokens 1 --repeats 5 --out "$OUT/cpu-experts-int4-h200.json"
    mkdir -p .carry/tuning
    timeout 300 python benchmarks/kernels_int4.py --autotune --shapes mixtral-8x7b --tuning-dir .carry/tuning \
      --out "$OUT/kernels-int4-h200.json" 2>&1 | tail -40
    cp .carry/tuning/*.json "$OUT/" ;;
  int4)
    int4_tuning
    timeout "$LIMIT" python -m mira.cli bench --synthetic mixtral-8x7b \
      --routing benchmarks/results/traces/mixtral-8x7b-instruct-decode.npz --fixed 64x64 --budgets 12GiB,24GiB \
      --configs "${CONFIGS:-mira,static}" --quant int8-shared,int4 --repeats 3 \
      --out "$OUT/bench-mixtral-8x7b-int4.json" --quiet --resume ;;
  cut-columns)
    timeout 300 python benchmarks/cpu_experts.py --threads "${THREADS:-15}" --shapes mixtral-8x7b --schemes int8-shared \
      --tokens 1 --repeats 5 --cuts 7 --out "$OUT/cpu-experts-cuts-columns-h200.json" ;;
  graph-mixtral)
    budgets=${BUDGETS:-8GiB}
    (while true; do echo "$(date +%T) used/available GB $(free -g | awk '/Mem/{print $3, $7}'), disk free $(df -h "$(dirname "$MIRA_CACHE")" | tail -1 | awk '{print $4}')"; sleep 10; done) >> "$OUT/memory.log" &
    monitor=$!
    timeout "$LIMIT" python -m mira.cli bench --synthetic mixtral-8x7b \
      --routing benchmarks/results/traces/mixtral-8x7b-instruct-decode.npz --fixed 64x64 --budgets "$budgets" \
      --configs "${CONFIGS:-mira,mira-gpu,mira-cpu-graph}" --repeats 3 --interleave \
      --out "$OUT/bench-mixtral-8x7b-graph-share-${budgets//,/-}.json" --resume || status=$?
    kill "$monitor"
    exit "${status:-0}" ;;
  graph-share)
    timeout 400 python benchmarks/graph_host_share.py --threads 15 --lanes 1,2 --out "$OUT/graph-host-share-memops-h200.json" ;;
  graph-bench)
    timeout 150 python -m pytest -q -m gpu tests/e2e/test_gpu_graph_share.py
    for preset in qwen3-30b-a3b olmoe-1b-7b; do
      timeout 200 python -m mira.cli bench --synthetic "$preset" --fixed 64x64 --budgets 25% \
        --configs "${CONFIGS:-mira,mira-cpu-graph,mira-gpu}" --repeats 3 --out "$OUT/bench-$preset-graph-share.json" \
        --quiet --resume
    done ;;
  cpu-lanes)
    timeout 200 python benchmarks/cpu_lanes.py --threads 15 --lanes 1,2,3,5 --out "$OUT/cpu-lanes-h200.json" ;;
  gil)
    timeout 300 python benchmarks/cpu_gil.py --threads 15 --calls 16 --out "$OUT/cpu-gil-h200.json" ;;
  teams)
    timeout 200 python benchmarks/cpu_teams.py --threads 15 --caller-threads 16 --out "$OUT/cpu-teams-h200.json"
    timeout 200 python benchmarks/cpu_experts.py --threads 15 --shapes qwen3-30b-a3b,olmoe-1b-7b,deepseek-v2-lite,mixtral-8x7b \
      --schemes int8-shared --tokens 1 --out "$OUT/cpu-experts-h200-15t-teams.json" ;;
  pages)
    timeout 400 python benchmarks/host_pages.py --threads 15 --shapes mixtral-8x7b,qwen3-30b-a3b,olmoe-1b-7b \
      --spread-gb 4 --out "$OUT/host-pages-h200.json" ;;
  placement)
    for run in 1 2 3; do
      timeout 150 python benchmarks/host_placement.py --gb 24 --threads 15 --out "$OUT/host-placement-$run.json"
    done ;;
  miss-path)
    timeout 150 python benchmarks/miss_path.py --gb 40 --out "$OUT/miss-path.json" ;;
  ncu-int4)
    ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
    timeout 230 "$ncu" --kernel-name regex:gemv --launch-skip 20 --launch-count 8 --section SpeedOfLight \
      --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy \
      --section LaunchStats --section ComputeWorkloadAnalysis --section InstructionStats --section SourceCounters \
      -o "$OUT/ncu-int4-h200" python benchmarks/decode_launches.py --calls 12 ${TUNING_DIR:+--tuning-dir "$TUNING_DIR"}
    "$ncu" -i "$OUT/ncu-int4-h200.ncu-rep" --page details > "$OUT/ncu-int4-h200.txt"
    "$ncu" -i "$OUT/ncu-int4-h200.ncu-rep" --page raw --csv > "$OUT/ncu-int4-h200-raw.csv" ;;
  replay-tiny)
    timeout "$LIMIT" python -m mira.cli bench --synthetic benchmarks/configs/mixtral-8x7b-12-layers \
      --routing benchmarks/results/traces/heldout.npz --fixed 64x32 --budgets 25%,50% \
      --configs mira,lru,lru-lagged,lfu,static --repeats 3 --out "$OUT/bench-mixtral-12-layers-replay.json" --quiet \
      --resume ;;
  hybrid-tiny)
    timeout 300 python -m mira.cli bench --synthetic benchmarks/configs/mixtral-8x7b-12-layers \
      --routing benchmarks/results/traces/heldout.npz --fixed 64x32 --budgets 25%,50% \
      --configs mira,mira-gpu,static --repeats 3 --out "$OUT/bench-mixtral-12-layers-hybrid.json" --resume
    timeout 200 python benchmarks/profile_decode.py --synthetic benchmarks/configs/mixtral-8x7b-12-layers \
      --routing benchmarks/results/traces/heldout.npz --budgets 50% --configs mira,mira-gpu \
      --out "$OUT/profile-decode-mixtral-12-layers-replay-50pct.json"
    timeout 100 python benchmarks/cpu_experts.py --threads 15 --shapes mixtral-8x7b --schemes int8-shared --cuts 8 \
      --out "$OUT/cpu-experts-cuts-h200.json" ;;
  rule)
    timeout 200 python -m mira.cli bench --synthetic benchmarks/configs/mixtral-8x7b-12-layers \
      --routing benchmarks/results/traces/heldout.npz --fixed 64x32 --budgets 35%,40%,45% \
      --configs mira,mira-gpu --repeats 3 --out "$OUT/bench-mixtral-12-layers-hybrid-rule.json" --quiet --resume
    timeout "$((LIMIT - 200))" python -m mira.cli bench --synthetic mixtral-8x7b \
      --routing benchmarks/results/traces/mixtral-8x7b-instruct-decode.npz --fixed 64x64 --budgets 20GiB,28GiB \
      --configs mira,mira-gpu --repeats 3 --out "$OUT/bench-mixtral-8x7b-hybrid-rule.json" --quiet --resume ;;
  pair)
    [ $# -ge 3 ] || { echo "pair: name a part for GPU 0 and at least one for GPU 1" >&2; exit 2; }
    first=$2; shift 2
    CUDA_VISIBLE_DEVICES=0 MIRA_RUN_CONTEXT="GPU 0 of two; GPU 1 ran the parts $* of h200_suite.sh meanwhile" \
      bash "$0" "$first" > "$OUT/gpu0.log" 2>&1 &
    for part in "$@"; do
      CUDA_VISIBLE_DEVICES=1 MIRA_RUN_CONTEXT="GPU 1 of two; GPU 0 ran the part $first of h200_suite.sh meanwhile" \
        bash "$0" "$part" || true
    done
    wait ;;
  review)
    timeout 200 python -m mira.cli bench --synthetic benchmarks/configs/mixtral-8x7b-12-layers \
      --routing benchmarks/results/traces/heldout.npz --fixed 64x32 --budgets 35%,45% \
      --configs mira,mira-gpu --repeats 3 --out "$OUT/bench-mixtral-12-layers-review-between.json" --quiet --resume
    timeout "$((LIMIT - 200))" python -m mira.cli bench --synthetic benchmarks/configs/mixtral-8x7b-12-layers \
      --routing benchmarks/results/traces/heldout.npz --fixed 64x32 --budgets 25%,50% \
      --configs mira,mira-gpu,lru,lfu,static --repeats 3 --out "$OUT/bench-mixtral-12-layers-review.json" --quiet \
      --resume ;;
  review-long)
    timeout "$LIMIT" python -m mira.cli bench --synthetic benchmarks/configs/mixtral-8x7b-12-layers \
      --routing benchmarks/results/traces/heldout.npz --fixed 64x128 --budgets 25%,50% \
      --configs mira,lfu,static --repeats 3 --out "$OUT/bench-mixtral-12-layers-review-long.json" --quiet --resume ;;
  review-mixtral)
    timeout "$LIMIT" python -m mira.cli bench --synthetic mixtral-8x7b \
      --routing benchmarks/results/traces/mixtral-8x7b-instruct-decode.npz --fixed 64x64 --budgets 24GiB \
      --configs mira,mira-gpu --repeats 3 --out "$OUT/bench-mixtral-8x7b-review.json" --quiet --resume ;;
  calibrate-ab)
    for run in 1 2 3; do
      if [ "$run" != 2 ]; then rm -rf "$MIRA_CACHE/calibration"; fi  # mira.runtime.hybrid.calibration_dir
      timeout 190 python -m mira.cli bench --synthetic mixtral-8x7b \
        --routing benchmarks/results/traces/mixtral-8x7b-instruct-decode.npz --fixed 64x64 --budgets 12GiB \
        --configs mira --repeats 3 --out "$OUT/bench-mixtral-8x7b-calibrate-ab-$run.json" --quiet || true
    done ;;
  trees)
    [ -n "${TREES:-}" ] || { echo "trees: set TREES=\"NAME=DIR=COMMIT ...\" (DIR holding that commit's mira/)" >&2; exit 2; }
    root=$PWD; mkdir -p "$OUT"; out=$(cd "$OUT" && pwd)
    for tree in $TREES; do
      IFS== read -r name dir commit <<< "$tree"
      [ -d "$dir/mira/assets" ] || cp -r mira/assets "$dir/mira/"
      (cd "$dir" && MIRA_COMMIT=$commit PYTHONPATH=$PWD timeout 200 python -m mira.cli bench --synthetic mixtral-8x7b \
        --routing "$root/benchmarks/results/traces/mixtral-8x7b-instruct-decode.npz" --fixed 64x64 \
        --budgets "${BUDGETS:-12GiB}" --configs mira --repeats 3 --out "$out/bench-mixtral-8x7b-hybrid-trees-$name.json" \
        --quiet) || true
    done ;;
  *)
    sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 2 ;;
esac
