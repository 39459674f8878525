"""pytest markers shared by the test files."""

from __future__ import annotations

import shutil

import pytest

needs_compiler = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                    reason="torch inductor's CPU backend (the one-pass CPU Adam) "
                                           "needs a C++ compiler")
"""Skips a test of the compiled one-pass CPU Adam where no C++ compiler is installed."""
