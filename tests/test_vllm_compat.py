# SPDX-License-Identifier: Apache-2.0
"""The plugin on the installed vLLM (0.32 or 0.34): it imports and registers
where vLLM has its hooks, keeps its hands off where it has not, routes every
combine vLLM may call through the rows' mask, and finds the CPU pieces by
feature."""

from __future__ import annotations

import importlib
import inspect
import logging
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from tests.support.builder_harness import make_vllm_config
from tests.support.cuda_selection import OVERRIDDEN, plugin_registered
from tests.support.kernel_stubs import import_on_cpu
from vllm.v1.attention.backends.mla import dcp_plugin


def test_every_override_module_imports_and_registers():
    with plugin_registered(True):
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        for name, class_path in dcp_plugin.BACKEND_OVERRIDES:
            module, cls_name = class_path.rsplit(".", 1)
            backend = getattr(import_on_cpu(module), cls_name)
            assert AttentionBackendEnum[name].get_path() == class_path
            assert backend.get_name() == name


def _warnings(caplog):
    return [r for r in caplog.records if r.levelno >= logging.WARNING
            and r.name == dcp_plugin.__name__]


@pytest.mark.parametrize("missing", [
    "register_backend", "AttentionBackendEnum.TOKENSPEED_MLA",
    "vllm.v1.attention.backends.mla.flashinfer_mla"])
def test_missing_hook_registers_nothing_and_warns_once(caplog, missing):
    import vllm
    from vllm.v1.attention.backends import registry

    real_find_spec = importlib.util.find_spec
    members = dict(registry.AttentionBackendEnum.__members__)
    patches = []
    if missing == "register_backend":
        patches.append(mock.patch.object(registry, "register_backend", None))
    elif missing.startswith("AttentionBackendEnum."):
        del members[missing.split(".")[1]]
        fake_enum = SimpleNamespace(__members__=members)
        patches.append(mock.patch.object(registry, "AttentionBackendEnum", fake_enum))
    else:
        patches.append(mock.patch.object(
            importlib.util, "find_spec",
            lambda name, *a: None if name == missing else real_find_spec(name, *a)))
    with plugin_registered(False):
        for patch in patches:
            patch.start()
        try:
            with caplog.at_level(logging.WARNING):
                dcp_plugin.register()
        finally:
            for patch in patches:
                patch.stop()
        overridden = [name for name in OVERRIDDEN
                      if registry.AttentionBackendEnum[name].is_overridden()]
    assert overridden == []
    (warning,) = _warnings(caplog)
    message = warning.getMessage()
    assert vllm.__version__ in message and missing.split(".")[-1] in message
    assert all(name in message for name in OVERRIDDEN)


def test_failing_registration_undoes_itself_and_never_raises(caplog):
    """An error half-way (here: the CPU rotary fix) leaves vLLM's own
    backends, and ``load_general_plugins()`` goes on."""
    import vllm.plugins
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    broken = mock.patch(
        "vllm.model_executor.layers.rotary_embedding.cpu_multihead_rope_fix.install",
        side_effect=RuntimeError("boom"))
    with plugin_registered(False), broken, caplog.at_level(logging.WARNING), \
            mock.patch.object(vllm.plugins, "plugins_loaded", False):
        vllm.plugins.load_general_plugins()
        overridden = [name for name in OVERRIDDEN
                      if AttentionBackendEnum[name].is_overridden()]
    assert overridden == []
    (warning,) = _warnings(caplog)
    assert "boom" in warning.getMessage()


def test_found_hooks_register_without_warning(caplog):
    with caplog.at_level(logging.WARNING), plugin_registered(True):
        pass
    assert dcp_plugin.missing_hooks() == []
    assert _warnings(caplog) == []


# ---------------------------------------------------------------------------
# The combine: every masking combine of vLLM's real MLADCPManager is routed.

