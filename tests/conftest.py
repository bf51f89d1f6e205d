"""Shared fixtures: tiny random models of each family and transformers references.

Models are made with transformers (random weights with a wide spread so greedy
argmax is decisive), saved to a temp dir, and loaded through tandem's real loader.
"""

from __future__ import annotations

import os
import random
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from unittest import mock

import pytest

# Two or more xdist workers on a machine share its cores: each one's torch (and each process it
# starts) takes one thread. Two workers with a thread per core each spin on one another's
# cores, and their CPU tests take nearly twice as long side by side (45 s against 25 s for two
# model modules here). Set before torch loads, so its thread pool and any child inherit it.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402  (after OMP_NUM_THREADS)

from tandem.cluster.direct_ingress import HAPROXY, use_proxy

# Built-in models made by tests go to a throwaway cache, never the user's.
os.environ.setdefault("TANDEM_CACHE_DIR", tempfile.mkdtemp(prefix="tandem-test-cache-"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Every Ray the tests start (the shared one, Clusters, `ray start`, `tandem serve` in a
# subprocess) puts HAProxy in front of the ingress, as `tandem serve` does by default.
use_proxy(HAPROXY)
# Without a GPU, the Triton kernels run through Triton's interpreter. It must be on before any
# kernel is defined (at import), so it is set here, before any test module is collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from tests.triton_interpreter import skip_repatching_in_helpers

    skip_repatching_in_helpers()

ARCHITECTURES = ("llama", "mistral", "qwen2")
_MODEL_ROOT = tempfile.mkdtemp(prefix="tandem-test-models-")


_built: dict[str, str] = {}


def wait_for(predicate, timeout_s: float = 30.0, interval_s: float = 0.1):
    """Poll predicate until it is truthy or timeout_s has passed; returns its last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)


def tiny_model(architecture: str = "llama", **overrides) -> str:
    """Path of a tiny model (built once per test session and options)."""
    from tandem.workers.model.demo_model import create_model_dir

    name = architecture + "".join(f"-{k}={v}" for k, v in sorted(overrides.items()))
    if name in _built:
        return _built[name]
    spec = dict(architecture=architecture, vocab_size=512, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, init_std=0.15, seed=7)
    spec.update(overrides)
    safe = "".join(c if c.isalnum() or c in "-=_." else "_" for c in name)
    _built[name] = create_model_dir(os.path.join(_MODEL_ROOT, safe), **spec)
    return _built[name]


def mixed_prompts(seed: int = 0, lengths: tuple[int, ...] = (3, 17, 40, 90)) -> list[list[int]]:
    """Token-id prompts of very different lengths (ids clear of the special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(10, 500) for _ in range(n)] for n in lengths]


# A schedule of mixed steps (four sequences at a time, a 64-token step budget, steps scheduled
# ahead): a lone chunk of the 80-token prompt that scores nothing, four chunks, the 60-token
# prompt's rest beside three decodes, and the last two prompts beside the last decode. Its
# steps as (graph bucket, tokens, prompt chunks); the CPU and GPU mixed-graph tests share it.
MIXED_SCHEDULE_PROMPTS = {"seed": 9, "lengths": (80, 3, 30, 60, 5, 22)}
MIXED_SCHEDULE_STEPS = [(64, 64, 1), (64, 64, 4), (48, 48, 1), (32, 27, 2)]


@cache
def _hf_model(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # compare fixed-length outputs (ignore_eos)
    return model.eval()


@cache
def _hf_greedy_one(model_dir: str, prompt: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    import torch

    out = _hf_model(model_dir).generate(torch.tensor([list(prompt)]), max_new_tokens=max_new_tokens,
                                        do_sample=False, pad_token_id=0)
    return tuple(out[0, len(prompt):].tolist())


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers greedy output, one prompt at a time (no padding effects)."""
    return [list(_hf_greedy_one(model_dir, tuple(p), max_new_tokens)) for p in prompts]


@contextmanager
def host_sampler() -> Iterator[None]:
    """One-pass steps sample on the host (`Sampler`), as every step did before steps of decodes
    sampled on the device (`ModelRunner._decodes_sampled_on_device`): the reference for them."""
    from tandem.workers.runner.model_runner import ModelRunner

    with mock.patch.object(ModelRunner, "_decodes_sampled_on_device", lambda self, out, inputs: False):
        yield


def hf_logits(model_dir: str, token_ids: list[int]):
    import torch

    with torch.no_grad():
        return _hf_model(model_dir)(torch.tensor([token_ids])).logits[0]


@pytest.fixture(scope="session")
def llama_dir() -> str:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def shared_ray(request):
    """A local Ray (logical CPUs) shared with the next module that requests it too (tests/shared_ray.py).
    The Serve modules (tests/serve) share its Serve as well; any other module gets it without Serve."""
    from tests import shared_ray as instance

    ray = instance.acquire(keep_serve=request.module.__name__.startswith("tests.serve."))
    yield ray
    instance.settle(request.module.__name__)


# Test modules with a test on the shared local Ray (filled at collection).
_SHARED_RAY_MODULES: set[str] = set()


# The suite runs on two workers (`-n 2 --dist loadgroup`, pytest-xdist; README.md). Whatever
# starts a Ray (a local one, a Cluster, `ray start` nodes) or a server process runs in a Ray lane,
# one test after another in collection order: the shared Ray's hand-over (tests/shared_ray.py)
# assumes one module after another. Those are the slow tests of these folders (but those marked
# `no_ray`) and every test marked `ray`. There are two Ray lanes, one per worker, so that two Rays
# run at once: tests/distributed and tests/serve in one, whole servers and clusters (tests/bench,
# tests/deploy) in the other. Every process's Ray gives its ingress replicas a window of ports of
# their own (`use_proxy`, cluster/direct_ingress.py); the rest runs on whichever worker is free.
RAY_DIRS = ("distributed", "serve", "deploy")
RAY_LANE = "ray"
SERVER_LANE = "ray-servers"
SERVER_DIRS = ("bench", "deploy")


def _lane(item) -> str | None:
    """The Ray lane of a test (None: it starts neither a Ray nor a server)."""
    if not _in_ray_lane(item):
        return None
    parts = item.path.relative_to(item.config.rootpath).parts
    return SERVER_LANE if len(parts) > 2 and parts[1] in SERVER_DIRS else RAY_LANE


def _in_ray_lane(item) -> bool:
    if item.get_closest_marker("ray") is not None:
        return True
    parts = item.path.relative_to(item.config.rootpath).parts
    return item.get_closest_marker("slow") is not None and item.get_closest_marker("no_ray") is None \
        and len(parts) > 2 and parts[1] in RAY_DIRS


@pytest.hookimpl(tryfirst=True)  # before xdist reads the lanes (its own hook, `--dist loadgroup`)
def pytest_collection_modifyitems(config, items):
    """The Ray lanes come first, each in collection order but for the modules on the shared
    local Ray, which run last in theirs, one after another, so that one Ray serves them all
    (tests/shared_ray.py); every other module keeps its order.

    A test on the shared Ray must be marked slow: the fast loop (-m "not slow") starts no Ray,
    and stays fast because nothing can slip into it that does.

    Under `-n 2 --dist loadgroup` (the suite's command) each worker starts with one Ray lane
    (`_lane`): xdist hands out work in the order of the tests, and a worker does not take more
    while it has more than two tests to run. Whichever finishes its lane first takes the other
    tests, and the other worker joins it when its lane is done."""
    unmarked = [item.nodeid for item in items
                if "shared_ray" in item.fixturenames and item.get_closest_marker("slow") is None]
    if unmarked:
        raise pytest.UsageError("tests on the shared Ray must be marked slow: " + ", ".join(unmarked))
    _SHARED_RAY_MODULES.update(item.module.__name__ for item in items if "shared_ray" in item.fixturenames)
    items[:] = ([item for item in items if item.module.__name__ not in _SHARED_RAY_MODULES]
                + [item for item in items if item.module.__name__ in _SHARED_RAY_MODULES])
    lanes: dict[str, str | None] = {}
    for item in items:
        if item.get_closest_marker("no_ray") is not None and (
                item.get_closest_marker("ray") is not None or "shared_ray" in item.fixturenames):
            raise pytest.UsageError(f"a test on Ray cannot be marked no_ray: {item.nodeid}")
        lane = lanes[item.nodeid] = _lane(item)
        if lane is not None:
            if item.get_closest_marker("slow") is None:
                raise pytest.UsageError(f"a test that starts Ray or a server must be marked slow: {item.nodeid}")
            item.add_marker(pytest.mark.xdist_group(lane))
    items[:] = ([item for item in items if lanes[item.nodeid] == RAY_LANE]
                + [item for item in items if lanes[item.nodeid] == SERVER_LANE]
                + [item for item in items if lanes[item.nodeid] is None])


# Tests of a Ray lane that pytest-xdist could not put in it (see pytest_collection_finish).
_OUT_OF_LANE: set[str] = set()


def pytest_collection_finish(session):
    """The Ray lanes hold only where xdist could put each test's lane into its id (`@ray`):
    pytest 9.2 took that away from pytest-xdist 3.8 (hence the pin). Where it is lost again,
    the lanes' tests fail at once, saying why, rather than run two Rays of a lane at once."""
    if getattr(session.config.option, "loadgroup", False):  # set on xdist's workers only
        _OUT_OF_LANE.update(item.nodeid for item in session.items
                            if (lane := _lane(item)) is not None and not item.nodeid.endswith(f"@{lane}"))


@pytest.hookimpl(tryfirst=True)  # before its fixtures start a Ray
def pytest_runtest_setup(item):
    if item.nodeid in _OUT_OF_LANE:
        pytest.fail(f"pytest-xdist could not put this test in its Ray lane (pytest {pytest.__version__}, "
                    f"--dist loadgroup): two Rays of a lane would run at once. Run it with -n 0.", pytrace=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Before a module with no test on the shared Ray, no shared Ray is left running: it may
    start its own, or a Cluster, or need none at all."""
    yield
    if nextitem is None or (nextitem.module is not item.module
                            and nextitem.module.__name__ not in _SHARED_RAY_MODULES):
        from tests import shared_ray as instance

        instance.release()
