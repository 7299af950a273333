"""Nothing lost when an engine replica dies, on a real local Ray: `kill -9` of the replica serving
eight greedy streams, mid-stream, and every stream (and a non-streamed request beside them)
completes with the answer an undisturbed run gives, through the official openai client. With two
replicas the streams go on on the other one; with one, on the replica Serve restarts."""

import concurrent.futures
import os
import signal
import threading
import time
from dataclasses import dataclass, field

import openai
import pytest
import ray
from ray import serve

from deployments import build_app

pytestmark = pytest.mark.ray

APP = "resume"
MODEL = "tiny"
NUM_STREAMS = 8
MAX_TOKENS = 400  # long enough that the kill, once every stream has begun, lands mid-stream
PROMPTS = [f"{word} {i}" for i, word in enumerate(
    ["Hello", "The quick", "One two", "Ray Serve", "def add", "Speculative", "world", "fox"])]
WAIT_S = 60  # for every stream's first chunk
STARTED_ON: list[str] = []  # the replica of each stream, in the order their first chunks came
KILLED: dict = {}  # the replica killed and when


@pytest.fixture(scope="module", params=[2, 1], ids=["two-replicas", "one-replica"])
def client(request, ray_serve, tiny_pair):
    target, draft = tiny_pair
    app = build_app({
        "model": str(target), "draft_model": str(draft), "served_model_name": MODEL,
        "policy": "off", "max_model_len": 512, "num_kv_blocks": 320,
        "max_num_seqs": NUM_STREAMS + 1, "max_ongoing_requests": NUM_STREAMS + 1,
        "max_queued_requests": 4 * NUM_STREAMS, "num_replicas": request.param,
        "num_cpus": 0.5, "torch_threads": 1,
    })
    serve.run(app, name=APP, route_prefix=f"/{APP}")
    yield openai.OpenAI(base_url=f"{ray_serve}/{APP}/v1", api_key="none", max_retries=0,
                        timeout=120)
    serve.delete(APP)


@dataclass
class Streamed:
    replica: str = ""
    text: str = ""
    ids: set[str] = field(default_factory=set)
    finish_reason: str | None = None
    usage: tuple[int, int] = (0, 0)
    chunk_times: list[float] = field(default_factory=list)
    text_chunks: list[tuple[float, int]] = field(default_factory=list)  # (time, characters)

    @property
    def max_gap_s(self) -> float:
        times = self.chunk_times
        return max((b - a for a, b in zip(times, times[1:], strict=False)), default=0.0)


def stream(client: openai.OpenAI, prompt: str, started: threading.Semaphore | None) -> Streamed:
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    out = Streamed(replica=raw.headers["x-faser-replica"])
    for chunk in raw.parse():
        out.chunk_times.append(time.monotonic())
        out.ids.add(chunk.id)
        if chunk.usage is not None:
            out.usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
        if not chunk.choices:
            continue
        out.text += chunk.choices[0].text
        out.text_chunks.append((out.chunk_times[-1], len(chunk.choices[0].text)))
        out.finish_reason = chunk.choices[0].finish_reason or out.finish_reason
        if started is not None and len(out.chunk_times) == 1:
            STARTED_ON.append(out.replica)
            started.release()  # and go on reading: chunk times are when the chunks came
    return out


def complete(client: openai.OpenAI, prompt: str) -> tuple[str, tuple[int, int]]:
    done = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True},
    )
    return done.choices[0].text, (done.usage.prompt_tokens, done.usage.completion_tokens)


def run_streams(client: openai.OpenAI, started: threading.Semaphore | None = None) -> tuple:
    """The eight streams, and one non-streamed request for the first prompt beside them."""
    with concurrent.futures.ThreadPoolExecutor(NUM_STREAMS + 1) as pool:
        whole = pool.submit(complete, client, PROMPTS[0])
        futures = [pool.submit(stream, client, prompt, started) for prompt in PROMPTS]
        if started is not None:
            pids = replica_pids()  # looked up first: the kill itself takes no time
            for _ in PROMPTS:  # every stream has its first chunk: now the replica dies
                assert started.acquire(timeout=WAIT_S), "a stream never began"
            os.kill(pids[STARTED_ON[0]], signal.SIGKILL)
            KILLED.update(replica=STARTED_ON[0], at=time.monotonic())
        return [f.result() for f in futures], whole.result()


def replica_pids() -> dict[str, int]:
    """The worker pid of each live engine replica, by replica id (Ray's actor table has them)."""
    prefix = f"SERVE_REPLICA::{APP}#FaserEngine#"
    return {
        a["Name"].removeprefix(prefix): a["Pid"] for a in ray._private.state.actors().values()
        if a["Name"].startswith(prefix) and a["State"] == "ALIVE"
    }


def test_replicas_report_how_many_the_cluster_holds(client):
    """max_replicas="auto" (the default): 2 CPUs hold 4 replicas of half a CPU each."""
    handle = serve.get_deployment_handle("FaserEngine", app_name=APP)
    assert handle.record_autoscaling_stats.remote().result()["max_replicas"] == 4.0


def test_kill_9_of_the_serving_replica_loses_no_stream(client):
    undisturbed, _ = run_streams(client)
    assert all(s.finish_reason == "length" and s.usage[1] == MAX_TOKENS for s in undisturbed)

    STARTED_ON.clear()
    started = threading.Semaphore(0)
    resumed, whole = run_streams(client, started)
    assert whole == (undisturbed[0].text, undisturbed[0].usage)
    hit = [s for s in resumed if s.replica == KILLED["replica"]]
    assert hit, "no stream was on the killed replica"
    # most of a killed stream's text came after the kill: from the continuation
    after_kill = max(
        sum(n for t, n in s.text_chunks if t > KILLED["at"]) / max(len(s.text), 1) for s in hit
    )
    assert after_kill > 0.5, "the kill came after the streams"
    for before, after in zip(undisturbed, resumed, strict=True):
        assert after.text == before.text
        assert (after.finish_reason, after.usage) == (before.finish_reason, before.usage)
        assert len(after.ids) == 1  # one id for the whole answer, resumed or not
    print(f"\npause on resume: max gap {max(s.max_gap_s for s in hit):.2f} s")