@pytest.mark.parametrize("comm_backend", ["ag_rs", "a2a"])
def test_every_masking_combine_of_vllms_manager_is_routed(tmp_path, comm_backend):
    """Built by vLLM itself for ``--dcp-comm-backend``; on vLLM >= 0.33 the
    a2a path merges through ``v_up_proj_combine`` and skips ``combine``."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.mla.dcp_epilogue import route_combine_through_rows
    from vllm.v1.attention.ops import dcp as dcp_ops

    config = make_vllm_config(tmp_path / "m", dcp=2)
    config.parallel_config.dcp_comm_backend = comm_backend
    collectives = {name: mock.create_autospec(getattr(dcp_ops, name),
                                              return_value=name) for name in (
        "cp_lse_ag_out_rs", "dcp_a2a_lse_reduce", "dcp_a2a_v_up_proj_lse_reduce")
        if hasattr(dcp_ops, name)}
    group = SimpleNamespace(world_size=2, rank_in_group=0, device_group=None)
    params = inspect.signature(dcp_ops.MLADCPManager.__init__).parameters
    kwargs = {k: v for k, v in dict(
        vllm_config=config, device=torch.device("cpu"), num_heads=8,
        query_head_dim=576, output_head_dim=512, query_dtype=torch.bfloat16,
        output_dtype=torch.bfloat16, padded_num_heads=None, is_lse_base_on_e=True,
        use_pcp=False).items() if k in params}
    with mock.patch.object(dcp_ops, "get_dcp_group", return_value=group), \
            mock.patch.object(dcp_ops, "get_direct_dcp_a2a_workspace",
                              return_value=None, create=True), \
            mock.patch.object(dcp_ops, "get_direct_dcp_q_gather_workspace",
                              return_value=None, create=True), \
            mock.patch.multiple(dcp_ops, **collectives), \
            set_current_vllm_config(config):
        manager = dcp_ops.MLADCPManager(**kwargs)
    masking = [name for name, fn in vars(manager).items() if callable(fn)
               and "seq_lens" in inspect.signature(fn).parameters]
    assert "combine" in masking
    layer = SimpleNamespace(dcp_manager=manager)
    route_combine_through_rows(layer)
    for name in masking:
        args = (torch.zeros(2, 8, 4), torch.zeros(2, 8))
        if name == "v_up_proj_combine":  # + W_UV [H, L, V] and the output
            args += (torch.zeros(8, 4, 2), torch.zeros(2, 4 * 2))
        getattr(manager, name)(*args, seq_lens=torch.ones(1),
                               query_start_loc=torch.tensor([0, 2]))
    called = [mock_ for mock_ in collectives.values() if mock_.called]
    assert len(called) == len(masking)
    for collective in called:
        assert collective.call_args.kwargs.get("seq_lens") is None
        assert collective.call_args.kwargs.get("query_start_loc") is None


def test_flashinfer_builder_init_is_its_check_then_the_mla_builder(tmp_path):
    """``FlashInferDCPMLAMetadataBuilder`` calls ``MLACommonMetadataBuilder.
    __init__`` to pass its parent's interleave check; that is right only
    while the parent's ``__init__`` does nothing else. On a config the check
    accepts, the parent and the direct call give the same builder."""
    from tests.support.builder_harness import fake_dcp_group, make_builder

    module = import_on_cpu("vllm.v1.attention.backends.mla.flashinfer_mla")
    from vllm.model_executor.layers.attention.mla_attention import (
        MLACommonMetadataBuilder,
    )

    class Direct(module.FlashInferMLAMetadataBuilder):
        def __init__(self, spec, names, config, device):
            MLACommonMetadataBuilder.__init__(
                self, spec, names, config, device, module.FlashInferMLAMetadata,
                supports_dcp_with_varlen=True)

    config = make_vllm_config(tmp_path / "m", dcp=2, interleave=1,
                              block_size=64, num_speculative_tokens=3)
    builders = []
    for cls in (module.FlashInferMLAMetadataBuilder, Direct):
        with fake_dcp_group(2, 1):
            builders.append(make_builder(cls, config))
    parent, direct = builders
    assert set(vars(parent)) == set(vars(direct))
    for name, value in vars(parent).items():
        other = getattr(direct, name)
        if isinstance(value, torch.Tensor):
            assert value.shape == other.shape and value.dtype == other.dtype, name
        elif isinstance(value, (bool, int, float, str, type, type(None))):
            assert value == other, name


@pytest.mark.parametrize("world_size", [1, 2])
def test_combine_routed_once_per_layer_when_the_builder_is_made(tmp_path,
                                                                world_size):
    """vLLM makes each layer's ``dcp_manager`` with the layer, before any
    builder; the DCP rows builder routes every layer of its group once (a
    second builder of the group, as under DBO, wraps nothing twice), a
    forward never; at DCP size 1 nothing is routed."""
    from tests.support.builder_harness import fake_dcp_group, register_fake_mla_layers
    from tests.support.dense_reference import KV_LORA_RANK, ROPE_DIM
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.mla.cpu_dcp_mla import CPUDCPMLAMetadataBuilder
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    config = make_vllm_config(tmp_path / "m", dcp=world_size,
                              num_speculative_tokens=3)
    names = ["model.layers.0.attn", "model.layers.1.attn"]
    register_fake_mla_layers(config, names)
    context = config.compilation_config.static_forward_context
    upstream = {name: context[name].dcp_manager.combine for name in names}
    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1,
                            head_size=KV_LORA_RANK + ROPE_DIM, dtype=torch.float32)
    routed = None
    for _ in range(2):
        with fake_dcp_group(world_size, 0), set_current_vllm_config(config):
            CPUDCPMLAMetadataBuilder(spec, names, config, torch.device("cpu"))
        combines = {name: context[name].dcp_manager.combine for name in names}
        routed = routed or combines
        assert combines == routed
    for name in names:
        if world_size == 1:
            assert routed[name] is upstream[name]
        else:
            assert routed[name].__wrapped__ is upstream[name]


# ---------------------------------------------------------------------------
# CPU pieces: found by feature, not by version.

def test_cpu_pieces_follow_what_vllm_has():
    from vllm.v1.attention.backends.mla import cpu_dcp_patches
    from vllm.v1.attention.backends.mla import dcp_vllm_touches as touches

    has_slot_fallback = importlib.util.find_spec("vllm.utils.cpu_triton_utils") is not None
    cpu_pieces = tuple(t for t in touches.TOUCHES if (t.install or "").startswith(
        f"{cpu_dcp_patches.__name__}:"))
    with mock.patch.object(touches, "TOUCHES", cpu_pieces):
        installed = touches.install_touches(touches.PLUGIN)
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:
        assert installed["cpu_dcp_slot_mapping"] == has_slot_fallback
        assert installed["cpu_dcp_combine"]
    # The rotary fix is its own module (cpu_multihead_rope_fix).
    assert not any("rope" in name for name in installed)
    # Each piece on its own, whatever Triton's state (idempotent).
    assert cpu_dcp_patches.install_slot_mapping() == has_slot_fallback


def test_absent_cpu_hooks_are_left_out_without_error():
    from vllm.v1.attention.backends.mla import cpu_dcp_patches

    with mock.patch.object(cpu_dcp_patches, "_find", return_value=None):
        assert cpu_dcp_patches.install_slot_mapping() is False
        assert cpu_dcp_patches.install_combine() is False
        assert cpu_dcp_patches.fill_combine_constexprs() is False


@pytest.mark.parametrize("kernel_kind", ["jit", "placeholder"])
def test_combine_constexprs_from_a_jit_kernel_or_a_plain_function(kernel_kind):
    """The combine kernel as Triton's ``jit`` made it (``arg_names``) or as
    vLLM's Triton placeholder left it, a plain function (a process where
    vLLM found no Triton driver at import): the launcher gets the
    constexprs' positions either way."""
    from vllm.v1.attention.backends.mla import cpu_dcp_patches

    def kernel(out_ptr, lse_ptr, rank, HEAD_DIM, N_ROUNDED, IS_BASE_E):
        pass

    if kernel_kind == "jit":
        kernel = SimpleNamespace(arg_names=["out_ptr", "lse_ptr", "rank", "HEAD_DIM",
                                            "N_ROUNDED", "IS_BASE_E"])
    kernel_cls = SimpleNamespace(kernel=kernel)
    with mock.patch.object(cpu_dcp_patches, "_find", return_value=kernel_cls):
        assert cpu_dcp_patches.fill_combine_constexprs() is True
    assert kernel.constexprs == [3, 4, 5]


