# SPDX-License-Identifier: Apache-2.0
"""Start a ``vllm serve`` recipe on CPU as vLLM starts it on a GPU.

``start_recipe(argv, major)`` takes the flags of a ``vllm serve`` command and
runs, on a tiny Kimi-K3 target and its K3 DSpark draft (config only, no
weights, built on the meta device; ``PairShape``: ``TINY``, or ``K3_LIKE``,
Kimi-K3's architecture and layer pattern), what vLLM runs before the first
token, with vLLM's own code:

1. the ``VllmConfig``, from the exact flags through vLLM's CLI parser and
   ``EngineArgs``, vLLM's config code answering as on an sm``major``0 host
   (``gpu_config.cuda_engine_config``: prefix caching, Kimi-K3's
   mamba-cache mode, the compilation and CUDA-graph modes as vLLM sets them
   there), then the CUDA platform's config hook with the plugin's start-up
   checks in it (``check_on_cuda``);
2. the worker's model load: vLLM's model classes for the target
   (``KimiLinearForCausalLM``, the text model Kimi-K3 builds: its KDA layers
   and its MLA layers, Kimi-K3's ``MultiHeadLatentAttention``; for
   ``K3_LIKE`` the ``KimiK3ForConditionalGeneration`` around it, vision
   tower included) and the draft (vLLM's ``load_dspark_model``, which
   derives the draft's config: its attention backend, KV dtype and
   non-causal attention), each layer selecting its backend with its own KV
   dtype through vLLM's selector as on sm``major``0
   (``cuda_selection.as_cuda_gpu``), the plugin's overrides registered;
3. the platform's ``update_block_size_for_backend`` (vLLM's hybrid
   alignment), vLLM's KV-cache specs (``get_kv_cache_spec``), the engine
   core's own KV-cache set-up (``EngineCore._initialize_kv_caches`` over
   one worker: prefix caching and chunked prefill off for non-causal
   layers, the layout, ``get_kv_cache_configs``, the block size and
   ``validate_block_size``), every group's metadata builders
   (``init_attn_backend``): the target runner's, and the DSpark
   speculator's own for the draft's layers (its ``attn_vllm_config``), on
   rank 0 of a faked DCP group; the runner's CUDA-graph mode
   (``resolve_cudagraph_mode_and_sizes`` as Model Runner V2 calls it) and
   the speculator's (its ``init_cudagraph_manager``), and the model
   runner's ``check_attention_cp_compatibility``.

What stands in for a GPU: the process groups (a rank of ``-tp`` / ``-dcp``
that talks to nobody), CUDA streams and events (none), the DCP
communication manager (no collectives), sm100's fused GEMM-RS/AR (off: NCCL
symmetric memory), Tokenspeed's prefill JIT warm-up and the MLA *prefill*
backend (a
stand-in: FlashAttention's prefill kernels are absent from CPU builds; the
decode backends are the subject), the host's GPUs (8 of 80 GiB, Triton
present), the worker's memory profile (8 GiB for the KV cache) and the
CUDA-graph managers (only their modes are read). Any error vLLM or the plugin raises on the
way is raised as is: a recipe that this does not start would fail on a GPU
at that step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import weakref
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import torch

from tests.support.builder_harness import _fake_dcp_manager, fake_dcp_group
from tests.support.cuda_selection import plugin_registered
from tests.support.gpu_config import cuda_engine_config, on_cuda_host
from tests.support.gpu_startup import (draft_cudagraph_mode,
                                       engine_core_kv_cache_config,
                                       runner_cudagraph_mode)
from tests.support.tiny_dspark import tiny_dspark_config

K3_TARGET_LAYERS = 61  # Kimi-K3's; a recipe's layer indices are counted in it
TINY_TARGET_LAYERS = 2
TINY_DRAFT_LAYERS = 1


@dataclass(frozen=True)
class PairShape:
    """The layers of a tiny Kimi-K3 pair: the target's, one letter each
    (``k`` Kimi Delta Attention, ``m`` MLA), and the draft's count (MLA)."""

    target: str = "km"
    draft_layers: int = TINY_DRAFT_LAYERS
    # The target as Kimi-K3's checkpoint names it: the multimodal
    # ``KimiK3ForConditionalGeneration`` (a tiny Kimi-K2.5 vision tower and
    # projector around the text model); else the text model alone.
    multimodal: bool = False
    # The KDA state: heads (None: the model's attention heads) and head dim;
    # Kimi-Linear's is 32 x 128, whose page vLLM's hybrid alignment covers.
    kda_heads: int | None = None
    kda_head_dim: int = 64

    @property
    def target_layers(self) -> int:
        return len(self.target)


