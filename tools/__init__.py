# SPDX-License-Identifier: Apache-2.0
"""What users run: the serve launcher, the GSM8K runner, the DCP simulator.

Run from the repository root as modules (``python -m tools.<name>``). The
simulator and its simulated ranks are also installed, as the top-level
package ``vllm_dcp_tools`` (console script ``vllm-dcp-simulate``; see
pyproject.toml). Imports nothing: ``vllm-dcp-simulate --help`` stays instant.
"""
