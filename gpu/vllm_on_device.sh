#!/usr/bin/env bash
# Run a command on the H200 with vLLM 0.32.0's Python tree + this project's
# overlay + FlashInfer, from the bundle that gpu/build_vllm_bundle.py builds.
#
#   bash gpu/vllm_on_device.sh CMD ARGS...      (repo root, on the device;
#                                                device tool: carry [".bundle"])
#
# Unpacks .bundle to $VLLM_BUNDLE_ROOT (/tmp/vllm_bundle):
#   tree/   vLLM's package + its dist-info, this repo's vllm/ files copied INTO
#           it (what `pip install .` of this project does: the overlay is
#           namespace files at vLLM's paths), the vllm.* stubs and the edits of
#           vLLM files of gpu/vllm_bundle_stubs.py, and a vllm_dcp_dspark dist-info
#           whose entry_points.txt (from pyproject.toml) makes vLLM load the
#           plugin (vllm.general_plugins: dcp_dspark)
#   site/   the carried wheels (pip --target, no index, no deps) + apache-tvm-ffi
#   fi/     FlashInfer (v<version>.zip, common.zip under flashinfer/data)
#   stubs/  top-level stub modules (last on PYTHONPATH: a real one wins)
# then exports PYTHONPATH, VLLM_TARGET_DEVICE=cuda, FLASHINFER_WORKSPACE_BASE,
# unsets VLLM_DCP_CPU_MRV2, and runs the command. The unpack is redone on every
# call (about 10 s) unless VLLM_BUNDLE_REUSE=1 and it is already there; the
# overlay and stubs are refreshed from this checkout on every call.
# Source it (`. gpu/vllm_on_device.sh` with no arguments) to get the
# environment in the current shell.
_vb_main() {
  local repo bundle root py fi_ver
  repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  bundle=${VLLM_BUNDLE:-$repo/.bundle}
  root=${VLLM_BUNDLE_ROOT:-/tmp/vllm_bundle}
  py=${PYTHON:-python3}
  [ -f "$bundle/MANIFEST.txt" ] || { echo "vllm_on_device: no bundle at $bundle (run gpu/build_vllm_bundle.py here, carry .bundle)" >&2; return 1; }
  fi_ver=$(awk '$1=="flashinfer-python"{print $2}' "$bundle/MANIFEST.txt")
  if [ "${VLLM_BUNDLE_REUSE:-0}" != 1 ] || [ ! -f "$root/.done" ]; then
    rm -rf "$root" && mkdir -p "$root/tree" "$root/site" "$root/fi/flashinfer/data" "$root/stubs" || return 1
    "$py" -m zipfile -e "$bundle"/vllm-*.zip "$root/tree" || return 1
    "$py" -m zipfile -e "$bundle/flashinfer/v$fi_ver.zip" "$root/fi" || return 1
    "$py" -m zipfile -e "$bundle/flashinfer/common.zip" "$root/fi/flashinfer/data" || return 1
    if [ "${VLLM_BUNDLE_NO_WHEELS:-0}" != 1 ]; then  # local emulation provides site/ itself
      "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$root/site" "$bundle"/wheels/*.whl "$bundle"/flashinfer/apache_tvm_ffi-*.whl \
        || return 1
    fi
    touch "$root/.done"
  fi
  # The overlay: this checkout's vllm/ files over vLLM's tree.
  (cd "$repo" && find vllm -name '*.py' -not -path '*/__pycache__/*' -print0 \
     | xargs -0 -I{} cp --parents {} "$root/tree/") || return 1
  rm -rf "$root/stubs" && mkdir -p "$root/stubs" || return 1
  "$py" "$repo/gpu/vllm_bundle_stubs.py" "$root/stubs" "$root/tree" >/dev/null || return 1
  "$py" - "$repo" "$root/tree" <<'EOF' || return 1
import sys, tomllib
from pathlib import Path
repo, tree = Path(sys.argv[1]), Path(sys.argv[2])
project = tomllib.loads((repo / "pyproject.toml").read_text())["project"]
info = tree / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
info.mkdir(exist_ok=True)
(info / "METADATA").write_text(
    f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
lines = []
for group, entries in project.get("entry-points", {}).items():
    lines.append(f"[{group}]")
    lines += [f"{name} = {target}" for name, target in entries.items()]
    lines.append("")
(info / "entry_points.txt").write_text("\n".join(lines))
EOF
  export PYTHONPATH="$root/tree:$root/fi:$root/site:$root/stubs${PYTHONPATH:+:$PYTHONPATH}"
  export VLLM_TARGET_DEVICE=cuda
  export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fiws}
  export PYTHONUNBUFFERED=1
  unset VLLM_DCP_CPU_MRV2
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then  # run: set up, then the command
  set -u
  _vb_main || { echo "vllm_on_device: setup failed" >&2; exit 1; }
  [ $# -gt 0 ] || { echo "usage: bash gpu/vllm_on_device.sh CMD ARGS..." >&2; exit 2; }
  exec "$@"
else  # sourced: set up the current shell
  _vb_main
fi
