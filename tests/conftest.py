import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A randomly initialised tiny Qwen2 model + char tokenizer in HF format (built locally, no download)."""
    from demo.tiny_model import build_model, build_tokenizer, save
    tok = build_tokenizer()
    return save(build_model(tok, seed=0), tok, str(tmp_path_factory.mktemp("tiny")))
