# SPDX-License-Identifier: Apache-2.0
"""What tests and benchmarks share (no tests here)."""
