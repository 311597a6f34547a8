# SPDX-License-Identifier: Apache-2.0
"""Build ``.bundle/``: vLLM 0.32.0's Python tree and what it needs on the H200.

The lent H200 has torch 2.11 (cu130), Triton 3.6 and Python 3.12, but no vLLM
and no network. vLLM's compiled wheel cannot travel (its ``_C`` extensions are
built for another torch), and nothing on this project's path needs them. This
script (run here, with network) gathers into the ignored folder ``.bundle/``:

  vllm-0.32.0.zip      vLLM 0.32.0's ``*.py`` files and data files (json,
                       jinja, py.typed) from the CUDA wheel, plus its
                       dist-info (platform detection reads the ``vllm``
                       distribution's version), and FlashMLA's two
                       extensions (``VLLM_KEEP_SO``: built on torch's stable
                       C ABI, so they load under the device's torch); no
                       other ``.so``, no third_party headers, no ``vllm-rs``
  wheels/              cp312 wheels of the packages vLLM imports that the
                       device lacks (``DEP_WHEELS``; one version each)
  flashinfer/          FlashInfer 0.7.2.post1 trimmed to what its FA3 MLA JIT
                       needs (v<version>.zip + common.zip):
                       ``v0.7.2.post1.zip`` (every .py file, json configs,
                       ``data/include``, ``data/csrc``'s top-level files) and
                       ``common.zip`` (cutlass, cccl and spdlog headers, to
                       unpack under ``flashinfer/data``), and the
                       apache-tvm-ffi 0.1.11 wheel
  MANIFEST.txt         versions and sizes

Stub modules for what is still missing (vllm._C_stable_libtorch with a few
placeholder torch ops, llguidance) and the one edit of a vLLM file (the
ImportError of vllm.vllm_flash_attn without its compiled extensions: why the
plugin's guard saw mla_attention missing) are not in the bundle:
gpu/vllm_bundle_stubs.py lists them with the reason for each and applies them
on the device, so changing them needs no rebuild.

Usage (repo root, here; downloads are cached in ~/.cache/vllm_dcp_bundle):
    python3 gpu/build_vllm_bundle.py            # build .bundle/ (about 51 MiB)
    python3 gpu/build_vllm_bundle.py --check    # only report sizes
Then on the device (device tool, ``carry: [".bundle"]``):
    bash gpu/device_run.sh tests bench
The whole carried tree (tracked + untracked-not-ignored files + .bundle) must
stay under 64 MiB; the script prints it and fails above 60 MiB.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUNDLE = REPO / ".bundle"
CACHE = Path(os.environ.get("VLLM_BUNDLE_CACHE",
                            Path.home() / ".cache" / "vllm_dcp_bundle"))

VLLM = "0.32.0"
FLASHINFER = "0.7.2.post1"   # the version of the earlier device runs
TVM_FFI = "0.1.11"           # what FlashInfer 0.7.2.post1 needs (>=0.1.11,<0.2)

# Packages vLLM imports on our path (``import vllm``, config, engine args,
# selector, MLA backends) that the device image lacks
# (/work/.library/device/KINDS.md), at the versions vLLM 0.32.0 resolved with.
DEP_WHEELS: dict[str, str] = {
    "pydantic": "2.14.4",            # vllm.config
    "pydantic-core": "2.50.5",       # pydantic
    "annotated-types": "0.8.0",      # pydantic
    "typing-inspection": "0.4.5",    # pydantic
    "cachetools": "8.0.2",           # vllm.utils
    "msgspec": "0.23.0",             # vllm.v1.engine, serial utils
    "cbor2": "6.3.0",                # vllm.utils.hashing
    "pyzmq": "27.3.0",               # vllm.utils.network_utils
    "blake3": "1.0.11",              # vllm.utils.hashing
    "setproctitle": "1.3.8",         # vllm.utils.system_utils
    "pybase64": "1.5.1",             # vllm multimodal / serial utils
    "openai": "3.63.0",              # vllm.entrypoints protocol types (engine args)
    "jiter": "0.19.0",               # openai
    "httpx2": "2.17.0",              # openai
    "httpcore2": "2.17.0",           # httpx2
    "truststore": "0.10.5",          # httpx2, httpcore2
    "sniffio": "1.3.1",              # openai
    "oss-harmony": "0.0.11",         # vllm.entrypoints harmony utils
    "partial-json-parser": "0.2.1.1.post7",  # vllm tool parsers
    # vllm.model_executor.layers.attention (mla_attention's package) ->
    # attention.py -> kv_transfer -> v1.core.kv_cache_utils -> v1.request ->
    # v1.structured_output -> vllm.parser.abstract_parser: ``from xgrammar
    # import Grammar, StructuralTag`` and ``from xgrammar.structural_tag
    # import ...`` (pydantic models) at module level. Small and real, so no
    # stub; needs apache-tvm-ffi (carried with FlashInfer).
    "xgrammar": "0.2.8",
    "fastapi": "0.136.3",            # vllm.entrypoints.serve (protocol types)
    "starlette": "1.10.0",           # fastapi
}

PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64",
             "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux_2_35_x86_64"]

# vLLM wheel: every *.py file (vllm/third_party/pynvml.py included: platform
# detection imports it), and these data files, except under VLLM_DROP (the
# CUDA headers of third_party kernels). Of the .so files only FlashMLA's
# (dense bf16 decode; dense fp8 decode), which use torch's stable C ABI
# only (aoti_torch_* / torch_* symbols) and so load under another torch;
# the others are built against vLLM's torch 2.x ABI. Never vllm-rs.
VLLM_KEEP_DATA = ("*.json", "*.jinja", "py.typed")
VLLM_KEEP_SO = ("vllm/_flashmla_C.abi3.so", "vllm/_flashmla_extension_C.abi3.so")
VLLM_DROP = ("vllm/third_party/*",)
DIST_INFO_DROP = ("RECORD",)  # lists the .so files that are not there

# FlashInfer: the FA3 MLA JIT (flashinfer/jit/attention/modules.py,
# gen_batch_mla_module(backend="fa3")) compiles data/csrc/batch_mla_sm90_*.cu
# with data/include, the cutlass include dirs, spdlog and cccl
# (flashinfer/jit/env.py). Source of other kernels (csrc subfolders, .cu files
# beside the Python modules) is dropped; every .py file is kept.
FI_DROP_OUTSIDE_DATA = ("*.cu", "*.cuh", "*.c", "*.h", "*.hpp", "*.cpp", "*.md")
FI_COMMON = {  # data/<dir>: kept subpaths (common.zip)
    "cutlass": ("include/*", "tools/util/include/*", "LICENSE*"),
    "cccl": ("cub/cub/*", "libcudacxx/include/*", "thrust/thrust/*", "LICENSE*"),
    "spdlog": ("include/*", "LICENSE*"),
}

CARRY_LIMIT = 60 * 2**20  # the device tool's limit is 64 MiB, keep a margin


def pip_download(specs: list[str], dest: Path, *, binary_only=True, deps=False):
    cmd = [sys.executable, "-m", "pip", "download", "-q", "-d", str(dest),
           "--python-version", "3.12", "--implementation", "cp",
           "--only-binary=:all:"]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    if not deps:
        cmd.append("--no-deps")
    subprocess.run(cmd + specs, check=True)


def wheel_name(dist: str) -> str:
    return dist.replace("-", "_").lower()


def cached_wheel(dist: str, version: str) -> Path | None:
    pattern = f"{wheel_name(dist)}-{version}-*.whl"
    for path in (CACHE / "dl").glob("*.whl"):
        if fnmatch.fnmatch(path.name.lower(), pattern.lower()):
            return path
    return None


def fetch(dist: str, version: str) -> Path:
    path = cached_wheel(dist, version)
    if path is None:
        (CACHE / "dl").mkdir(parents=True, exist_ok=True)
        pip_download([f"{dist}=={version}"], CACHE / "dl")
        path = cached_wheel(dist, version)
        if path is None:
            sys.exit(f"pip downloaded no wheel for {dist}=={version}")
    return path


def matches(name: str, patterns) -> bool:
    return any(fnmatch.fnmatch(name, p) for p in patterns)


def zip_out(path: Path, members) -> int:
    """members: iterable of (arcname, bytes). Returns the zip's size."""
    tmp = path.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        for arcname, data in members:
            z.writestr(arcname, data)
    tmp.replace(path)
    return path.stat().st_size


