import os
import signal
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)  # tiny models: one thread is faster than two on a busy 2-core CI box


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _sigint_not_ignored(request):
    """A test's children inherit an ignored SIGINT (SIG_IGN survives exec), and then ignore the SIGINT a test
    sends them (the launchers forward only signals not ignored): the four launcher and extract tests that
    send one timed out whenever an earlier test in the same xdist worker had left SIGINT ignored. Each
    test starts with Python's default handler, and a test that leaves SIGINT ignored is named."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        print(f"\nconftest: {request.node.nodeid} left SIGINT ignored", file=sys.stderr, flush=True)


@pytest.fixture(scope="session")
def llama_bin():
    """The llama-server this project builds (``dflash serve build``, cached per machine): skipped when it is
    not built, a failure under ``DFLASH_REQUIRE_LLAMA_CPP=1`` (``.ci/run``)."""
    from dflash_staged.serve.llamacpp import build as llama_build

    if not llama_build.is_built("cpu"):
        if os.environ.get("DFLASH_REQUIRE_LLAMA_CPP") == "1":
            pytest.fail(f"llama-server is not built under {llama_build.home()}: run `dflash serve build`")
        pytest.skip("llama-server is not built on this machine: run `dflash serve build` (once, 6-30 min)")
    return llama_build.bin_dir("cpu")


from pgcluster import backend, pg  # noqa: E402,F401 - fixtures: a throwaway PostgreSQL server, each backend
