# SPDX-License-Identifier: Apache-2.0
"""A real ``vllm serve`` that refuses a DCP setting, through the launcher.

Without ``--cpu`` the launcher cannot know the KV block size, so interleave
48 reaches the server: its start-up check (``dcp_startup_checks``, run while
vLLM builds its config) refuses it before any engine starts, and the
launcher prints that error and no traceback of its own.
"""

from __future__ import annotations

import json
import time

import pytest

from tools import serve_dcp_dspark as serve
from tests.support.builder_harness import TINY_MLA_CONFIG

pytestmark = pytest.mark.engine


def test_real_vllm_serve_failure_is_reported(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_MLA_CONFIG))
    log = tmp_path / "server.log"
    t0 = time.monotonic()
    code = serve.main(["--model", str(model), "--tp", "2", "--dcp", "2",
                       "--interleave", "48", "--port", str(serve.free_port()),
                       "--ready-timeout", "300", "--log", str(log), "--",
                       "--dtype", "float32", "--skip-tokenizer-init",
                       # on a CPU with AMX tiles vLLM would pick AMX_MLA
                       "--attention-backend", "CPU_MLA"])
    elapsed = time.monotonic() - t0
    assert code == 1
    err = capsys.readouterr().err
    assert "error: vLLM server exited with code 1 before it was healthy" in err
    assert "CPU_MLA" in err and "--cp-kv-cache-interleave-size 48 must divide" in err
    assert "Traceback" not in err
    assert "Traceback" in log.read_text()  # the server's own, in its log
    assert "Loading weights" not in log.read_text()  # refused before the model
    assert elapsed < 240
