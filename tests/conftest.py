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


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory):
    """The demo's model: built and warm-started by the demo's own builder, once per test session."""
    import subprocess
    out = str(tmp_path_factory.mktemp("demo_model"))
    subprocess.run([sys.executable, "-m", "demo.tiny_model", "--out", out], cwd=ROOT, check=True,
                   capture_output=True, timeout=600)
    return out
