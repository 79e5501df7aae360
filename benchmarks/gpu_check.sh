#!/bin/bash
# The GPU issue's checks ([24]) on a lent machine, in one run, everything bounded:
#
#   bash benchmarks/gpu_check.sh [tests] [bench] [serve] [moe]     (default: all four)
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
#   moe:   benchmarks/bench_gpu.py --moe: experts on the GPU against --cpu-experts
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
phases=${*:-tests bench moe serve}
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
models() {
    python3 - <<'PY'
from pathlib import Path
from kvlm.bench.models import write_model
for shape, name in (("smollm2-135m", "smol"), ("qwen2.5-0.5b", "q05"), ("lfm2-350m", "lfm2")):
    out = Path(f"/tmp/{name}.gguf")
    if not out.exists():
        write_model(shape, "Q8_0", out, Path(".devmodels/tok.gguf"))
PY
}
for phase in $phases; do
    echo "== $phase $(date -u +%T)"
    case $phase in
    tests)
        timeout 220 python3 -m pytest -q -p no:cacheprovider --durations=20 tests/test_gpu.py \
            2>&1 | tee "$OUT/tests.log" | tail -40 ;;
    bench)
        models
        timeout 60 python3 -c "
import torch
x = torch.empty(2**30, dtype=torch.uint8, device='cuda'); y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
torch.cuda.synchronize(); s, e = torch.cuda.Event(True), torch.cuda.Event(True)
s.record(); [y.copy_(x) for _ in range(20)]; e.record(); torch.cuda.synchronize()
print('plain copy GB/s (read + write)', round(2 * 20 * 2**30 / (s.elapsed_time(e) / 1e3) / 1e9))
" 2>&1 | tee "$OUT/bench.log"
        timeout 130 python3 benchmarks/bench_gpu.py --no-hf --roads one --streams 1,8,64 \
            --profile 64 /tmp/smol.gguf /tmp/q05.gguf /tmp/lfm2.gguf 2>&1 | tee -a "$OUT/bench.log" ;;
    serve)
        models
        timeout 100 python3 benchmarks/bench_serve.py --phases streams --streams 1,8,64 \
            --requests 2 --max-tokens 128 --threads 8 --json "$OUT/serve.json" --serve-args \
            "--model /tmp/q05.gguf --device cuda --dtype bf16 --max-num-seqs 64 --max-waiting 128" \
            2>&1 | tee "$OUT/serve.log" ;;
    moe)
        python3 -c "
from pathlib import Path
from kvlm.bench.models import write_model
out = Path('/tmp/moe8l.gguf')
out.exists() or write_model('qwen3-30b-a3b-8l', 'Q8_0', out, Path('.devmodels/tok.gguf'))"
        timeout 175 python3 benchmarks/bench_gpu.py --moe /tmp/moe8l.gguf --moe-seconds 150 \
            2>&1 | tee "$OUT/moe.log" ;;
    esac
done
echo "== done $(date -u +%T)"
