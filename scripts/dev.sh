#!/usr/bin/env bash
# One entry point for a fresh machine: builds (or reuses) the project's
# virtualenv, then runs what you asked for.
#
#   bash scripts/dev.sh test      # the whole default test suite (what CI runs)
#   bash scripts/dev.sh demo      # the CPU colocation demo (the main job)
#   bash scripts/dev.sh env       # only build the environment; prints its path
#   bash scripts/dev.sh run CMD…  # run CMD inside the environment
#
# The virtualenv lives outside the repo, keyed by a hash of everything that
# decides its contents (requirements/*.txt, pyproject.toml), so CI and later
# runs reuse it: $KVSIDECAR_CACHE (default ~/.cache/kvsidecar)/venv-<hash>.
# vLLM 0.33 and SGLang 0.5.23 pin CUDA builds of torch 2.14; on a CPU machine
# we install them --no-deps next to the CPU build of torch 2.13 plus the
# modules their core imports (requirements/*-cpu.txt). See docs/engines.md.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
cache="${KVSIDECAR_CACHE:-$HOME/.cache/kvsidecar}"
key="$(cat requirements/*.txt pyproject.toml scripts/dev.sh | sha256sum | cut -c1-16)"
venv="$cache/venv-$key"

build_env() {
    if [[ -f "$venv/.complete" ]]; then
        return 0
    fi
    echo "kvsidecar: building the environment in $venv (first run only, a few minutes)" >&2
    rm -rf "$venv"
    mkdir -p "$cache"
    "$py" -m venv "$venv"
    local pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
    "${pip[@]}" --upgrade "pip>=24" 2>&1 | grep -v '^WARNING: Location' >&2 || true
    # 1. CPU torch (a local wheel on these machines; the PyTorch CPU index elsewhere).
    "${pip[@]}" -r requirements/torch-cpu.txt 2>&1 | grep -v '^WARNING: Location' >&2 || true
    "$venv/bin/python" -c "import torch" || {
        echo "kvsidecar: torch did not install; see requirements/torch-cpu.txt" >&2; exit 1; }
    # 2. The engines themselves, without their CUDA dependency trees.
    "${pip[@]}" --no-deps -r requirements/engines-nodeps.txt 2>&1 | grep -v '^WARNING: Location' >&2
    # 3. What the engines' CPU code paths import, then this project with its dev tools.
    "${pip[@]}" -r requirements/engines-cpu.txt 2>&1 | grep -v '^WARNING: Location' >&2 || true
    "${pip[@]}" -e ".[dev]" 2>&1 | grep -v '^WARNING: Location' >&2 || true
    "$venv/bin/python" -c "import allocator, engine_ext, sidecar" || {
        echo "kvsidecar: the project did not install into $venv" >&2; exit 1; }
    touch "$venv/.complete"
}

cmd="${1:-test}"
shift || true
build_env
export PATH="$venv/bin:$PATH"
export VLLM_TARGET_DEVICE="${VLLM_TARGET_DEVICE:-cpu}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
case "$cmd" in
    env)  echo "$venv" ;;
    test) exec python -m pytest "$@" ;;
    demo) exec kvsidecar demo "$@" ;;
    run)  exec "$@" ;;
    *)    echo "usage: bash scripts/dev.sh {test|demo|env|run CMD...}" >&2; exit 2 ;;
esac