def build_vllm(out: Path) -> int:
    wheel = zipfile.ZipFile(fetch("vllm", VLLM))

    def members():
        for info in wheel.infolist():
            name = info.filename
            if name.endswith("/"):
                continue
            top = name.split("/")[0]
            if top.endswith(".dist-info"):
                if name.split("/")[-1] not in DIST_INFO_DROP:
                    yield name, wheel.read(info)
            elif top == "vllm" and (name.endswith(".py") or name in VLLM_KEEP_SO or (
                    matches(name.split("/")[-1], VLLM_KEEP_DATA)
                    and not matches(name, VLLM_DROP))):
                yield name, wheel.read(info)

    return zip_out(out / f"vllm-{VLLM}.zip", members())


def build_flashinfer(out: Path) -> dict[str, int]:
    out.mkdir(parents=True, exist_ok=True)
    wheel = zipfile.ZipFile(fetch("flashinfer-python", FLASHINFER))

    def main_members():
        for info in wheel.infolist():
            name = info.filename
            if name.endswith("/"):
                continue
            parts = name.split("/")
            if parts[0].endswith(".dist-info"):
                if parts[-1] not in DIST_INFO_DROP:
                    yield name, wheel.read(info)
            elif parts[:2] == ["flashinfer", "data"]:
                sub = parts[2] if len(parts) > 3 else None
                if sub == "include" or (sub == "csrc" and len(parts) == 4) \
                        or sub is None:
                    yield name, wheel.read(info)
            elif parts[0] == "flashinfer" and (
                    name.endswith(".py") or not matches(parts[-1], FI_DROP_OUTSIDE_DATA)):
                yield name, wheel.read(info)

    def common_members():
        for info in wheel.infolist():
            parts = info.filename.split("/")
            if info.filename.endswith("/") or parts[:2] != ["flashinfer", "data"] \
                    or len(parts) < 4 or parts[2] not in FI_COMMON:
                continue
            rest = "/".join(parts[3:])
            if matches(rest, FI_COMMON[parts[2]]):
                yield "/".join(parts[2:]), wheel.read(info)

    sizes = {f"v{FLASHINFER}.zip": zip_out(out / f"v{FLASHINFER}.zip", main_members()),
             "common.zip": zip_out(out / "common.zip", common_members())}
    tvm = fetch("apache-tvm-ffi", TVM_FFI)
    for old in out.glob("apache_tvm_ffi-*.whl"):
        old.unlink()
    (out / tvm.name).write_bytes(tvm.read_bytes())
    sizes[tvm.name] = tvm.stat().st_size
    return sizes


