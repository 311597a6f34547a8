# SPDX-License-Identifier: Apache-2.0
"""The stub modules of the H200 bundle (see gpu/build_vllm_bundle.py), in one place.

The device has torch, Triton and most of vLLM's pure-Python needs, but not
vLLM's compiled extensions (built for another torch: they cannot travel) and
a few packages that only vLLM's server, structured output or kernels we never
run import. The modules below are imported unconditionally on the path from
``import vllm`` to the engine arguments, the attention selector and the MLA
backends, so each gets a stub.

A stub can be imported, but any use fails loudly: every attribute that the
stub does not define raises ``BundleStubError`` (a ``RuntimeError``, and also
an ``AttributeError`` subclass is avoided on purpose: ``from stub import name``
must not turn into an ``ImportError``, which vLLM and the plugin's guard read as
"module not installed"). ``NAMES`` lists the few names some vLLM module takes
at import time (``from stub import Name``); they are placeholders whose every
use (call, attribute, subclassing) raises too. Dunder lookups (``__path__``,
``__all__``, ``__wrapped__`` ...) answer ``AttributeError`` as for any module,
so importers, ``mock`` and ``inspect`` behave.

Usage (what gpu/vllm_on_device.sh does on the device):
    python3 gpu/vllm_bundle_stubs.py TOP_DIR VLLM_PARENT_DIR
writes the top-level stubs into TOP_DIR (put it LAST on PYTHONPATH: a real
module, if one is installed, wins) and the ``vllm.*`` stubs into the unpacked
vLLM tree under VLLM_PARENT_DIR (never over a real file), and applies
``PATCHES`` (edits of vLLM files, each with its reason) to that tree.
"""

from __future__ import annotations

import sys
from pathlib import Path

# module -> (reason, names taken at import time: placeholders)
STUBS: dict[str, tuple[str, tuple[str, ...]]] = {
    # vLLM's compiled extensions are built for vLLM's torch, not the device's,
    # and are not carried. Only the one imported unconditionally gets a stub
    # (vllm/platforms/cuda.py: ``import vllm._C_stable_libtorch`` at module
    # level, to register custom ops); the others (vllm._C, _moe_C*,
    # cumem_allocator, vllm_flash_attn's _vllm_fa*_C ...) are imported inside
    # ``try: ... except ImportError`` and stay absent, so vLLM
    # sees them missing and logs it. A custom op is reached through
    # ``torch.ops._C.*``, which fails in torch ("no such operator").
    # FlashMLA's _flashmla_C and _flashmla_extension_C are carried (stable
    # ABI: gpu/build_vllm_bundle.py's VLLM_KEEP_SO) and load for real.
    # This stub also defines the placeholder torch ops of TORCH_OPS below.
    "vllm._C_stable_libtorch": ("vLLM's compiled custom ops (built for another torch, "
                                "not carried); vllm.platforms.cuda imports it", ()),
    # Packages the device lacks, imported unconditionally by vLLM modules on
    # our path but used only by features we never run there.
    # vllm.model_executor.layers.attention (mla_attention's package) ->
    # kv_transfer -> v1.core.kv_cache_utils -> v1.request ->
    # v1.structured_output -> backend_guidance: a dataclass annotated with
    # ``llguidance.LLMatcher`` / ``LLTokenizer`` (evaluated at class creation).
    "llguidance": ("structured-output backend (compiled, no wheel for the device; "
                   "only two annotations of vLLM's guidance backend need it)",
                   ("LLMatcher", "LLTokenizer")),
}


