#!/usr/bin/env bash
# Fills the ignored .whl/ that the GPU scripts carry to the device machine (its image has torch, triton and
# transformers, but no server stack, no llguidance, no jsonschema and no vLLM client). Run it here, where
# PyPI is reachable, then pass carry [".whl"] (about 8 MB; 64 MiB is the limit of one call):
#   .whl/*.whl          llguidance (the engine imports it) and jsonschema with its three dependencies (the
#                       structured-output GPU tests import it; without them tests/gpu stops at collection)
#   .whl/server/        fastapi, starlette, pydantic(-core), uvicorn, httptools, opentelemetry-api, ...
#   .whl/vclient/       datasets, dill, multiprocess: what vLLM's benchmark client needs beyond the image;
#   .whl/vclient/vllm_bench/  vLLM v0.9.2's benchmarks/ client files from its PyPI sdist, and a stand-in
#                       `vllm` package for the few names benchmark_dataset.py imports and the random
#                       dataset never uses (scripts/serving_gpu_check.sh runs it when it is there)
# Versions are the ones the committed rows name in their env.txt; the image's Python is 3.12.
set -euo pipefail
cd "$(dirname "$0")/.."
W=.whl; mkdir -p $W/server $W/vclient/vllm_bench
dl() { local dir=$1; shift; python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 -d "$dir" "$@" 2>&1 | grep -v WARN || true; }
dl $W "llguidance==1.9.1" "jsonschema==4.26.0" "jsonschema-specifications==2025.9.1" "referencing==0.37.0" \
    "rpds-py==2026.9.1"
dl $W/server "fastapi==0.165.0" "starlette==1.10.0" "pydantic==2.14.4" "pydantic-core==2.50.5" \
    "annotated-types==0.8.0" "typing-inspection==0.4.5" "typing-extensions==4.16.0" "uvicorn==0.55.0" \
    "httptools==0.9.0" "sniffio==1.3.1" "opentelemetry-api==1.45.3"
dl $W/vclient "datasets==5.2.0" "dill==0.4.1" "multiprocess==0.70.19"
V=$W/vclient/vllm_bench
if [ ! -f $V/benchmark_serving.py ]; then
  T=$(mktemp -d)
  python3 -m pip download -q --no-deps --no-binary :all: --no-build-isolation vllm==0.9.2 -d "$T" >/dev/null 2>&1 || true
  if [ ! -f "$T/vllm-0.9.2.tar.gz" ]; then   # pip builds metadata from an sdist and fails there: take the file
    U=$(curl -s https://pypi.org/simple/vllm/ | grep -o 'href="[^"]*vllm-0\.9\.2\.tar\.gz[^"]*"' | head -1 \
        | sed 's/^href="//; s/"$//; s/#.*//')
    curl -s -L -o "$T/vllm-0.9.2.tar.gz" "$U"
  fi
  for f in backend_request_func benchmark_dataset benchmark_serving benchmark_utils; do
    tar -xzf "$T/vllm-0.9.2.tar.gz" -O "vllm-0.9.2/benchmarks/$f.py" > $V/$f.py
  done
  rm -rf "$T"
fi
echo v0.9.2 > $V/VERSION
mkdir -p $V/vllm/lora $V/vllm/multimodal $V/vllm/transformers_utils
touch $V/vllm/__init__.py $V/vllm/lora/__init__.py $V/vllm/transformers_utils/__init__.py
printf 'class LoRARequest:  # stand-in: the random dataset never builds one\n    def __init__(self, *a, **k):\n        raise RuntimeError("no LoRA in this stand-in")\n' > $V/vllm/lora/request.py
printf 'def get_adapter_absolute_path(path):\n    return path\n' > $V/vllm/lora/utils.py
printf 'MultiModalDataDict = dict\n' > $V/vllm/multimodal/__init__.py
printf 'def convert_image_mode(image, mode):\n    return image.convert(mode)\n' > $V/vllm/multimodal/image.py
printf 'from typing import Any\n\nAnyTokenizer = Any\n\n\ndef get_lora_tokenizer(*a, **k):\n    return None\n' \
    > $V/vllm/transformers_utils/tokenizer.py
printf "vLLM v0.9.2's benchmarks/ client files (its PyPI sdist), fetched by scripts/gpu_wheels.sh; not committed.\nvllm/ stands in for the names benchmark_dataset.py imports that the random dataset never uses.\n" > $V/README.txt
du -sh $W; find $W -name "*.whl" | wc -l
