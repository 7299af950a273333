"""Test-wide settings: one torch thread (the machine has two cores and tests run beside others)."""

from __future__ import annotations

import torch

torch.set_num_threads(1)
