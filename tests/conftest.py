import os

import pytest

# HF_ACTQ_TEST_DEVICE=cuda runs the kernel, op and integration tests on a GPU: tensors and models
# the tests create land there (torch's default device), and the Triton kernels compile for it.
# Otherwise (the development and CI machines have no GPU) the kernels run under the interpreter,
# which must be chosen before triton is first imported; the AOT test clears it in a subprocess.
TEST_DEVICE = os.environ.get("HF_ACTQ_TEST_DEVICE", "cpu")
# The tests download nothing. huggingface_hub reads this once, at import: set before any test
# imports it, a lookup that misses (a model id that is not a preset) fails at once instead of
# retrying the network for 23 s.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if TEST_DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    os.environ["TRITON_INTERPRET"] = "0"
# Under pytest-xdist (the README's `python -m pytest -n 2`) each worker is one process per core
# and gets one intra-op thread: two workers of two threads each on two cores spin against each
# other (the default suite took 863 s so, 303 s with one thread each, about 590 s in one process).
# The environment variable reaches the processes the tests launch too.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)


# The tests that launch two ranks each: one worker runs them, one after another. Two launches
# side by side put four ranks on CI's two cores, whose gloo collectives wait on each other (one
# suite's five launches took 126 s of its workers' time so, 59 s one after another).
LAUNCHES = ("tests/integrations/test_deepspeed.py", "tests/integrations/test_accelerate.py")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's load scheduling, each test a work unit of its own but the launches, one unit
    (``--dist loadgroup`` would do it, but no longer groups under pytest 9.2: xdist's group
    suffix on node ids is lost, pytest-dev/pytest-xdist#1386)."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class LaunchesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "launches" if nodeid.startswith(LAUNCHES) else nodeid

    return LaunchesTogether(config, log)


@pytest.fixture(autouse=True)
def _test_device():
    if TEST_DEVICE == "cpu":
        yield
        return
    import torch

    torch.set_default_device(TEST_DEVICE)
    yield
    torch.set_default_device(None)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``needs_kernels`` run the Triton kernels: by the interpreter on the CPU, or
    on a GPU. Skipped where neither can (the transformers-floor suite installs no Triton)."""
    import importlib.util

    if importlib.util.find_spec("triton") is not None and (
        os.environ.get("TRITON_INTERPRET") == "1" or TEST_DEVICE == "cuda"
    ):
        return
    skip = pytest.mark.skip(reason="needs Triton, and its interpreter or a GPU")
    for item in items:
        if item.get_closest_marker("needs_kernels") is not None:
            item.add_marker(skip)