# ---------------------------------------------------------------------------
# vLLM >= 0.33: a cache every rank holds whole is built at DCP size 1.

def test_replicated_cache_builder_sees_dcp_size_1(tmp_path):
    """A DCP-1 draft under a ``-dcp 8`` target (``dcp_sharded=False``): where
    vLLM builds such a cache at DCP size 1 (>= 0.33) so does the plugin, and
    DCP-only limits (here an interleave that does not divide the block) do
    not apply; a sharded cache still fails."""

    from tests.support.builder_harness import fake_dcp_group, register_fake_mla_layers
    from tests.support.dense_reference import KV_LORA_RANK, ROPE_DIM
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    module = import_on_cpu("vllm.v1.attention.backends.mla.flashinfer_dcp_mla")
    # The config-time checks (dcp_startup_checks) refuse interleave 48 on
    # this CPU before any builder exists; what is tested here is the
    # FlashInfer builder's own check, as on a GPU.
    with mock.patch("vllm.v1.attention.backends.mla.dcp_startup_checks."
                    "check_vllm_config"):
        config = make_vllm_config(tmp_path / "m", dcp=8, interleave=48,
                                  block_size=64, num_speculative_tokens=3)
    names = ["model.layers.0.attn"]
    register_fake_mla_layers(config, names, non_causal=True)
    results = {}
    for sharded in (True, False):
        spec = MLAAttentionSpec(block_size=64, num_kv_heads=1,
                                head_size=KV_LORA_RANK + ROPE_DIM,
                                dtype=torch.bfloat16, dcp_sharded=sharded)
        with fake_dcp_group(8, 3), set_current_vllm_config(config), \
                mock.patch.object(module.checks, "current_gpu_major", return_value=10):
            try:
                builder = module.FlashInferDCPMLAMetadataBuilder(
                    spec, names, config, torch.device("cpu"))
                setting = builder.dcp_setting  # None: upstream's builder
                results[sharded] = (builder.dcp_world_size,
                                    setting and setting.dcp_rank)
            except ValueError as error:
                results[sharded] = str(error)
    assert "--cp-kv-cache-interleave-size 48" in results[True]
    # The check follows the DCP size vLLM's own MLA builder runs at.
    upstream = _upstream_mla_builder_dcp_size(config, names)
    if upstream == 8:  # vLLM 0.32: every MLA cache is sharded
        assert results[False] == results[True]
    else:
        assert upstream == 1 and results[False] == (1, None)


def _upstream_mla_builder_dcp_size(config, names):
    """DCP size vLLM's own MLA builder takes for a dcp_sharded=False cache."""
    from tests.support.builder_harness import fake_dcp_group
    from tests.support.dense_reference import KV_LORA_RANK, ROPE_DIM
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.mla_attention import (
        MLACommonMetadata,
        MLACommonMetadataBuilder,
    )
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    spec = MLAAttentionSpec(block_size=64, num_kv_heads=1,
                            head_size=KV_LORA_RANK + ROPE_DIM, dtype=torch.bfloat16,
                            dcp_sharded=False)
    with fake_dcp_group(8, 3), set_current_vllm_config(config):
        builder = MLACommonMetadataBuilder(spec, names, config, torch.device("cpu"),
                                           MLACommonMetadata,
                                           supports_dcp_with_varlen=True)
    return builder.dcp_world_size
