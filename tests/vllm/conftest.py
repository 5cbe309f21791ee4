"""Tests that need vLLM (and torch): without the vllm extra, collecting this folder skips it cleanly."""

import pytest

pytest.importorskip("vllm")