# torch.ops._C.<op>.default looked up at module level, unguarded, by vLLM
# modules on our path: VllmConfig at tensor_parallel_size > 1 on sm90/sm100
# with FlashInfer present turns on fuse_allreduce_rms
# (vllm/config/vllm.py: enable_allreduce_rms_fusion), and its compile ranges
# import vllm/compilation/passes/fusion/allreduce_rms_fusion.py ->
# rms_quant_fusion.py -> matcher_utils.py (and act_quant_fusion.py,
# qk_norm_rope_fusion.py read the same way). vLLM's _C would register them;
# here each is defined with a placeholder schema and an implementation that
# raises. Ops vLLM probes with hasattr first (per_token_group_fp8_quant,
# scaled_fp4_quant, rms_norm_per_block_quant, ...) stay undefined.
TORCH_OPS: dict[str, tuple[str, ...]] = {
    "_C": ("rotary_embedding", "static_scaled_fp8_quant", "dynamic_scaled_fp8_quant",
           "dynamic_per_token_scaled_fp8_quant", "silu_and_mul", "fused_add_rms_norm",
           "rms_norm_static_fp8_quant", "fused_add_rms_norm_static_fp8_quant",
           "rms_norm_dynamic_per_token_quant", "silu_and_mul_quant",
           "silu_and_mul_per_block_quant", "fused_qk_norm_rope"),
}
# torch.ops._C capability probes vLLM calls at import time (e.g.
# quantization/utils/w8a8_utils.py: CUTLASS_BLOCK_FP8_SUPPORTED, on the
# import path of vllm.v1.worker.gpu and of the model registry's inspection):
# defined to answer False, which is the truth here (no CUTLASS kernel is
# carried), so vLLM takes its non-CUTLASS branches.
TORCH_CAPABILITY_PROBES: dict[str, tuple[str, ...]] = {
    "_C": ("cutlass_scaled_mm_supports_fp4", "cutlass_scaled_mm_supports_fp8",
           "cutlass_scaled_mm_supports_block_fp8", "cutlass_group_gemm_supported"),
}
TORCH_OPS_STUB = "vllm._C_stable_libtorch"


# Edits of vLLM's own files in the unpacked tree: (path, old text, new text,
# reason). Each is checked: a vLLM whose file differs fails the setup.
PATCHES: list[tuple[str, str, str, str]] = [
    # THE reason the plugin's guard reported "module
    # vllm.model_executor.layers.attention.mla_attention" missing on the H200:
    # its package's __init__ imports mm_encoder_attention -> fa_utils, which
    # on a CUDA platform imports vllm.vllm_flash_attn, and that package raises
    # ImportError when neither compiled FlashAttention extension
    # (_vllm_fa2_C / _vllm_fa3_C, not carried) imports. find_spec() of
    # mla_attention imports the parent package, so the guard (and vLLM's
    # model inspection, hence every VllmConfig of an MLA model) saw an
    # ImportError. Without the raise, vllm.vllm_flash_attn imports with
    # FA2_AVAILABLE = FA3_AVAILABLE = False: vLLM's selector skips
    # FLASH_ATTN(_MLA), and a call of its kernels fails in torch.ops.
    ("vllm/vllm_flash_attn/__init__.py",
     """if not (FA2_AVAILABLE or FA3_AVAILABLE):
    raise ImportError(
        "vllm.vllm_flash_attn requires the CUDA flash attention extensions "
        "(_vllm_fa2_C or _vllm_fa3_C). On ROCm, use upstream flash_attn."
    )
""",
     """# H200 bundle (gpu/vllm_bundle_stubs.py): no ImportError without the
# compiled extensions; FA2_AVAILABLE and FA3_AVAILABLE say they are absent.
""",
     "FlashAttention's compiled extensions are not carried"),
]


def apply_patches(vllm_parent: Path) -> list[Path]:
    """Apply PATCHES to the vLLM tree under ``vllm_parent`` (idempotent)."""
    done = []
    for rel, old, new, _reason in PATCHES:
        path = vllm_parent / rel
        text = path.read_text()
        if new in text:
            continue
        if text.count(old) != 1:
            raise SystemExit(f"vllm_bundle_stubs: {path} is not the vLLM file "
                             f"this bundle patches (text to replace not found)")
        path.write_text(text.replace(old, new))
        done.append(path)
    return done


class BundleStubError(RuntimeError):
    """A stubbed module of the H200 bundle was used."""


