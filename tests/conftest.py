"""Shared fixtures: tiny random-weight Llama-family checkpoints built in the test, no files needed."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)
