import os
import sys
from pathlib import Path

import pytest

# tests.fixtures must import however pytest is started (`pytest` or `python -m pytest`)
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.fixtures.local_app import local_openai_app  # noqa: E402
from tests.fixtures.tiny_models import make_tiny_pair  # noqa: E402

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
# A router skips a replica that misses Ray's queue-length probe deadline (0.1 s) and takes the
# next in its order: on two cores busy with replicas, proxy and test, an idle replica can miss it,
# which would test the host's scheduling instead of the routing policy. The workers inherit it.
os.environ.setdefault("RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S", "1.0")


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    return make_tiny_pair(tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture(scope="session")
def ray_serve():
    """One local Ray cluster and Serve instance for every Ray test module; each module deploys
    its own app under its own route prefix and deletes it when done. Yields the HTTP base URL."""
    import socket

    import ray
    from ray import serve

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def local_app(tiny_pair):
    """The OpenAI app over an engine in this process (LocalEngineClient, no Ray), served as
    model "tiny"; drive it with fastapi's TestClient (an httpx client, so the openai client
    takes it as its http_client)."""
    yield from local_openai_app(tiny_pair)



@pytest.fixture(scope="module")
def http(local_app):
    """fastapi's TestClient over `local_app`."""
    from fastapi.testclient import TestClient

    with TestClient(local_app) as client:
        yield client


@pytest.fixture(scope="module")
def client(http):
    """The official openai client over `http`."""
    import openai

    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http,
                         max_retries=0)
