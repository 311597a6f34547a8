# SPDX-License-Identifier: Apache-2.0
"""A real ``vllm serve`` that vLLM accepts and that then dies, through the
launcher.

The command passes vLLM's config code and the plugin's start-up check (run
by the launcher before the start, ``tests/test_serve_launcher.py``), but the
checkpoint holds no weights: the workers fail at the weight load, and the
launcher prints the server's own error line and no traceback of its own.
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
                       "--interleave", "16", "--cpu", "--port", str(serve.free_port()),
                       "--ready-timeout", "300", "--log", str(log), "--",
                       "--dtype", "float32", "--skip-tokenizer-init"])
    elapsed = time.monotonic() - t0
    assert code == 1
    err = capsys.readouterr().err
    assert "error: vLLM server exited with code 1 before it was healthy" in err
    assert "Cannot find any model weights" in err, err
    assert "Traceback" not in err
    assert "Traceback" in log.read_text()  # the server's own, in its log
    assert elapsed < 240
