#!/usr/bin/env bash
# One device call: the GPU steps named on the command line, each under its own timeout, logs to $OUT.
# usage: bash benchmarks/run_gpu_steps.sh profile-small capacity throughput-small ...
# vLLM steps need its bundle on PYTHONPATH already (../shared/peers/vllm: /root/vllm/site:/root/vllm/deps)
export PYTHONPATH=$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
OUT=${OUT:-/tmp/kvfit-out}; mkdir -p "$OUT"
kvfit() { python3 -m kvfit.cli "$@"; }
step() { local name=$1 limit=$2; shift 2; echo "=== $name ($(date -u +%FT%TZ))"; timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | tail -${TAIL:-25}; echo "=== $name rc=${PIPESTATUS[0]}"; }
for s in "$@"; do case $s in
  profile-small) step profile-small 240 python3 -m kvfit.cli profile qwen3-0.6b --load-format dummy --device cuda --json --plot "$OUT/memory-qwen3-0.6b.png" ;;
  profile-8b) step profile-8b 300 python3 -m kvfit.cli profile llama-3.1-8b --load-format dummy --device cuda --json --plot "$OUT/memory-llama-3.1-8b.png" ;;
  plan-small) step plan-small 60 python3 -m kvfit.cli plan qwen3-0.6b --gpu H200 --json ;;
  plan-8b) step plan-8b 60 python3 -m kvfit.cli plan llama-3.1-8b --gpu H200 --json ;;
  capacity) step capacity 400 python3 -m pytest tests/gpu/test_capacity_gpu.py -q -s -p no:cacheprovider ;;
  gputests) step gputests 400 python3 -m pytest tests/gpu -q -p no:cacheprovider ;;
  throughput-small) step throughput-small 420 python3 benchmarks/bench_throughput.py --model qwen3-0.6b --hf-batch 256 ;;
  throughput-8b) step throughput-8b 540 python3 benchmarks/bench_throughput.py --model llama-3.1-8b --hf-batch 64 --hf-requests 64 --hf-static ;;
  latency-8b) step latency-8b 300 python3 benchmarks/bench_decode_latency.py --model llama-3.1-8b ;;
  latency-8b-nopdl) step latency-8b-nopdl 300 env KVFIT_PDL=0 python3 benchmarks/bench_decode_latency.py --model llama-3.1-8b ;;
  first-run-small) step first-run-small 300 python3 benchmarks/first_run_compiles.py --model qwen3-0.6b ;;
  pdl-tests) step pdl-tests 300 python3 -m pytest tests/kernels/test_fused_ops.py tests/kernels/test_gemv.py tests/gpu/test_triton_gpu.py tests/gpu/test_engine_gpu.py -q -p no:cacheprovider ;;
  decode-long-8b) step decode-long-8b 300 python3 benchmarks/bench_decode_attention.py --batch 32 256 --context 8192 736 --q-heads 32 --kv-heads 8 --sweep ;;
  profile-long-kvfit) step profile-long-kvfit 400 python3 benchmarks/profile_vs_vllm.py --models qwen3-0.6b --workload long-context --engines kvfit --out "$OUT/profile-long-kvfit.json" ;;
  latency-8b-k16) step latency-8b-k16 300 python3 benchmarks/bench_decode_latency.py --model llama-3.1-8b --num-scheduler-steps 16 ;;
  profile-step) step profile-step 300 python3 benchmarks/profile_step.py --model qwen3-0.6b ;;
  engine-gpu) step engine-gpu 300 python3 -m pytest tests/gpu/test_engine_gpu.py -q -p no:cacheprovider ;;
  kernels-small) step kernels-small 240 python3 benchmarks/profile_kernels.py --model qwen3-0.6b ;;
  kernels-8b-fp8) step kernels-8b-fp8 300 python3 benchmarks/profile_kernels.py --model llama-3.1-8b --quantization fp8 ;;
  kernels-30b-fp8) step kernels-30b-fp8 300 python3 benchmarks/profile_kernels.py --model qwen3-30b-a3b --fp8-checkpoint block --num-requests 64 ;;
  kernels-8b) step kernels-8b 240 python3 benchmarks/profile_kernels.py --model llama-3.1-8b --num-requests 1 ;;
  gemv) step gemv 240 python3 benchmarks/bench_gemv.py --model llama-3.1-8b ;;
  decode-shared) step decode-shared 200 bash -c "python3 benchmarks/bench_decode_attention.py --batch 256 --context 2448 --block-size 16 --q-heads 16 --kv-heads 8 && python3 benchmarks/bench_decode_attention.py --batch 256 --context 2448 --block-size 16 --q-heads 16 --kv-heads 8 --shared-prefix 2000 --cascade && python3 benchmarks/bench_decode_attention.py --batch 64 256 --context 2448 --block-size 16 --q-heads 32 --kv-heads 8 --shared-prefix 2000 --cascade" ;;
  cascade-rule) step cascade-rule 400 bash -c "for p in 256 512 1024 2000; do python3 benchmarks/bench_decode_attention.py --batch 8 16 32 64 128 256 --context \$((p + 200)) --block-size 16 --q-heads 16 --kv-heads 8 --shared-prefix \$p --cascade --no-search --graphs; done; for p in 512 2000; do python3 benchmarks/bench_decode_attention.py --batch 16 64 256 --context \$((p + 200)) --block-size 16 --q-heads 32 --kv-heads 8 --shared-prefix \$p --cascade --no-search --graphs; done" ;;
  decode-grid) step decode-grid 300 python3 benchmarks/bench_decode_attention.py --sweep ;;
  fused) step fused 120 python3 -m pytest tests/kernels/test_fused_ops.py tests/gpu/test_triton_gpu.py -q -p no:cacheprovider ;;
  fused-moe) step fused-moe 480 python3 benchmarks/bench_fused_moe.py ;;
  fused-moe-fp8) TAIL=${TAIL:-60} step fused-moe-fp8 420 python3 benchmarks/bench_fused_moe.py --fp8 block --shapes qwen3-30b-a3b --budget-s 270 ;;
  moe-gpu) step moe-gpu 300 python3 -m pytest tests/gpu/test_moe_gpu.py tests/kernels/test_fused_moe.py -q -s -p no:cacheprovider ;;
  vs-vllm-moe) step vs-vllm-moe 1200 python3 benchmarks/bench_vs_vllm.py --models qwen3-30b-a3b mixtral-8x7b ;;
  vs-vllm-base) step vs-vllm-base 560 python3 benchmarks/bench_vs_vllm.py --models qwen3-0.6b llama-3.1-8b --out "$OUT/vs-base.json" ;;
  vs-vllm-long) step vs-vllm-long 560 python3 benchmarks/bench_vs_vllm.py --models qwen3-0.6b llama-3.1-8b --groups long --out "$OUT/vs-long.json" ;;
  kvfit-long-16k) step kvfit-long-16k 400 env KVFIT_BENCH_ARGS='{"max_num_batched_tokens": 16384}' python3 benchmarks/bench_vs_vllm.py --models qwen3-0.6b llama-3.1-8b --groups long --engines kvfit --out "$OUT/kvfit-long-16k.json" ;;
  kvfit-long) step kvfit-long 400 python3 benchmarks/bench_vs_vllm.py --models qwen3-0.6b llama-3.1-8b --groups long --engines kvfit --out "$OUT/kvfit-long.json" ;;
  kvfit-long-prefill128) step kvfit-long-prefill128 400 env KVFIT_BENCH_PREFILL='[128, 128, 8, 3]' python3 benchmarks/bench_vs_vllm.py --models qwen3-0.6b llama-3.1-8b --groups long --engines kvfit --out "$OUT/kvfit-long-prefill128.json" ;;
  attn-gpu) step attn-gpu 300 python3 -m pytest tests/gpu/test_triton_gpu.py tests/gpu/test_engine_gpu.py -q -p no:cacheprovider ;;
  decode-shared-8b) step decode-shared-8b 200 python3 benchmarks/bench_decode_attention.py --batch 64 256 --context 2384 --block-size 16 --q-heads 32 --kv-heads 8 --shared-prefix 2000 --cascade --no-search --graphs ;;
  prefill-attn-8b) step prefill-attn-8b 200 python3 benchmarks/bench_prefill_attention.py --sweep --q-heads 32 ;;
  profile-long) step profile-long 400 python3 benchmarks/profile_vs_vllm.py --models qwen3-0.6b --workload long-context --out "$OUT/profile-long.json" ;;
  decode-long) step decode-long 300 python3 benchmarks/bench_decode_attention.py --batch 32 256 --context 8192 736 --q-heads 16 --kv-heads 8 --sweep ;;
  cudnn-probe) step cudnn-probe 240 bash -c "python3 benchmarks/probe_cudnn_attention.py && python3 benchmarks/probe_cudnn_attention.py --q-heads 32" ;;
  prefill-attn) step prefill-attn 300 bash -c "python3 benchmarks/bench_prefill_attention.py --sweep && python3 benchmarks/bench_prefill_attention.py --sweep --q-heads 32" ;;
  sanitizer) step sanitizer-bf16 280 compute-sanitizer --tool memcheck --print-limit 20 python3 tests/gpu/test_kernel_safety.py; step sanitizer-fp8 280 compute-sanitizer --tool memcheck --print-limit 20 python3 tests/gpu/test_kernel_safety.py --kv-cache-dtype fp8 ;;
  fp8-gpu) step fp8-gpu 330 python3 -m pytest tests/gpu/test_fp8_gpu.py tests/kernels/test_fp8_gemm.py -q -s -p no:cacheprovider ;;
  capacity-new) step capacity-new 300 python3 -m pytest tests/gpu/test_co_tenants_gpu.py tests/gpu/test_sampler_reserve_gpu.py tests/gpu/test_headroom_gpu.py -q -s -p no:cacheprovider ;;
  serve-small) TAIL=${TAIL:-40} step serve-small 400 python3 benchmarks/bench_serve.py --model qwen3-0.6b --engines kvfit,vllm,offline --num-requests 512 --rates inf --runs 2 --out "$OUT/serve-small.json" --py-spy "$OUT/spy" ;;
  serve-2000) step serve-2000 300 python3 benchmarks/bench_serve.py --model qwen3-0.6b --engines kvfit,vllm --num-requests 2000 --rates inf --runs 1 --out "$OUT/serve-2000.json" ;;
  serve-2000-8b) TAIL=${TAIL:-30} step serve-2000-8b 480 python3 benchmarks/bench_serve.py --model llama-3.1-8b --engines kvfit,vllm --num-requests 2000 --rates inf --runs 1 --kvfit-args "--log-level info" --out "$OUT/serve-2000-8b.json" ;;
  serve-2000-8b-kvfit) TAIL=${TAIL:-30} step serve-2000-8b-kvfit 300 python3 benchmarks/bench_serve.py --model llama-3.1-8b --engines kvfit --num-requests 2000 --rates inf --runs 1 --kvfit-args "--log-level info" --out "$OUT/serve-2000-8b-kvfit.json" ;;
  kernels-8b-fp8-kv) TAIL=${TAIL:-45} step kernels-8b-fp8-kv 300 bash -c "python3 benchmarks/profile_kernels.py --model llama-3.1-8b --fp8-checkpoint channel --kv-cache-dtype fp8 --calculate-kv-scales && python3 benchmarks/profile_kernels.py --model llama-3.1-8b --fp8-checkpoint channel --kv-cache-dtype fp8 --calculate-kv-scales --num-requests 1" ;;
  decode-fp8-kv) TAIL=${TAIL:-40} step decode-fp8-kv 240 bash -c "for d in bfloat16 fp8_e4m3; do python3 benchmarks/bench_decode_attention.py --batch 1 256 --context 647 --block-size 16 --q-heads 32 --kv-heads 8 --kv-cache-dtype \$d; done" ;;
  headroom-probe) TAIL=${TAIL:-30} step headroom-probe 200 env PYTHONPATH=$PWD/src:$PWD/tests python3 benchmarks/probe_headroom.py new ;;
  serve-1step) TAIL=${TAIL:-60} step serve-1step 150 python3 benchmarks/bench_serve.py --model qwen3-0.6b --engines kvfit --num-requests 256 --rates 30 --runs 1 --kvfit-args "--num-scheduler-steps 1" --py-spy "$OUT/spy-1step" ;;
  serve-rates) TAIL=${TAIL:-60} step serve-rates 560 python3 benchmarks/bench_serve.py --model qwen3-0.6b --engines kvfit,vllm,offline --num-requests 512 --rates inf,30,54 --runs 2 --out "$OUT/serve-rates.json" --py-spy "$OUT/spy" --stack-samples "$OUT/stacks" ;;
  fp8-30b-vs-vllm) TAIL=${TAIL:-30} step fp8-30b-vs-vllm 560 env KVFIT_BENCH_FP8=block python3 benchmarks/bench_vs_vllm.py --models qwen3-30b-a3b --reps 2 --out "$OUT/fp8-30b.json" ;;
  profile-30b-fp8) TAIL=${TAIL:-60} step profile-30b-fp8 560 env KVFIT_BENCH_FP8=block python3 benchmarks/profile_vs_vllm.py --models qwen3-30b-a3b --workload throughput --top 20 --out "$OUT/profile-30b-fp8.json" ;;
  fp8-8b-vs-vllm) TAIL=${TAIL:-30} step fp8-8b-vs-vllm 420 env KVFIT_BENCH_FP8=channel python3 benchmarks/bench_vs_vllm.py --models llama-3.1-8b --reps 2 --out "$OUT/fp8-8b.json" ;;
  bf16-8b-kvfit) TAIL=${TAIL:-30} step bf16-8b-kvfit 200 python3 benchmarks/bench_vs_vllm.py --models llama-3.1-8b --engines kvfit --reps 2 --out "$OUT/bf16-8b-kvfit.json" ;;
  fp8-verify) TAIL=${TAIL:-40} step fp8-verify 420 bash -c "python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fp8_gpu.py -k 'cublas_blockwise or norm_quantizing or block_gemm or tiny' && python3 benchmarks/bench_fp8_block_gemm.py --m 16 64 256 1024 4096 8192 && KVFIT_BENCH_FP8=block python3 benchmarks/bench_vs_vllm.py --models qwen3-30b-a3b --engines kvfit --reps 2 --out $OUT/fp8-verify-30b.json" ;;
  profile-8b-fp8) TAIL=${TAIL:-60} step profile-8b-fp8 560 env KVFIT_BENCH_FP8=channel python3 benchmarks/profile_vs_vllm.py --models llama-3.1-8b --workload throughput --top 20 --out "$OUT/profile-8b-fp8.json" ;;
  routing-30b) step routing-30b 500 python3 benchmarks/probe_moe_routing.py --model qwen3-30b-a3b --fp8-checkpoint block --engines kvfit vllm vllm-redrawn ;;
  fp8-quantize) step fp8-quantize 200 python3 benchmarks/bench_fp8_quantize.py ;;
  fp8-block-gemm) TAIL=${TAIL:-40} step fp8-block-gemm 300 python3 benchmarks/bench_fp8_block_gemm.py --model qwen3-30b-a3b ;;
  fp8-channel-tests) TAIL=${TAIL:-15} step fp8-channel-tests 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_gemm.py tests/gpu/test_fp8_gpu.py -k "channel or block_gemm_kernel or cublas_blockwise or norm_quantizing or block_gemm or tiny" ;;
  fp8-channel-tune) TAIL=${TAIL:-30} step fp8-channel-tune 330 python3 benchmarks/tune_fp8_channel_gemm.py --model llama-3.1-8b --write /root/fp8_channel_gemm.json --json "$OUT/fp8-channel-tune.json"; cp /root/fp8_channel_gemm.json "$OUT/" ;;
  fp8-channel-8b-kvfit) TAIL=${TAIL:-12} step fp8-channel-8b-kvfit 300 bash -c "KVFIT_FP8_GEMM_CONFIGS=/root/fp8_channel_gemm.json KVFIT_BENCH_FP8=channel python3 benchmarks/bench_vs_vllm.py --models llama-3.1-8b --engines kvfit --reps 2 --out $OUT/fp8-8b-tuned.json && KVFIT_FP8_GEMM_CONFIGS=off KVFIT_BENCH_FP8=channel python3 benchmarks/bench_vs_vllm.py --models llama-3.1-8b --engines kvfit --reps 2 --out $OUT/fp8-8b-scaled-mm.json" ;;
  gpu-short) TAIL=${TAIL:-15} step gpu-short 200 python3 -m pytest -q -p no:cacheprovider "tests/gpu/test_engine_gpu.py::test_cuda_graphs_and_multi_step_match_transformers[tiny_llama_yarn]" tests/gpu/test_capacity_gpu.py ;;
  serve-policy) TAIL=${TAIL:-40} step serve-policy 580 bash -c "python3 benchmarks/bench_serve.py --model qwen3-0.6b --engines kvfit,vllm --num-requests 512 --rates 30,54 --runs 2 --out $OUT/serve-policy-default.json && python3 benchmarks/bench_serve.py --model qwen3-0.6b --engines kvfit --num-requests 512 --rates 30,54 --runs 2 --kvfit-args '--num-scheduler-steps 1' --out $OUT/serve-policy-1step.json" ;;
  fp8-kv-8b) TAIL=${TAIL:-20} step fp8-kv-8b 420 bash -c "KVFIT_BENCH_FP8=channel KVFIT_BENCH_ARGS='{\"kv_cache_dtype\": \"fp8\", \"calculate_kv_scales\": true}' python3 benchmarks/bench_vs_vllm.py --models llama-3.1-8b --engines kvfit --reps 2 --out $OUT/fp8-w-fp8-kv-8b.json && python3 benchmarks/bench_vs_vllm.py --models llama-3.1-8b --engines kvfit --reps 2 --out $OUT/bf16-8b-same-call.json && python3 benchmarks/bench_kv_fp8_accuracy.py --device cuda" ;;
  fp8-kv-8b-short) TAIL=${TAIL:-12} step fp8-kv-8b-short 330 bash -c "KVFIT_BENCH_FP8=channel KVFIT_BENCH_ARGS='{\"kv_cache_dtype\": \"fp8\", \"calculate_kv_scales\": true}' python3 benchmarks/bench_vs_vllm.py --models llama-3.1-8b --engines kvfit --reps 2 --out $OUT/fp8-w-fp8-kv-8b.json && python3 benchmarks/bench_vs_vllm.py --models llama-3.1-8b --engines kvfit --reps 2 --out $OUT/bf16-8b-same-call.json" ;;
  fp8-kv-8b-vs-vllm) TAIL=${TAIL:-30} step fp8-kv-8b-vs-vllm 560 env KVFIT_BENCH_FP8=channel KVFIT_BENCH_ARGS='{"kv_cache_dtype": "fp8", "calculate_kv_scales": true}' VLLM_BENCH_ARGS='{"kv_cache_dtype": "fp8"}' python3 benchmarks/bench_vs_vllm.py --models llama-3.1-8b --reps 2 --out "$OUT/fp8-kv-8b-vs-vllm.json" ;;
  fp8-decode-probe) TAIL=${TAIL:-60} step fp8-decode-probe 300 python3 benchmarks/probe_fp8_decode.py --batch 256 64 --context 647 2048 --write /root/fp8_decode.json; cp /root/fp8_decode.json "$OUT/" 2>/dev/null ;;
  fp8-kv-8b-best-decode) TAIL=${TAIL:-12} step fp8-kv-8b-best-decode 300 bash -c "test -s /root/fp8_decode.json || { echo 'no /root/fp8_decode.json: run fp8-decode-probe first'; exit 2; }; KVFIT_BENCH_FP8_DECODE=\$(cat /root/fp8_decode.json) KVFIT_BENCH_FP8=channel KVFIT_BENCH_ARGS='{\"kv_cache_dtype\": \"fp8\", \"calculate_kv_scales\": true}' python3 benchmarks/bench_vs_vllm.py --models llama-3.1-8b --engines kvfit --reps 2 --out $OUT/fp8-kv-8b-best-decode.json" ;;
  fp8-kv-8b-fp8-dots) TAIL=${TAIL:-12} step fp8-kv-8b-fp8-dots 300 bash -c "KVFIT_BENCH_FP8_DECODE='[128, 4, 2, \"fp8\"]' KVFIT_BENCH_FP8=channel KVFIT_BENCH_ARGS='{\"kv_cache_dtype\": \"fp8\", \"calculate_kv_scales\": true}' python3 benchmarks/bench_vs_vllm.py --models llama-3.1-8b --engines kvfit --reps 2 --out $OUT/fp8-kv-8b-fp8-dots.json" ;;
  mixed-probe) TAIL=${TAIL:-30} step mixed-probe 300 bash -c "python3 benchmarks/probe_mixed_step.py --model qwen3-0.6b && python3 benchmarks/probe_mixed_step.py --model llama-3.1-8b --chunks 0 128 512 1024" ;;
  prefill-fp8) TAIL=${TAIL:-40} step prefill-fp8 240 python3 benchmarks/bench_prefill_attention.py --q-heads 32 --kv-cache-dtype fp8_e4m3 --out "$OUT/prefill-fp8.json" ;;
  fp8-kv-8b-prefill-dots) TAIL=${TAIL:-12} step fp8-kv-8b-prefill-dots 420 bash -c "for d in pairs query; do KVFIT_BENCH_FP8_PREFILL=\$d KVFIT_BENCH_FP8=channel KVFIT_BENCH_ARGS='{\"kv_cache_dtype\": \"fp8\", \"calculate_kv_scales\": true}' python3 benchmarks/bench_vs_vllm.py --models llama-3.1-8b --engines kvfit --reps 2 --out $OUT/fp8-kv-8b-prefill-\$d.json; done" ;;
  kv-vs-vllm) step kv-vs-vllm 480 python3 benchmarks/bench_vs_vllm.py --models qwen3-0.6b llama-3.1-8b --groups capacity --reps 1 --out "$OUT/kv-vs-vllm.json" ;;
  *) echo "unknown step $s" ;;
esac; done