# One KDA and one MLA target layer, one draft layer.
TINY = PairShape()
# Kimi-K3's architecture and pattern (three KDA layers to one MLA layer)
# over 12 target layers, and a two-layer draft: vLLM's hybrid grouping then
# puts target and draft MLA layers in one KV-cache group, served by one
# builder per backend.
K3_LIKE = PairShape("kkkmkkkmkkkm", 2, multimodal=True)

# A tiny Kimi-K3 vision tower (MoonViT) and projector.
TINY_VISION_CONFIG = dict(vt_num_attention_heads=2, vt_num_hidden_layers=1,
                          vt_hidden_size=64, vt_intermediate_size=128,
                          qkv_hidden_size=96, mm_hidden_size=64)


def tiny_k3_configs(*, num_layers: int = TINY_TARGET_LAYERS,
                    num_draft_layers: int = TINY_DRAFT_LAYERS,
                    num_heads: int = 16,
                    shape: PairShape | None = None) -> tuple[dict, dict]:
    """config.json of a tiny Kimi-K3 text model and of a K3 DSpark draft for
    it. As Kimi-K3, a hybrid: Kimi Delta Attention (KDA, linear attention
    with a recurrent state) layers and MLA layers (NoPE, Kimi-K3's 512 + 64
    latent, q-LoRA): ``shape``'s, else layer 0 KDA and the others MLA
    (``num_layers``, ``num_draft_layers``); the text model alone
    (``KimiLinearForCausalLM``) or, where ``shape.multimodal``, wrapped as
    Kimi-K3's checkpoint names it (``KimiK3ForConditionalGeneration``).

    ``num_heads`` 16: 2 per rank at ``-tp 8``, as Kimi-K3's 96 are 12."""
    if shape is None:
        shape = PairShape("k" + "m" * (num_layers - 1), num_draft_layers)
    kinds = shape.target
    target = dict(
        architectures=["KimiLinearForCausalLM"], model_type="kimi_linear",
        vocab_size=256, hidden_size=256, intermediate_size=512,
        num_hidden_layers=len(kinds), num_attention_heads=num_heads,
        num_key_value_heads=num_heads, q_lora_rank=128, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        mla_use_nope=True, mla_use_output_gate=False,
        linear_attn_config=dict(  # 1-based layer numbers
            kda_layers=[i + 1 for i, kind in enumerate(kinds) if kind == "k"],
            full_attn_layers=[i + 1 for i, kind in enumerate(kinds) if kind == "m"],
            num_heads=shape.kda_heads or num_heads, head_dim=shape.kda_head_dim,
            short_conv_kernel_size=4,
            use_full_rank_gate=True),
        max_position_embeddings=8192, rms_norm_eps=1e-6, hidden_act="silu",
        bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype="bfloat16")
    draft = tiny_dspark_config(target, num_layers=shape.draft_layers)
    draft["torch_dtype"] = "bfloat16"
    if shape.multimodal:
        text = {k: v for k, v in target.items() if k != "architectures"}
        target = dict(
            architectures=["KimiK3ForConditionalGeneration"], model_type="kimi_k3",
            text_config=text,
            vision_config=dict(TINY_VISION_CONFIG, text_hidden_size=text["hidden_size"]),
            media_placeholder_token_id=text["vocab_size"] - 6, pad_token_id=0,
            torch_dtype="bfloat16")
    return target, draft


def write_tiny_k3_pair(root: Path, shape: PairShape = TINY) -> tuple[Path, Path]:
    """The two configs as checkpoint folders (config.json only)."""
    target, draft = tiny_k3_configs(shape=shape)
    paths = []
    for name, config in (("target", target), ("draft", draft)):
        path = Path(root) / name
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(config))
        paths.append(path)
    return paths[0], paths[1]


