import os

import pytest

from tests.engine.tiny import make_noisy_copy
from tests.fixtures.tiny_models import make_tiny_pair

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")


@pytest.fixture(scope="session")
def tiny_close_pair(tmp_path_factory):
    """The tiny target with its tokenizer, and a draft that is the target plus a little noise:
    most drafts are accepted, some are not, so every speculation counter moves."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("tiny-models")
    target, _ = make_tiny_pair(root)
    draft = make_noisy_copy(target, root / "close-draft", noise=0.05)
    AutoTokenizer.from_pretrained(target).save_pretrained(draft)
    return target, draft
