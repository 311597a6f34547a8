# SPDX-License-Identifier: Apache-2.0
"""Ships ``vllm_dcp_dspark_cpu_mrv2.pth`` at the top of site-packages.

Everything else is configured in pyproject.toml. A ``.pth`` file is the only
way to run code in every Python process (vLLM spawns its engine core and
workers) before vLLM imports Triton; the one shipped here imports nothing: it
hooks the process's first ``import vllm``, which boots the CPU MRV2 route if
``VLLM_DCP_CPU_MRV2`` is on by then (see
vllm/v1/worker/cpu/triton_interpreter_boot.py).
"""

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "vllm_dcp_dspark_cpu_mrv2.pth"


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        shutil.copyfile(PTH, os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [
            os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": BuildPyWithPth})