def build_wheels(out: Path) -> dict[str, int]:
    out.mkdir(parents=True, exist_ok=True)
    wanted = {fetch(d, v).name: fetch(d, v) for d, v in DEP_WHEELS.items()}
    for old in out.glob("*.whl"):
        if old.name not in wanted:
            old.unlink()
    sizes = {}
    for name, src in wanted.items():
        dst = out / name
        if not dst.exists() or dst.stat().st_size != src.stat().st_size:
            dst.write_bytes(src.read_bytes())
        sizes[name] = dst.stat().st_size
    return sizes


def carried_bytes() -> tuple[int, int]:
    """(repo files that travel, .bundle) in bytes."""
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others",
         "--exclude-standard"], capture_output=True, check=True).stdout
    repo = sum((REPO / p).stat().st_size for p in listed.decode().split("\0")
               if p and (REPO / p).is_file())
    bundle = sum(p.stat().st_size for p in BUNDLE.rglob("*") if p.is_file())
    return repo, bundle


def report() -> int:
    lines = []
    for path in sorted(BUNDLE.rglob("*")):
        if path.is_file() and path.name != "MANIFEST.txt":
            lines.append(f"{path.stat().st_size / 2**20:8.2f} MiB  "
                         f"{path.relative_to(BUNDLE)}")
    repo, bundle = carried_bytes()
    total = repo + bundle
    lines += [f"{bundle / 2**20:8.2f} MiB  .bundle in all",
              f"{repo / 2**20:8.2f} MiB  repo files that travel",
              f"{total / 2**20:8.2f} MiB  carried in all (device limit 64 MiB)"]
    text = "\n".join(lines)
    print(text)
    if total > CARRY_LIMIT:
        print(f"TOO LARGE: over {CARRY_LIMIT / 2**20:.0f} MiB", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="only print the sizes of an existing .bundle")
    args = parser.parse_args(argv)
    if args.check:
        return report()
    BUNDLE.mkdir(exist_ok=True)
    print("vllm:", build_vllm(BUNDLE))
    print("wheels:", sum(build_wheels(BUNDLE / "wheels").values()))
    print("flashinfer:", build_flashinfer(BUNDLE / "flashinfer"))
    (BUNDLE / "MANIFEST.txt").write_text(
        f"vllm {VLLM}\nflashinfer-python {FLASHINFER}\napache-tvm-ffi {TVM_FFI}\n"
        + "".join(f"{d} {v}\n" for d, v in DEP_WHEELS.items()))
    return report()


if __name__ == "__main__":
    sys.exit(main())
