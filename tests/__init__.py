# SPDX-License-Identifier: Apache-2.0
"""The project's tests. A regular package, so that ``tests.support`` is this
repository's wherever another installed package ships a top-level ``tests``."""
