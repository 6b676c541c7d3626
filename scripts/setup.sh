#!/usr/bin/env bash
# Quickstart, step 1: install everything into .venv/ (created when missing) and run the main
# job on embedded defaults: train the `small` DLRM (26 tables, 217 MB) on synthetic data into
# runs/pool with undo-log checkpointing, then inspect it. Rerunning continues the same pool.
#   SETUP_ONLY=1 bash scripts/setup.sh    installs and stops (what scripts/test.sh uses)
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
# One resolver run, in this order of meaning:
# - torch 2.13.0 resolves to the CPU wheel on these machines;
# - tools/fbgemm_gpu_shim is a tiny distribution named "fbgemm-gpu" that only depends on
#   fbgemm-gpu-cpu: torchrec asks for "fbgemm-gpu", whose real wheel is a CUDA build that does not
#   import with CPU torch. Never install both: they own the same site-packages/fbgemm_gpu folder.
$VPY -m pip install --quiet --disable-pip-version-check \
  "torch==2.13.0" ./tools/fbgemm_gpu_shim -e ".[test]"

# libpmem (PMDK) is optional: used when present (real persistent memory on DAX mounts, pmem_msync
# elsewhere). Install it where we can; everything works without it.
if ! ldconfig -p 2>/dev/null | grep -q libpmem.so; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -qq && apt-get install -y -qq libpmem1) >/dev/null 2>&1 \
      || echo "note: libpmem1 could not be installed; the pool uses msync" >&2
  fi
fi

if [ "${SETUP_ONLY:-0}" = 1 ]; then
  exit 0
fi
.venv/bin/dlrm-cxl train --pool runs/pool --preset small --steps "${STEPS:-100}"
.venv/bin/dlrm-cxl inspect --pool runs/pool --no-digest | head -5
