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
# runs reuse it: $KVSIDECAR_CACHE (default ~/.cache/kvsidecar)/venv-<hash>
# (hash of requirements/*.txt, pyproject's dependency tables and $env_version below).
# vLLM 0.33 and SGLang 0.5.23 pin CUDA builds of torch 2.14; on a CPU machine
# we install them --no-deps next to the CPU build of torch 2.13 plus the
# modules their core imports (requirements/*-cpu.txt). See docs/engines.md.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
cache="${KVSIDECAR_CACHE:-$HOME/.cache/kvsidecar}"
# Bump when the install steps in build_env change (edits elsewhere here need no rebuild).
env_version=3
# Only what decides the environment's contents goes into the key: the
# requirement files and pyproject's dependency, entry-point and build tables
# (an edit to the tools' settings in pyproject must not rebuild it).
env_inputs() {
    echo "$env_version"
    cat requirements/*.txt
    "$py" - <<'PY'
import json, tomllib
with open("pyproject.toml", "rb") as f:
    data = tomllib.load(f)
project = data.get("project", {})
keep = {k: project.get(k) for k in ("dependencies", "optional-dependencies", "scripts", "entry-points",
                                     "requires-python")}
keep["build-system"] = data.get("build-system")
print(json.dumps(keep, sort_keys=True))
PY
}
key="$(env_inputs | sha256sum | cut -c1-16)"
venv="$cache/venv-$key"

# pip, quietly: hides the find-links noise and the resolver's complaints about
# the engines' CUDA pins (expected: they are installed --no-deps), keeps
# every real error, and fails when pip fails.
pipi() {
    local log rc=0
    log="$(mktemp)"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$@" >"$log" 2>&1 || rc=$?
    grep -v -e '^WARNING: Location' -e "dependency resolver does not" -e ' requires .*, which is not installed' \
        -e ' requires .*, but you have ' "$log" >&2 || true
    rm -f "$log"
    return "$rc"
}

build_env() {
    if [[ -f "$venv/.complete" ]]; then
        return 0
    fi
    # One builder at a time: a second dev.sh started meanwhile waits here,
    # then finds the environment complete.
    mkdir -p "$cache"
    exec 9>"$cache/.build-$key.lock"
    flock 9
    if [[ -f "$venv/.complete" ]]; then
        exec 9>&-
        return 0
    fi
    echo "kvsidecar: building the environment in $venv (first run only, a few minutes)" >&2
    rm -rf "$venv"
    mkdir -p "$cache"
    "$py" -m venv "$venv"
    # 1. CPU torch (a local wheel on these machines; PyPI elsewhere).
    pipi --upgrade "pip>=24"
    pipi -r requirements/torch-cpu.txt -c requirements/constraints-cpu.txt
    # 2. The engines themselves, without their CUDA dependency trees.
    pipi --no-deps -r requirements/engines-nodeps.txt
    # 3. What the engines' CPU code paths import, then this project with its dev tools.
    pipi -r requirements/engines-cpu.txt -c requirements/constraints-cpu.txt
    pipi -e ".[dev]" -c requirements/constraints-cpu.txt
    "$venv/bin/python" -c "import allocator, engine_ext, sidecar" || {
        echo "kvsidecar: the project did not install into $venv" >&2; exit 1; }
    VLLM_TARGET_DEVICE=cpu "$venv/bin/python" -c \
        "import vllm.v1.engine.core, vllm.entrypoints.openai.api_server
from engine_ext.sglang import prepare_cpu_imports
prepare_cpu_imports()
import sglang.srt.mem_cache.radix_cache, sglang.srt.mem_cache.unified_radix_cache" || {
        echo "kvsidecar: vLLM/SGLang do not import on CPU; see requirements/engines-cpu.txt" >&2; exit 1; }
    touch "$venv/.complete"
    exec 9>&-
}

# Debian's docker-compose (1.29) validates compose/*.yml in the tests; no
# Docker engine is needed for `docker-compose config`.
ensure_compose() {
    command -v docker-compose >/dev/null 2>&1 && return 0
    if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
        echo "kvsidecar: installing docker-compose (to validate compose/*.yml)" >&2
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
            apt-get install -y -qq --no-install-recommends docker-compose; } >/dev/null 2>&1 ||
            echo "kvsidecar: could not install docker-compose; the compose test will say so" >&2
    fi
}

# The environment is shared by every checkout with the same requirements. Its
# install provides the entry points (console scripts, vLLM's plugin group);
# PYTHONPATH makes every import, in subprocesses too, resolve to THIS
# checkout, so several checkouts (git worktrees) can use one environment at once.
ensure_installed() {
    "$venv/bin/python" -c 'import importlib.metadata as m; m.distribution("kvsidecar")' \
        >/dev/null 2>&1 || pipi --no-deps -e .
}

# The allocator's C hot paths (allocator/_speedups.c), compiled into this
# checkout (which PYTHONPATH puts first) whenever the source is newer than the
# module. Without a C compiler the pure-Python ones run (slower; the test
# suite's test_speedups_are_built then fails, saying so).
build_speedups() {  # the optional C modules, compiled in place when the source is newer
    local src suffix include out
    suffix="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
    include="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
    for src in allocator/_speedups.c engine_ext/vllm/_block_speedups.c; do
        out="${src%.c}$suffix"
        [[ -f "$out" && "$out" -nt "$src" ]] && continue
        if ! command -v "${CC:-cc}" >/dev/null 2>&1; then
            echo "kvsidecar: no C compiler (cc): $src's pure-Python paths run instead" >&2
            return 0
        fi
        # to a temporary name first: a process importing it meanwhile never sees half a file
        if "${CC:-cc}" -O2 -fPIC -shared -Wall -Wextra -Wno-missing-field-initializers \
            -I"$include" -o "$out.$$.tmp" "$src"; then
            mv -f "$out.$$.tmp" "$out"
        else
            rm -f "$out.$$.tmp"
            echo "kvsidecar: $src did not compile: its pure-Python paths run instead" >&2
        fi
    done
}

cmd="${1:-test}"
shift || true
case "$cmd" in
    env|test|demo|run) ;;
    *) echo "usage: bash scripts/dev.sh {test|demo|env|run CMD...}" >&2; exit 2 ;;
esac
build_env
ensure_installed
build_speedups
export PATH="$venv/bin:$PATH"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_TARGET_DEVICE="${VLLM_TARGET_DEVICE:-cpu}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
case "$cmd" in
    env)  echo "$venv" ;;
    test) ensure_compose; exec python -m pytest "$@" ;;
    demo) exec kvsidecar demo "$@" ;;
    run)  exec "$@" ;;
esac