def serve_args(argv: list[str] | str):
    """``vllm serve`` flags (after the model) as vLLM's CLI parser reads them:
    its ``EngineArgs``."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if isinstance(argv, str):
        argv = shlex.split(argv)
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    return EngineArgs.from_cli_args(parser.parse_args(["--model", "unused", *argv]))


def _tiny_layer_index(index: int, shape: PairShape = TINY) -> int:
    """A Kimi-K3 layer index of a recipe (0-60 the target's, 61 on the
    draft's) as the same layer of the tiny pair."""
    if index >= K3_TARGET_LAYERS:
        return shape.target_layers + index - K3_TARGET_LAYERS
    if index >= shape.target_layers:
        raise ValueError(f"layer {index}: the tiny target has "
                         f"{shape.target_layers} layers")
    return index


def engine_flags(args, target: Path, draft: Path, *, dcp: int | None = None,
                 k3_layer_indices: bool = True, shape: PairShape = TINY) -> dict:
    """The ``EngineArgs`` fields a recipe sets, for the tiny pair: its model
    and draft replaced, ``-dcp`` replaced by ``dcp`` if given, layer indices
    mapped to the tiny pair (``k3_layer_indices``: they count Kimi-K3's)."""
    from vllm.engine.arg_utils import EngineArgs

    defaults = EngineArgs(model="unused")
    flags = {name: value for name, value in vars(args).items()
             if value != getattr(defaults, name) and name != "model"}
    spec = dict(flags.get("speculative_config") or {})
    if spec and spec.get("method") != "ngram":  # n-gram has no draft model
        spec["model"] = str(draft)
        flags["speculative_config"] = spec
    skipped = flags.get("kv_cache_dtype_skip_layers")
    if skipped and k3_layer_indices:
        flags["kv_cache_dtype_skip_layers"] = [
            str(_tiny_layer_index(int(i), shape)) if str(i).isdigit() else i
            for i in skipped]
    if dcp is not None:
        flags["decode_context_parallel_size"] = dcp
    flags.setdefault("max_model_len", 4096)
    flags.setdefault("dtype", "bfloat16")
    return flags


@dataclass(frozen=True)
class LayerStart:
    """One attention layer as the worker built it."""

    draft: bool  # the DSpark draft's (built by load_dspark_model)
    backend: str  # the backend it selected
    kv_cache_dtype: str  # its own (the layer's ``kv_cache_dtype``)
    builder: type  # its group's metadata builder class


@dataclass(frozen=True)
class RecipeStart:
    """What a started recipe runs: every layer, and the block sizes."""

    block_size: int
    kernel_block_sizes: tuple[int, ...]  # per KV-cache group
    layers: dict[str, LayerStart]  # the MLA layers
    state_layers: dict[str, tuple]  # the others: (backend, builder class)
    vllm_config: object
    # Per MLA layer, the builder that builds the metadata of the forwards it
    # runs in: the target runner's for a target layer, the DSpark
    # speculator's (its own ``init_attn_backend``) for a draft layer.
    forward_builders: dict[str, object] = dataclasses.field(default_factory=dict)
    # Per MLA layer, the target runner's builder of its KV-cache group (for
    # a draft layer, one that may serve target layers too).
    runner_builders: dict[str, object] = dataclasses.field(default_factory=dict)
    # The CUDA-graph mode the config asks for (vLLM's default on a GPU unless
    # the flags name one), the modes the target runner and the DSpark
    # speculator resolve from it (None: no draft), and the weakest support
    # of the runner's and the speculator's attention groups (vLLM's
    # ``AttentionCGSupportInfo``).
    cudagraph_requested: object = None
    cudagraph_modes: tuple = (None, None)
    cudagraph_support: tuple = (None, None)

    def backends(self) -> tuple[str, ...]:
        """The backends of the target's MLA layers, then the draft's."""
        return tuple(dict.fromkeys(
            layer.backend for draft in (False, True)
            for layer in self.layers.values() if layer.draft == draft))

    def role(self, draft: bool) -> tuple[str, str]:
        """(backend, KV dtype) of the target's (or draft's) layers; one pair."""
        pairs = {(layer.backend, layer.kv_cache_dtype)
                 for layer in self.layers.values() if layer.draft == draft}
        assert len(pairs) == 1, pairs
        return next(iter(pairs))


class _PrefillStandIn:
    """The MLA prefill backend a layer keeps (prefill is not under test)."""

    def __init__(self, **kwargs):
        pass

    @classmethod
    def get_name(cls) -> str:
        return "PREFILL_STAND_IN"

    def clone(self):
        return self


def import_on_cpu(config=None) -> None:
    """vLLM modules that must be imported as on the CPU platform: at import
    they probe the GPU ops of the current platform (absent here); with
    ``config``, its model's class too (vLLM's hybrid alignment resolves it)."""
    if config is not None and config.model_config is not None:
        from vllm.model_executor.models import ModelRegistry

        ModelRegistry.resolve_model_cls(config.model_config.architecture,
                                        model_config=config.model_config)
    import vllm.compilation.backends  # noqa: F401
    import vllm.model_executor.model_loader  # noqa: F401
    import vllm.model_executor.models.qwen3_dflash  # noqa: F401
    import vllm.models.kimi_k3.nvidia.dspark_mla  # noqa: F401
    import vllm.models.kimi_k3.nvidia.model  # noqa: F401
    import vllm.v1.worker.gpu.attn_utils  # noqa: F401
    import vllm.v1.worker.gpu.spec_decode.dspark.speculator  # noqa: F401
    import vllm.v1.worker.gpu.spec_decode.dspark.utils  # noqa: F401
    import vllm.v1.worker.gpu.spec_decode.eagle.utils  # noqa: F401


@contextlib.contextmanager
def _worker_rank(cuda_platform, tp: int, dcp: int):
    """Rank 0 of ``-tp tp -dcp dcp`` without a process group, and the other
    GPU-only pieces the model classes construct."""
    from vllm.distributed import parallel_state
    from vllm.v1.attention.backends.mla.prefill import selector as prefill

    def group(size):
        return SimpleNamespace(world_size=size, rank_in_group=0, rank=0,
                               ranks=list(range(size)), is_first_rank=True,
                               is_last_rank=True)

    prefill._auto_select_mla_prefill_backend.cache_clear()
    try:
        with contextlib.ExitStack() as stack:
            enter = stack.enter_context
            enter(fake_dcp_group(dcp, 0))
            enter(mock.patch.object(parallel_state, "_TP", group(tp)))
            enter(mock.patch.object(parallel_state, "_PP", group(1)))
            enter(mock.patch.object(parallel_state, "_EP", group(1), create=True))
            enter(mock.patch.object(torch.cuda, "Stream", lambda *a, **k: None))
            enter(mock.patch.object(torch.cuda, "Event", lambda *a, **k: None))
            enter(mock.patch("vllm.models.kimi_k3.nvidia.mla.MLADCPManager",
                             lambda **kwargs: _fake_dcp_manager()))
            # sm100's fused GEMM + reduce-scatter/all-reduce: NCCL symmetric
            # memory over the TP group (off, as where it cannot run).
            enter(mock.patch("vllm.models.kimi_k3.nvidia.model.maybe_init_gemm_rs_ar",
                             lambda *args, **kwargs: False))
            # Tokenspeed's impl JIT-compiles its prefill kernel when made.
            enter(mock.patch("tokenspeed_mla.warmup_compile_prefill",
                             lambda **kwargs: None))
            enter(mock.patch.object(
                cuda_platform, "get_mla_prefill_backend_cls",
                classmethod(lambda cls, selector_config: _PrefillStandIn)))
            # A prefill backend named in --attention-config is vLLM's own;
            # TRTLLM_RAGGED takes its buffer from the workspace the GPU model
            # runner makes (here on the meta device, for that backend only).
            enter(mock.patch(
                "vllm.v1.attention.backends.mla.prefill.trtllm_ragged."
                "current_workspace_manager", lambda: _MetaWorkspace()))
            # The draft's config is rebuilt (vLLM's ``replace``), running the
            # platform's config hook, the plugin's start-up checks in it, as
            # on a GPU (the plugin installs them on the platform it loads on).
            enter(_startup_checks_on(cuda_platform))
            yield
    finally:
        prefill._auto_select_mla_prefill_backend.cache_clear()


class _MetaWorkspace:
    """vLLM's workspace manager as a prefill backend asks it for buffers."""

    @staticmethod
    def get_simultaneous(*specs):
        return [torch.empty(shape, dtype=dtype, device="meta")
                for shape, dtype in specs]


@contextlib.contextmanager
def _startup_checks_on(platform_cls):
    """The plugin's start-up checks in ``platform_cls``'s config hook, as the
    plugin installs them on a GPU's platform; removed on the way out."""
    from vllm.v1.attention.backends.mla import dcp_startup_checks

    saved = platform_cls.__dict__.get("check_and_update_config")
    with mock.patch("vllm.platforms.current_platform", platform_cls()):
        dcp_startup_checks.install()
    try:
        yield
    finally:
        if saved is None:
            del platform_cls.check_and_update_config
        else:
            platform_cls.check_and_update_config = saved


def build_config(flags: dict, target: Path, major: int):
    """The ``VllmConfig`` of ``flags`` as vLLM builds it on an sm``major``0
    host (``gpu_config.cuda_engine_config``: prefix caching, Kimi-K3's
    mamba-cache mode and the CUDA-graph mode as vLLM sets them there), when
    its platform hook runs: the block size not yet chosen unless
    ``--block-size`` named it. The environment vLLM's config code set is
    kept for ``start_config`` (the workers inherit it)."""
    from vllm.config.cache import CacheConfig

    config, env = cuda_engine_config(
        target, major, tp=flags.pop("tensor_parallel_size", 1),
        dcp=flags.pop("decode_context_parallel_size", 1), **flags)
    if not config.cache_config.user_specified_block_size:
        config.cache_config.block_size = CacheConfig.DEFAULT_BLOCK_SIZE
    _ENVIRONMENTS[id(config)] = env
    weakref.finalize(config, _ENVIRONMENTS.pop, id(config), None)
    return config


# Per config of ``build_config``, by id: the environment its workers inherit.
_ENVIRONMENTS: dict[int, dict] = {}


def _speculator(config):
    """The DSpark speculator as far as its attention and CUDA graphs go."""
    from vllm.model_executor.models.qwen3_dflash import dflash_has_any_non_causal
    from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator

    speculator = object.__new__(DSparkSpeculator)
    speculator.vllm_config = config
    speculator.speculative_config = config.speculative_config
    speculator.requires_non_causal = dflash_has_any_non_causal(
        config.speculative_config.draft_model_config.hf_config)
    return speculator


def _builders_by_layer(attn_groups) -> dict[str, object]:
    return {name: group.metadata_builders[0] for groups in attn_groups
            for group in groups for name in group.layer_names}


def start_config(config, major: int, *, plugin: bool = True,
                 flashmla: bool = True) -> RecipeStart:
    """Steps 2 and 3 on ``config`` (see the module docstring), with the
    plugin's backend overrides (``plugin``) or vLLM's own backends;
    ``flashmla``: vLLM's wheel built with FlashMLA's extension."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec, init_attn_backend
    from vllm.v1.worker.cp_utils import check_attention_cp_compatibility
    from vllm.v1.worker.gpu.spec_decode.dspark.utils import load_dspark_model

    import_on_cpu()
    parallel = config.parallel_config

    def get_model(*, vllm_config, model_config=None, **kwargs):
        return initialize_model(vllm_config, model_config=model_config)

    from vllm.model_executor.layers import rotary_embedding

    # vLLM caches each RoPE it builds (``get_rope``): the meta-device ones
    # built here must not serve a later model of this process.
    with plugin_registered(plugin), \
            on_cuda_host(major, flashmla=flashmla) as cuda_platform, \
            mock.patch.dict(rotary_embedding._ROPE_DICT), \
            mock.patch.dict(os.environ, _ENVIRONMENTS.get(id(config), {})), \
            _worker_rank(cuda_platform, parallel.tensor_parallel_size,
                         parallel.decode_context_parallel_size), \
            set_default_torch_dtype(config.model_config.dtype), \
            torch.device("meta"):
        target = initialize_model(config)
        num_target_layers = len(config.compilation_config.static_forward_context)
        spec = config.speculative_config
        if spec is not None and spec.method == "dspark":
            with mock.patch("vllm.model_executor.model_loader.get_model", get_model):
                load_dspark_model(target, config)
        draft_layers = set(list(config.compilation_config.static_forward_context)
                           [num_target_layers:])
        cuda_platform.update_block_size_for_backend(config)
        with set_current_vllm_config(config):
            specs = get_kv_cache_spec(config)
            kv_cache_config = engine_core_kv_cache_config(config, specs)
            attn_groups, cg_support, kernel_block_sizes = init_attn_backend(
                kv_cache_config, config, torch.device("cpu"),
                draft_layer_names=draft_layers or None)
            requested = config.compilation_config.cudagraph_mode
            runner_mode = runner_cudagraph_mode(config, target, cg_support,
                                                 kv_cache_config)
            # The model runner's check of every layer's impl under DCP (LSE,
            # spec decode at the interleave), the target's layers for PCP.
            check_attention_cp_compatibility(
                config, {name for group in kv_cache_config.kv_cache_groups
                         for name in group.layer_names} - draft_layers)
            draft_attn_groups, draft_mode, draft_cg_support = [], None, None
            if draft_layers:
                # The DSpark speculator's own builders (its ``set_attn``).
                speculator = _speculator(config)
                draft_config = speculator.attn_vllm_config
                with set_current_vllm_config(draft_config):
                    draft_attn_groups, draft_cg_support, _ = init_attn_backend(
                        kv_cache_config, draft_config, torch.device("cpu"),
                        active_layer_names=draft_layers)
                draft_mode = draft_cudagraph_mode(speculator, runner_mode,
                                                   draft_cg_support)
    context = config.compilation_config.static_forward_context
    runner_builders = _builders_by_layer(attn_groups)
    draft_builders = _builders_by_layer(draft_attn_groups)
    layers, state_layers, forward_builders = {}, {}, {}
    for index, (name, layer) in enumerate(context.items()):
        if not hasattr(layer, "kv_lora_rank"):  # Kimi-K3's KDA (linear) layers
            builder = runner_builders.get(name)
            state_layers[name] = (layer.get_attn_backend().get_name(),
                                  None if builder is None else type(builder))
            continue
        draft = index >= num_target_layers
        layers[name] = LayerStart(draft=draft,
                                  backend=layer.get_attn_backend().get_name(),
                                  kv_cache_dtype=str(layer.kv_cache_dtype),
                                  builder=type(runner_builders[name]))
        forward_builders[name] = (draft_builders if draft else runner_builders)[name]
    return RecipeStart(block_size=config.cache_config.block_size,
                       kernel_block_sizes=tuple(kernel_block_sizes),
                       layers=layers, state_layers=state_layers,
                       vllm_config=config, forward_builders=forward_builders,
                       cudagraph_requested=requested,
                       cudagraph_modes=(runner_mode, draft_mode),
                       cudagraph_support=(cg_support, draft_cg_support),
                       runner_builders={name: runner_builders[name]
                                        for name in layers})


def recipe_config(argv, root: Path, *, major: int, dcp: int | None = None,
                  k3_layer_indices: bool = True, shape: PairShape = TINY):
    """Step 1 up to the start-up checks: the ``VllmConfig`` of ``vllm serve``
    ``argv`` (the flags after the model) for the tiny pair of ``shape``
    under ``root``."""
    target, draft = write_tiny_k3_pair(root, shape)
    flags = engine_flags(serve_args(argv), target, draft, dcp=dcp,
                         k3_layer_indices=k3_layer_indices, shape=shape)
    return build_config(flags, target, major)


def check_on_cuda(config, major: int, *, flashmla: bool = True) -> None:
    """The CUDA platform's config hook on ``config`` as on an sm``major``0
    GPU, the plugin's start-up checks appended to it as the plugin installs
    them there (``build_config`` left them out); ``flashmla``: vLLM's wheel
    built with FlashMLA's extension."""
    from vllm.v1.attention.backends.mla import dcp_startup_checks

    from tests.support.cuda_selection import backends_overridden

    with on_cuda_host(major, flashmla=flashmla) as cuda_platform, \
            _startup_checks_on(cuda_platform), backends_overridden(), \
            mock.patch.object(dcp_startup_checks, "ASK_IN_CHILD_PROCESS", False):
        cuda_platform.check_and_update_config(config)


def start_recipe(argv, major: int, root: Path, *, dcp: int | None = None,
                 k3_layer_indices: bool = True, plugin: bool = True,
                 shape: PairShape = TINY) -> RecipeStart:
    """Start ``vllm serve`` ``argv`` (the flags after the model) on an
    sm``major``0 GPU, at ``-dcp dcp`` if given: steps 1 to 3. Raises what
    vLLM or the plugin raises."""
    config = recipe_config(argv, root, major=major, dcp=dcp,
                           k3_layer_indices=k3_layer_indices, shape=shape)
    check_on_cuda(config, major)
    return start_config(config, major, plugin=plugin)