TORCH_OPS_SOURCE = '''

def _define_placeholder_ops(ops):
    import torch

    for namespace, names in ops.items():
        lib = torch.library.Library(namespace, "FRAGMENT")
        _LIBS.append(lib)  # a Library's ops live as long as it does
        for op in names:
            if hasattr(getattr(torch.ops, namespace), op):
                continue  # a real one is registered

            def impl(*args, _op=f"torch.ops.{{namespace}}.{{op}}", **kwargs):
                _fail(_op)

            lib.define(f"{{op}}(Tensor[] args) -> ()")
            lib.impl(op, impl, "CompositeExplicitAutograd")


def _define_capability_probes(probes):
    import torch

    for namespace, names in probes.items():
        lib = torch.library.Library(namespace, "FRAGMENT")
        _LIBS.append(lib)
        for op in names:
            if hasattr(getattr(torch.ops, namespace), op):
                continue

            def impl(cuda_device_capability):
                return False

            lib.define(f"{{op}}(int cuda_device_capability) -> bool")
            lib.impl(op, impl, "CompositeExplicitAutograd")


_LIBS = []
_define_placeholder_ops({ops!r})
_define_capability_probes({probes!r})
'''


STUB_SOURCE = '''\
# Generated by gpu/vllm_bundle_stubs.py: a stub of the H200 bundle.
"""Stub of {module!r}: {reason}."""


class BundleStubError(RuntimeError):
    """A stubbed module of the H200 bundle was used."""


def _fail(what):
    raise BundleStubError(
        f"{{what}} is a stub of the H200 bundle (gpu/vllm_bundle_stubs.py): "
        {reason!r})


class _PlaceholderMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        _fail(f"{{cls.__qualname__}}.{{name}}")

    def __call__(cls, *args, **kwargs):
        _fail(cls.__qualname__)


def _placeholder(name):
    def init_subclass(cls, **kwargs):
        _fail(f"subclassing {{cls.__bases__[0].__qualname__}}")

    return _PlaceholderMeta(name, (), {{
        "__qualname__": f"{{__name__}}.{{name}}", "__module__": __name__,
        "__init_subclass__": classmethod(init_subclass)}})


for _name in {names!r}:
    globals()[_name] = _placeholder(_name)


def __getattr__(name):
    if name.startswith("__") and name.endswith("__"):
        raise AttributeError(f"module {{__name__!r}} has no attribute {{name!r}}")
    _fail(f"{{__name__}}.{{name}}")
'''


def stub_source(module: str) -> str:
    reason, names = STUBS[module]
    source = STUB_SOURCE.format(module=module, reason=reason, names=tuple(names))
    if module == TORCH_OPS_STUB:
        source += TORCH_OPS_SOURCE.format(ops=TORCH_OPS,
                                          probes=TORCH_CAPABILITY_PROBES)
    return source


MARKER = "# Generated by gpu/vllm_bundle_stubs.py"


def _is_stub(path: Path) -> bool:
    if path.suffix != ".py":
        return False
    with open(path) as f:
        return f.readline().startswith(MARKER)


def write_stubs(top_dir: Path, vllm_parent: Path | None = None) -> list[Path]:
    """Write every stub; ``vllm.*`` ones beside vLLM's unpacked files (never
    over a real module), the others as packages under ``top_dir``."""
    written = []
    for module in STUBS:
        parts = module.split(".")
        if parts[0] == "vllm":
            if vllm_parent is None:
                continue
            path = vllm_parent.joinpath(*parts).with_suffix(".py")
            if any(not _is_stub(p) for p in path.parent.glob(parts[-1] + ".*")):
                continue  # a real module is there
        else:
            path = top_dir.joinpath(*parts, "__init__.py")
            for depth in range(1, len(parts)):  # parent packages of a dotted stub
                init = top_dir.joinpath(*parts[:depth], "__init__.py")
                if not init.exists():
                    init.parent.mkdir(parents=True, exist_ok=True)
                    init.write_text(stub_source(module))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(stub_source(module))
        written.append(path)
    return written


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    for p in write_stubs(Path(sys.argv[1]),
                         Path(sys.argv[2]) if len(sys.argv) == 3 else None):
        print("stub", p)
    if len(sys.argv) == 3:
        for p in apply_patches(Path(sys.argv[2])):
            print("patched", p)
