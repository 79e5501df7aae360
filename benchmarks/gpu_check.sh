#!/bin/bash
# The GPU issue's checks ([24]) on a lent machine, in one run, everything bounded:
#
#   bash benchmarks/gpu_check.sh [tests] [bench] [serve] [moe]     (default: all four)
#
# One call of the device tool holds at most 10 minutes: run `tests bench serve` in one and
# `moe` in the next while the machine is warm (the kernels' build and the model files
# written in the first, in the background while the tests run, are still there).
#
# It expects what the machine lacks carried in the working tree: .whl/ (kvlm's runtime
# dependencies and transformers as cp312 wheels: the machine has no network) and
# .devmodels/tok.gguf (the default model's tokenizer alone, for random-weight files of
# real shapes written there by kvlm.bench.models.write_model). Logs go to $OUT (the
# device tool's folder), else ./gpu-out. To make them, in the repository (both ignored):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     fastapi starlette pydantic pydantic_core uvicorn llguidance gguf openai jiter distro \
#     sniffio jsonschema jsonschema-specifications referencing rpds-py annotated-types \
#     typing-inspection transformers opentelemetry-api httpx2 httpcore2 truststore idna \
#     typing_extensions anyio regex      (the versions of this venv's `pip list`)
#   python -c "...kvlm.bench.models._copy_tokenizer(gguf.GGUFWriter('.devmodels/tok.gguf',
#     'llama'), <the default model's file>, 49152)..." (write the header, kv data, close)
#   tests: tests/test_gpu.py (every family, cache mode and road on the device)
#   bench: benchmarks/bench_gpu.py on the SmolLM2-135M, Qwen2.5-0.5B and LFM2-350M shapes
#          (single stream, engine at 1/8/64 streams, one forward a step; a profile of
#          a 64-row step on the 0.5B shape) and the device's plain copy bandwidth
#   serve: benchmarks/bench_serve.py through a real `kvlm serve --device cuda` (0.5B shape)
#   streams: the engine at 1/8/64 streams on LFM2-350M and the Qwen3-30B-A3B 8-layer slice,
#          each step profiled at 1 and 64 streams (GPU kernels and the host's side)
#   moe:   benchmarks/bench_gpu.py --moe: experts on the GPU against --cpu-experts, on the
#          Qwen3-30B-A3B shape's 8-layer slice (Q8_0) and gpt-oss-20b's 4-layer slice
#          (MXFP4), and the whole gpt-oss-20b with its experts on the host
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
phases=${*:-tests bench serve moe}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests:$PWD/benchmarks PYTHONUNBUFFERED=1
{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    nproc
    python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
    python3 -c "from kvlm import kernels; kernels.library()" 2>&1 | tail -2  # the C build
} 2>&1 | tee "$OUT/env.txt"
write() {  # shape file-type name: /tmp/NAME.gguf, once
    [ -e "/tmp/$3.gguf" ] || python3 -c "
from pathlib import Path
from kvlm.bench.models import write_model
write_model('$1', '$2', Path('/tmp/$3.part'), Path('.devmodels/tok.gguf'))
Path('/tmp/$3.part').rename('/tmp/$3.gguf')"
}
models() {
    write smollm2-135m Q8_0 smol && write qwen2.5-0.5b Q8_0 q05 && write lfm2-350m Q8_0 lfm2
}
moe_models() {
    write qwen3-30b-a3b-8l Q8_0 moe8l && write gpt-oss-20b-4l MXFP4_MOE gptoss4l &&
        write gpt-oss-20b MXFP4_MOE gptoss
}
# every file the phases read, written in the background beside the kernels' build and the
# tests (16 cores); a phase waits for the writer of its files (a killed writer leaves only
# a .part, written again by the next run)
case "$phases" in *bench*|*serve*|*streams*) models > "$OUT/models.log" 2>&1 & DENSE=$!;; esac
# (PREP_MOE=1: the moe phase's files too, for a next run on the same warm machine)
if [[ "$phases" == *moe* || "$phases" == *streams* || -n "$PREP_MOE" ]]; then
    moe_models > "$OUT/moe_models.log" 2>&1 &
    MOE=$!
fi
for phase in $phases; do
    echo "== $phase $(date -u +%T)"
    case $phase in
    tests)
        timeout 260 python3 -m pytest -q -p no:cacheprovider --durations=20 tests/test_gpu.py \
            2>&1 | tee "$OUT/tests.log" | tail -40 ;;
    bench)
        wait $DENSE
        timeout 60 python3 -c "
import torch
x = torch.empty(2**30, dtype=torch.uint8, device='cuda'); y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
torch.cuda.synchronize(); s, e = torch.cuda.Event(True), torch.cuda.Event(True)
s.record(); [y.copy_(x) for _ in range(20)]; e.record(); torch.cuda.synchronize()
print('plain copy GB/s (read + write)', round(2 * 20 * 2**30 / (s.elapsed_time(e) / 1e3) / 1e9))
" 2>&1 | tee "$OUT/bench.log"
        timeout 110 python3 benchmarks/bench_gpu.py --no-hf --roads one --streams 1,8,64 \
            --profile 64 /tmp/q05.gguf /tmp/lfm2.gguf 2>&1 | tee -a "$OUT/bench.log" ;;
    serve)
        wait $DENSE
        timeout 80 python3 benchmarks/bench_serve.py --phases streams --streams 1,8,64 \
            --requests 2 --max-tokens 128 --threads 8 --json "$OUT/serve.json" --serve-args \
            "--model /tmp/q05.gguf --device cuda --dtype bf16 --max-num-seqs 64 --max-waiting 128" \
            2>&1 | tee "$OUT/serve.log" ;;
    streams)
        wait $DENSE
        timeout 70 python3 benchmarks/bench_gpu.py --no-hf --roads one --streams 1,8,64 \
            --profile 1,64 /tmp/lfm2.gguf 2>&1 | tee "$OUT/streams.log"
        # the 8-layer slice is the writer's first file: no wait for the gpt-oss ones after it
        until [ -e /tmp/moe8l.gguf ] || ! kill -0 "$MOE" 2>/dev/null; do sleep 1; done
        timeout 120 python3 benchmarks/bench_gpu.py --no-hf --roads one --streams 1,8,64 \
            --profile 1,64 /tmp/moe8l.gguf 2>&1 | tee -a "$OUT/streams.log" ;;
    moe)
        wait $MOE
        timeout 100 python3 benchmarks/bench_gpu.py --moe /tmp/moe8l.gguf --moe-roads 0,all \
            --moe-seconds 90 2>&1 | tee "$OUT/moe.log"
        # gpt-oss: its 4-layer slice both ways; the whole 20b with every expert on the host
        # (the GPU road would first dequantize 12 GB of MXFP4 to bf16 through gguf-py's
        # numpy on the host: minutes)
        timeout 100 python3 benchmarks/bench_gpu.py --moe /tmp/gptoss4l.gguf --moe-roads 0,all \
            --moe-seconds 90 2>&1 | tee -a "$OUT/moe.log"
        timeout 100 python3 benchmarks/bench_gpu.py --moe /tmp/gptoss.gguf --moe-roads all \
            --moe-seconds 90 2>&1 | tee -a "$OUT/moe.log" ;;
    esac
done
echo "== done $(date -u +%T)"
