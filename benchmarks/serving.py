"""Served throughput and latency over the OpenAI-compatible HTTP API, as a user's client sees them.

Streaming chat requests (temperature 0, `max_tokens` each with `ignore_eos`, so every answer has
the same length) go to the app, which this program starts itself (`deployments:build_app` with
the `--app-arg key=value` arguments, in a child process on a fresh local Ray), or to a running
server at `--url`. The load is a closed loop (C clients, each sending its next request when the
last has finished) or, with `--rate`, an open loop (Poisson arrivals, at most C in flight), at
each concurrency C of `--concurrency`. Per request, from the client's clock:
TTFT = first content chunk - send, TPOT = (last content chunk - first) / (output tokens - 1);
output tokens come from the stream's final `usage`. Output tok/s = tokens / the round's wall time.

`--peer-url URL --peer-model NAME` puts the same load on another OpenAI server (vLLM's) in the
same run, rounds interleaved (ours, peer, ours, peer) so that drift on a shared machine hits both
alike; `--peer-app-arg KEY=VALUE` / `--peer-env NAME=VALUE` instead start a second copy of the app
here, with those arguments or environment (Ray's own switches, say), as the peer: an A/B of two
settings in one run. `--offline` adds the engine's own figure on the same prompts, C and settings
(`faser` in this process, closed loop, no HTTP): ceil(rounds / 2) rounds before the served ones
and as many after them (an app started here has stopped by then), pooled, so that the host's
drift during the served rounds reaches the figure they are held against from both sides; and,
where the app was started here, a round after each served one while the app is up but sent
nothing (`faser offline, app up`): what Ray and Serve, merely running, take from the engine on a
small host, apart from what serving the requests takes. Tables print once all is measured.
`--cpu` prints,
under each level, the cores each process of an app started here used during its rounds (the
engine replica, the ingress, Serve's proxy and controller, Ray's daemons) and the client's own:
where a served figure below the offline one went (benchmarks/cpu.py).

Prompts: Spec-Bench first turns spread over the categories, or random text of a fixed token count
(`--prompts random --input-len 128`, as `vllm bench serve --dataset-name random`). `--turns N`
makes each request a conversation of N: each later turn carries the earlier turns and their
answers, as a chat client sends them (Spec-Bench's questions with N turns), and TTFT is also
printed per turn: what a prefix cache saves a conversation's next turn. Each round's
prompts open with the run's random tag and the round's number, so that a server that caches
prefixes (vLLM does by default) serves no round's prefills from an earlier round's or run's
(`--repeat-prompts` sends the same prompts every round). Usage:
  python -m benchmarks.serving [--concurrency 1,4,16] [--num-requests 48] [--max-tokens 128]
      [--prompts spec-bench|random] [--turns 1] [--rate R] [--rounds 1] [--repeat-prompts]
      [--app-arg policy=off ...]
      [--url http://host:8000] [--peer-url http://host:8001 --peer-model DIR] [--offline]
      [--peer-app-arg KEY=VALUE ...] [--peer-env NAME=VALUE ...] [--cpu] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from benchmarks import cpu
from benchmarks.common import DEFAULT_PROMPTS, REPO, print_table, spec_bench_prompts
from benchmarks.metrics import percentile

OURS, PEER, OFFLINE = "faser", "peer", "faser offline"
OFFLINE_APP_UP = "faser offline, app up"  # the engine here while the app is up but sent nothing
READY_TIMEOUT_S = 900.0  # the first start converts the embedded model and compiles kernels
WARMUP_TOKENS = 8


@dataclass(frozen=True, slots=True)
class Load:
    concurrency: int  # closed loop: clients; open loop: the cap on requests in flight
    rate: float | None = None  # open loop: Poisson arrivals per second; None: closed loop
    seed: int = 0


@dataclass(frozen=True, slots=True)
class RequestRecord:
    server: str
    concurrency: int
    round: int
    index: int
    prompt_tokens: int
    output_tokens: int
    ttft_s: float  # first content chunk - send
    tpot_s: float  # (last content chunk - first) / (output tokens - 1); 0 for one token
    latency_s: float  # end of stream - send
    num_chunks: int  # content chunks: a server may send several tokens in one
    error: str | None = None
    turn: int = 0  # the conversation's turn (0: its first request)
    cached_tokens: int = 0  # prompt tokens the server read from its prefix cache (its usage's)

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True, slots=True)
class Round:
    records: list[RequestRecord]
    wall_s: float  # first send to last end


@dataclass(frozen=True, slots=True)
class Summary:
    server: str
    concurrency: int
    rate: float | None
    num_completed: int
    num_failed: int
    output_tokens: int
    wall_s: float
    output_tokens_per_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p90_s: float
    tpot_p99_s: float
    mean_ttft_s: float
    mean_tpot_s: float
    ttft_p50_by_turn_s: tuple[float, ...] = ()  # conversations of several turns: per turn


@dataclass(frozen=True, slots=True)
class Target:
    """An OpenAI server under load: its label, base URL (ending in /v1) and model name, the
    root of its process tree when this program started it, and its API key if it wants one."""

    server: str
    base_url: str
    model: str
    pid: int | None = None
    api_key: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        return bearer(self.api_key)


def bearer(api_key: str | None) -> dict[str, str]:
    """The request headers that carry an API key (none without one)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


# ---------------------------------------------------------------- one request over HTTP


Conversation = tuple[str, ...]  # a user's turns, each sent with the answers to those before it


def chat_body(model: str, messages: list[dict], max_tokens: int) -> dict:
    return {
        "model": model, "messages": messages,
        "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
    }


async def send_conversation(client: httpx.AsyncClient, target: Target,
                            conversation: Conversation, max_tokens: int,
                            where: tuple[int, int, int]) -> list[RequestRecord]:
    """A conversation's turns in order, each a streamed chat request that carries the earlier
    turns and their answers (as a chat client sends them); `where` = (concurrency, round,
    index). A failed turn ends the conversation, and its later turns count as failed too.
    Never raises."""
    messages: list[dict] = []
    records: list[RequestRecord] = []
    for turn, text in enumerate(conversation):
        failed = next((r for r in records if not r.ok), None)
        if failed is not None:
            error = f"not sent: turn {failed.turn + 1} failed"
            records.append(_record(target.server, (*where, turn), 0.0, 0.0, [], {}, error))
            continue
        messages.append({"role": "user", "content": text})
        record, answer = await send_chat(client, target, messages, max_tokens, (*where, turn))
        records.append(record)
        messages.append({"role": "assistant", "content": answer})
    return records


async def send_chat(client: httpx.AsyncClient, target: Target, messages: list[dict],
                    max_tokens: int, where: tuple[int, int, int, int]) -> tuple[RequestRecord, str]:
    """One streamed chat request and its answer's text; `where` = (concurrency, round, index,
    turn). Never raises."""
    start = time.perf_counter()
    stamps: list[float] = []
    parts: list[str] = []
    usage: dict = {}
    error = None
    try:
        async with client.stream("POST", f"{target.base_url}/chat/completions",
                                 json=chat_body(target.model, messages, max_tokens),
                                 headers=target.headers) as response:
            if response.status_code != 200:
                body = (await response.aread())[:200]
                raise RuntimeError(f"HTTP {response.status_code}: {body!r}")
            async for line in response.aiter_lines():
                usage = _read_event(line, stamps, parts) or usage
    except Exception as exc:  # a failed request is a figure of the run, not its end
        error = f"{type(exc).__name__}: {exc}"[:300]
    end = time.perf_counter()
    return _record(target.server, where, start, end, stamps, usage, error), "".join(parts)


def _read_event(line: str, stamps: list[float], parts: list[str]) -> dict | None:
    """Appends the arrival time and text of a content chunk; returns the usage where the event
    has one."""
    if not line.startswith("data:") or line == "data: [DONE]":
        return None
    event = json.loads(line[5:])
    if "error" in event:
        raise RuntimeError(f"error event: {str(event['error'])[:200]}")
    content = "".join((c.get("delta") or {}).get("content") or ""
                      for c in event.get("choices") or ())
    if content:
        stamps.append(time.perf_counter())
        parts.append(content)
    return event.get("usage")


def _record(server: str, where: tuple[int, int, int, int], start: float, end: float,
            stamps: list[float], usage: dict, error: str | None) -> RequestRecord:
    concurrency, round_no, index, turn = where
    tokens = int(usage.get("completion_tokens") or len(stamps))
    if error is None and not stamps:
        error = "no content in the stream"
    first = stamps[0] - start if stamps else 0.0
    tpot = (stamps[-1] - stamps[0]) / (tokens - 1) if stamps and tokens > 1 else 0.0
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return RequestRecord(server, concurrency, round_no, index,
                         int(usage.get("prompt_tokens") or 0), tokens, first, tpot, end - start,
                         len(stamps), error, turn, cached)


# ---------------------------------------------------------------- closed and open loops

Send = Callable[[int, Conversation], Awaitable[list[RequestRecord]]]


async def closed_loop(send: Send, conversations: Sequence[Conversation],
                      concurrency: int) -> list[RequestRecord]:
    """C clients share one queue of conversations; each starts its next one when the last
    finished."""
    queue = iter(enumerate(conversations))

    async def client() -> list[RequestRecord]:
        return [r for i, conversation in queue for r in await send(i, conversation)]

    done = await asyncio.gather(*(client() for _ in range(concurrency)))
    return sorted((r for records in done for r in records), key=lambda r: (r.index, r.turn))


async def open_loop(send: Send, conversations: Sequence[Conversation],
                    load: Load) -> list[RequestRecord]:
    """Poisson arrivals of conversations at `load.rate`, at most `load.concurrency` in flight (a
    conversation that arrives at the cap waits for a slot; its TTFT counts from when it is
    sent)."""
    rng = random.Random(load.seed)
    offsets, now = [], 0.0
    for _ in conversations:
        offsets.append(now)
        now += rng.expovariate(load.rate)
    slots = asyncio.Semaphore(load.concurrency)

    async def arrive(i: int, conversation: Conversation) -> list[RequestRecord]:
        await asyncio.sleep(offsets[i])
        async with slots:
            return await send(i, conversation)

    done = await asyncio.gather(*(arrive(i, c) for i, c in enumerate(conversations)))
    return [r for records in done for r in records]


async def drive(target: Target, conversations: Sequence[Conversation], load: Load,
                max_tokens: int, round_no: int = 0) -> Round:
    """One round: every conversation once, under `load`, against `target`."""
    limits = httpx.Limits(max_connections=load.concurrency + 4, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=limits) as client:

        def send(i: int, conversation: Conversation) -> Awaitable[list[RequestRecord]]:
            where = (load.concurrency, round_no, i)
            return send_conversation(client, target, conversation, max_tokens, where)

        start = time.perf_counter()
        if load.rate is None:
            records = await closed_loop(send, conversations, load.concurrency)
        else:
            records = await open_loop(send, conversations, load)
        return Round(records, time.perf_counter() - start)


# ---------------------------------------------------------------- figures


def summarise(server: str, load: Load, rounds: Sequence[Round]) -> Summary:
    """Requests pooled over a server's rounds at one load level."""
    records = [r for rnd in rounds for r in rnd.records]
    ok = [r for r in records if r.ok]
    ttft = [r.ttft_s for r in ok]
    tpot = [r.tpot_s for r in ok if r.output_tokens > 1]
    tokens = sum(r.output_tokens for r in ok)
    wall = sum(rnd.wall_s for rnd in rounds)
    return Summary(
        server, load.concurrency, load.rate, len(ok), len(records) - len(ok), tokens, wall,
        tokens / wall if wall > 0 else 0.0,
        *(percentile(ttft, q) for q in (50, 90, 99)), *(percentile(tpot, q) for q in (50, 90, 99)),
        _mean(ttft), _mean(tpot), _ttft_by_turn(ok),
    )


def _ttft_by_turn(records: Sequence[RequestRecord]) -> tuple[float, ...]:
    """TTFT p50 of each turn, where the requests had several; () where every one was a first."""
    turns = max((r.turn for r in records), default=0) + 1
    if turns == 1:
        return ()
    return tuple(percentile([r.ttft_s for r in records if r.turn == t], 50) for t in range(turns))


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def print_level(summaries: Sequence[Summary], load: Load, max_tokens: int) -> None:
    by_server = {s.server: s for s in summaries}
    ours = by_server.get(OURS)
    rows = [[s.server, s.num_completed, s.num_failed, s.output_tokens_per_s,
             *(_ratio(s, by_server.get(other)) for other in (PEER, OFFLINE)),
             s.ttft_p50_s, s.ttft_p90_s, s.ttft_p99_s,
             s.tpot_p50_s * 1e3, s.tpot_p90_s * 1e3, s.tpot_p99_s * 1e3] for s in summaries]
    loop = f"open loop at {load.rate}/s, <= {load.concurrency}" if load.rate else "closed loop"
    title = f"C = {load.concurrency} ({loop}, {max_tokens} tokens each)"
    if ours is not None and PEER in by_server and by_server[PEER].ttft_p50_s > 0:
        title += f"; TTFT p50 {ours.ttft_p50_s / by_server[PEER].ttft_p50_s:.2f}x the peer's"
    print_table(title, ["server", "done", "failed", "tok/s", "x peer", "x offline",
                        "TTFT p50 s", "p90 s", "p99 s", "TPOT p50 ms", "p90 ms", "p99 ms"], rows)
    for s in summaries:
        if s.ttft_p50_by_turn_s:
            turns = ", ".join(f"{t + 1}: {v:.3f}" for t, v in enumerate(s.ttft_p50_by_turn_s))
            print(f"{s.server}: TTFT p50 s by turn: {turns}")
    sys.stdout.flush()  # each table at once, also into a file


def _ratio(summary: Summary, other: Summary | None) -> float | str:
    if other is None or other is summary or other.output_tokens_per_s <= 0:
        return "-"
    return summary.output_tokens_per_s / other.output_tokens_per_s


# ---------------------------------------------------------------- prompts


def spec_bench_texts(path: Path, num: int) -> list[str]:
    """First turns of Spec-Bench questions spread over the categories, cycled to `num`."""
    texts = [str(row["turns"][0]) for row in spec_bench_prompts(path, num)]
    return [texts[i % len(texts)] for i in range(num)]


def spec_bench_conversations(path: Path, num: int, turns: int) -> list[Conversation]:
    """`num` conversations of `turns` turns: Spec-Bench's first turns, one each, where `turns`
    is 1; else its questions of that many turns (MT-Bench's follow-ups, as "Rewrite your
    previous response..."), cycled."""
    if turns == 1:
        return [(text,) for text in spec_bench_texts(path, num)]
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    found = [tuple(str(t) for t in row["turns"][:turns]) for row in rows
             if len(row["turns"]) >= turns]
    if not found:
        raise SystemExit(f"--turns {turns}: {path} has no question with that many turns")
    return [found[i % len(found)] for i in range(num)]


def random_texts(tokenizer, num: int, input_len: int, seed: int = 0) -> list[str]:
    """Text of `input_len` random tokens each (before the chat template), as vLLM's random
    dataset: random ids decoded, re-encoded and topped up until the text encodes to that count."""
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    pool = [i for i in range(len(tokenizer)) if i not in special]
    return [_random_text(tokenizer, rng, pool, input_len) for _ in range(num)]


def _random_text(tokenizer, rng: random.Random, pool: list[int], length: int) -> str:
    ids = [rng.choice(pool) for _ in range(length)]
    for _ in range(8):
        ids = tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False)
        if len(ids) == length:
            break
        ids = ids[:length] + [rng.choice(pool) for _ in range(length - len(ids))]
    return tokenizer.decode(ids)


def render_chat(tokenizer, text: str) -> list[int]:
    """The prompt's token ids as the server renders a one-message chat (deployments/serving.py)."""
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer.encode(rendered, add_special_tokens=False))


def load_tokenizer(args: argparse.Namespace, app_args: dict):
    from transformers import AutoTokenizer

    from faser.engine.model_pair import resolve

    return AutoTokenizer.from_pretrained(args.tokenizer or resolve(app_args.get("model"), "target"))


def round_texts(texts: Sequence[str], tag: str, round_no: int) -> list[str]:
    """The prompts of round `round_no` of the run `tag`, each opening with both, the round first:
    a server that caches prefixes (vLLM does by default, and the engine) would otherwise prefill
    a repeated prompt only the first time, and its later rounds (or runs) would measure the
    cache, not the server."""
    return [f"({round_no + 1}-{tag}) {text}" for text in texts]


def round_conversations(conversations: Sequence[Conversation], tag: str,
                        round_no: int) -> list[Conversation]:
    """`round_texts` on each conversation's first turn: its later requests carry it."""
    firsts = round_texts([c[0] for c in conversations], tag, round_no)
    return [(first, *c[1:]) for first, c in zip(firsts, conversations, strict=True)]


def load_conversations(args: argparse.Namespace, app_args: dict) -> list[Conversation]:
    if args.prompts == "random":
        texts = random_texts(load_tokenizer(args, app_args), args.num_requests * args.turns,
                             args.input_len, args.seed)
        return [tuple(texts[i : i + args.turns]) for i in range(0, len(texts), args.turns)]
    return spec_bench_conversations(args.prompt_file, args.num_requests, args.turns)


# ---------------------------------------------------------------- the engine offline


class Offline:
    """The engine with the app's settings (AppArgs.engine_config) in this process, closed loop at
    each C over the same prompts: the figure the served path is held against. Each round's
    prompts open with the run's `tag` and the round's own mark (none when `tag` is None), as the
    served rounds' do, since the engine caches prefixes too. `run` adds rounds under a label
    (OFFLINE, or OFFLINE_APP_UP for those run while an app is up); `summaries` pools every round
    of a label so far, level by level."""

    def __init__(self, app_args: dict, texts: Sequence[str], max_tokens: int,
                 tag: str | None) -> None:
        from benchmarks.driver import RunSpec, run_closed
        from deployments.args import AppArgs
        from faser.engine.llm_engine import LLMEngine

        self.engine = LLMEngine(AppArgs.model_validate(app_args).engine_config())
        self.texts, self.max_tokens, self.tag = list(texts), max_tokens, tag
        warmup = self._requests(["Hello!"], WARMUP_TOKENS)
        run_closed(self.engine, warmup, 1, RunSpec("warmup", {}, ignore_eos=True))
        self.rounds: dict[tuple[str, int], list[Round]] = {}

    def _requests(self, texts: Sequence[str], max_tokens: int) -> list:
        from benchmarks.workload import BenchRequest

        return [BenchRequest(tuple(render_chat(self.engine.tokenizer, t)), max_tokens)
                for t in texts]

    def run(self, loads: Sequence[Load], num_rounds: int, label: str = OFFLINE) -> None:
        from benchmarks.driver import RunSpec, run_closed

        mark = "offline" if label == OFFLINE else "offline-app-up"
        for _ in range(num_rounds):
            for load in loads:
                c = load.concurrency
                done = self.rounds.setdefault((label, c), [])
                texts = self.texts if self.tag is None else \
                    round_texts(self.texts, f"{self.tag}-{mark}", len(done))
                cpu.wait_until_idle()
                result = run_closed(self.engine, self._requests(texts, self.max_tokens), c,
                                    RunSpec(f"{mark}-{c}", {}, ignore_eos=True))
                records = [_offline_record(out, label, c, i)
                           for i, out in enumerate(result.outputs)]
                done.append(Round(records, result.wall_s))

    def summaries(self, label: str = OFFLINE) -> dict[int, Summary]:
        return {c: summarise(label, Load(c), rounds)
                for (name, c), rounds in self.rounds.items() if name == label}


def _offline_record(out, label: str, concurrency: int, index: int) -> RequestRecord:
    from benchmarks.metrics import request_times

    times = request_times(out)
    return RequestRecord(label, concurrency, 0, index, len(out.prompt_token_ids),
                         len(out.token_ids), times.ttft_s, times.tpot_s, times.latency_s,
                         len(out.token_ids))


# ---------------------------------------------------------------- the app in a child process


def serve_forever(port: int, app_args_json: str) -> None:
    """The child: a fresh local Ray (never a cluster someone else started), Serve on `port`, and
    `deployments:build_app` with the arguments, until SIGTERM shuts Serve and Ray down."""
    import ray
    from ray import serve

    from deployments import build_app

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False,
             log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(json.loads(app_args_json)), blocking=False)
        print("READY", flush=True)
        while True:
            time.sleep(3600)
    finally:
        serve.shutdown()
        ray.shutdown()


class ServedApp:
    """`with ServedApp(app_args) as url:` the app, started in its own process group, stopped
    (and its Ray with it) on leaving."""

    def __init__(self, app_args: dict, env: dict[str, str] | None = None) -> None:
        self.app_args = app_args
        self.env = env or {}
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(tempfile.mkstemp(prefix="faser-serving-", suffix=".log")[1])
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> str:
        code = (f"from benchmarks.serving import serve_forever; "
                f"serve_forever({self.port}, {json.dumps(json.dumps(self.app_args))})")
        env = {**os.environ, "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", **self.env}
        env.pop("RAY_ADDRESS", None)
        with self.log.open("w") as log:
            self.process = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env,
                                            stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__()
            raise
        return self.url

    def __exit__(self, *_: object) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=120)
        # what Ray leaves behind in the child's own process group (its agents outlive
        # ray.shutdown() and ignore SIGTERM); nothing else is in that group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the app exited ({self.process.returncode}):\n{self._tail()}")
            if "READY" in self.log.read_text(errors="replace") and _models(self.url):
                return
            time.sleep(2.0)
        raise TimeoutError(f"the app was not up in {READY_TIMEOUT_S:.0f} s:\n{self._tail()}")

    def _tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    @property
    def pid(self) -> int | None:
        """The app's root process (its Ray and replicas descend from it), once started."""
        return self.process.pid if self.process is not None else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _models(url: str, api_key: str | None = None) -> list[str]:
    """The model names a server lists; none while it is not up."""
    try:
        response = httpx.get(f"{api_base(url)}/models", timeout=10.0, headers=bearer(api_key))
    except httpx.HTTPError:
        return []
    if response.status_code == 401:
        raise RuntimeError(f"{url} wants an API key it was not given (HTTP 401)")
    try:
        return [m["id"] for m in response.json()["data"]] if response.status_code == 200 else []
    except (ValueError, KeyError):
        return []


def api_base(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/v1") else f"{url}/v1"


def make_target(server: str, url: str, model: str | None, pid: int | None = None,
                api_key: str | None = None) -> Target:
    names = [model] if model else _models(url, api_key)
    if not names:
        raise RuntimeError(f"{server}: no model listed at {api_base(url)}/models")
    return Target(server, api_base(url), names[0], pid, api_key)


def warm_up(target: Target) -> None:
    load = Load(1)
    done = asyncio.run(drive(target, ["Hello!"], load, WARMUP_TOKENS, round_no=-1))
    if not done.records[0].ok:
        raise RuntimeError(f"{target.server}: warm-up request failed: {done.records[0].error}")


# ---------------------------------------------------------------- the run


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--url", default=None, help="a running server; default: start the app here")
    ap.add_argument("--app-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="an argument of deployments:build_app (deployments/args.py); also the "
                         "settings of --offline and whose tokenizer --prompts random uses")
    ap.add_argument("--model-name", default=None, help="default: the first of /v1/models")
    ap.add_argument("--peer-url", default=None, help="another OpenAI server under the same load")
    ap.add_argument("--peer-model", default=None, help="default: the first of its /v1/models")
    ap.add_argument("--api-key", default=None, help="--url's API key, if it wants one")
    ap.add_argument("--peer-api-key", default=None, help="--peer-url's API key")
    ap.add_argument("--peer-app-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="start a second app here as the peer, with these arguments")
    ap.add_argument("--peer-env", action="append", default=[], metavar="NAME=VALUE",
                    help="start a second app here as the peer, with this environment")
    ap.add_argument("--offline", action="store_true",
                    help="the engine's own figure, same prompts, C and settings (no HTTP)")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--rate", type=float, default=None,
                    help="open loop: Poisson arrivals per second (C caps those in flight)")
    ap.add_argument("--num-requests", type=int, default=48, help="per round and level")
    ap.add_argument("--rounds", type=int, default=1, help="rounds per server and level")
    ap.add_argument("--repeat-prompts", action="store_true",
                    help="send every round the same prompts (a server's prefix cache then "
                         "serves later rounds' prefills); default: each round's are its own")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--turns", type=int, default=1,
                    help="turns per conversation: each later request carries the earlier turns "
                         "and their answers (spec-bench: its questions with that many turns)")
    ap.add_argument("--prompts", choices=("spec-bench", "random"), default="spec-bench")
    ap.add_argument("--prompt-file", type=Path, default=DEFAULT_PROMPTS)
    ap.add_argument("--input-len", type=int, default=128, help="--prompts random: tokens each")
    ap.add_argument("--tokenizer", default=None, help="default: the app's target model's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu", action="store_true",
                    help="print the CPU each process of an app started here used during its "
                         "rounds (from /proc; the client's too)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.turns < 1:
        ap.error(f"--turns must be >= 1, got {args.turns}")
    if args.turns > 1 and args.offline:
        ap.error("--offline measures one-turn requests: leave out --turns")
    # this run's own mark on its prompts: a peer that stays up between runs keeps their prefixes
    args.prompt_tag = None if args.repeat_prompts else secrets.token_hex(3)
    return args


def parse_app_args(pairs: Sequence[str]) -> dict[str, str]:
    """`key=value` pairs as `serve run deployments:build_app key=value` takes them, checked."""
    from deployments.args import AppArgs

    app_args = parse_pairs(pairs, "--app-arg")
    AppArgs.model_validate(app_args)
    return app_args


def parse_pairs(pairs: Sequence[str], option: str) -> dict[str, str]:
    bad = [p for p in pairs if "=" not in p]
    if bad:
        raise SystemExit(f"{option} takes KEY=VALUE, got {bad}")
    return dict(p.split("=", 1) for p in pairs)


def host_cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    import platform

    return platform.processor() or "unknown CPU"


def settings(args: argparse.Namespace, app_args: dict) -> dict:
    from deployments.args import AppArgs
    from faser.runner.precision import resolve_dtype

    app = AppArgs.model_validate(app_args)
    return {
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "host_cpu": host_cpu(), "num_cpus": os.cpu_count(),
        "server": args.url or "deployments:build_app, started here",
        "app_args": app_args, "policy": app.policy,
        "dtype": resolve_dtype(app.dtype, app.device), "engine_threads": app.threads_per_replica,
        "prompts": args.prompts if args.prompts == "spec-bench" else f"random {args.input_len}",
        "num_requests": args.num_requests, "turns": args.turns, "max_tokens": args.max_tokens,
        "concurrency": args.concurrency, "rate": args.rate, "rounds": args.rounds,
        "peer_url": args.peer_url, "offline": args.offline,
        "prompt_tag": args.prompt_tag,
        "peer_app_args": parse_pairs(args.peer_app_arg, "--peer-app-arg"),
        "peer_env": parse_pairs(args.peer_env, "--peer-env"),
    }


def print_header(run: dict) -> None:
    loop = f"open loop, Poisson {run['rate']}/s" if run["rate"] else "closed loop"
    print(f"Serving benchmark, {run['date_utc']} UTC")
    print(f"host: {run['host_cpu']}, {run['num_cpus']} CPUs")
    print(f"server: {run['server']}; app args {run['app_args'] or '(defaults)'}: policy "
          f"{run['policy']}, {run['dtype']}, {run['engine_threads']} engine thread(s)")
    requests = f"{run['num_requests']} streamed chat requests"
    if run["turns"] > 1:
        requests = (f"{run['num_requests']} conversations of {run['turns']} streamed chat "
                    "requests (each later one carrying the earlier turns and their answers)")
    print(f"load: {run['prompts']} prompts, {requests} per "
          f"round, {run['max_tokens']} tokens each (temperature 0, ignore_eos), C = "
          f"{run['concurrency']}, {loop}, {run['rounds']} round(s) per server, "
          + ("the same prompts every round" if run["prompt_tag"] is None
             else f"each round's prompts opening with (ROUND-{run['prompt_tag']}), so that no "
                  "prefix cache spans rounds or runs"))
    if run["peer_url"]:
        print(f"peer: {run['peer_url']}, rounds interleaved with ours")
    elif run["peer_app_args"] or run["peer_env"]:
        print(f"peer: the app started here too, app args {run['peer_app_args'] or '(ours)'}, "
              f"environment {run['peer_env'] or '(ours)'}, rounds interleaved with ours")
    if run["offline"]:
        print("offline: the engine with the app's settings in this process, closed loop; "
              f"'{OFFLINE}' with no app up, '{OFFLINE_APP_UP}' in a round after each served "
              "one while the servers are up and sent nothing (not with --url)")
    sys.stdout.flush()


def measure(targets: Sequence[Target], conversations: Sequence[Conversation],
            loads: Sequence[Load], args: argparse.Namespace,
            offline: Offline | None = None) -> tuple[list, list, list]:
    """Every level in turn; within one, the servers take turns round by round, and `offline`
    (the engine here) runs a round after theirs while the servers are up and sent nothing: what the
    cluster's mere presence costs the engine on a small host. Returns each level's summaries,
    every request's record and, with `--cpu`, the CPU each process of an app started here used
    during its rounds (and this program's own, the client's), level by level."""
    levels: list[list[Summary]] = []
    records: list[RequestRecord] = []
    cpu_use: list[dict] = []
    for load in loads:
        rounds: dict[str, list[Round]] = {t.server: [] for t in targets}
        use = {t.server: cpu.CpuUse() for t in targets if args.cpu and t.pid is not None}
        for round_no in range(args.rounds):
            sent = conversations if args.prompt_tag is None else \
                round_conversations(conversations, args.prompt_tag, round_no)
            for target in targets:
                cpu.wait_until_idle()  # the server before this round may still be spinning
                watch = use.get(target.server)
                before = watch.start(target.pid) if watch is not None else None
                done = asyncio.run(drive(target, sent, load, args.max_tokens, round_no))
                if watch is not None:
                    watch.stop(target.pid, before)
                rounds[target.server].append(done)
                records += done.records
            if offline is not None:
                offline.run([load], 1, OFFLINE_APP_UP)
        levels.append([summarise(t.server, load, rounds[t.server]) for t in targets])
        cpu_use += [{"server": server, "concurrency": load.concurrency, "cores": watch.cores()}
                    for server, watch in use.items()]
    return levels, records, cpu_use


def report(levels: Sequence[list[Summary]], loads: Sequence[Load], cpu_use: Sequence[dict],
           offline: dict[int, list[Summary]], max_tokens: int) -> list[Summary]:
    """Prints each level's table (with the offline figure when measured) and the CPU lines under
    it; returns every summary, level by level."""
    summaries: list[Summary] = []
    for load, level in zip(loads, levels, strict=True):
        level = [*level, *offline.get(load.concurrency, [])]
        print_level(level, load, max_tokens)
        for use in cpu_use:
            if use["concurrency"] == load.concurrency:
                print_cpu(use["server"], use["cores"])
        summaries += level
    return summaries


def print_cpu(server: str, cores: dict[str, float], shown: int = 8) -> None:
    """One line: the processes that used the most, in cores, and all of them together."""
    parts = [f"{name} {used:.2f}" for name, used in list(cores.items())[:shown]]
    rest = sum(list(cores.values())[shown:])
    if rest > 0:
        parts.append(f"others {rest:.2f}")
    print(f"CPU during {server}'s rounds, cores of {os.cpu_count()}: {', '.join(parts)}; "
          f"all {sum(cores.values()):.2f}")



def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    app_args = parse_app_args(args.app_arg)
    loads = [Load(int(c), args.rate, args.seed) for c in args.concurrency.split(",")]
    run = settings(args, app_args)
    print_header(run)
    conversations = load_conversations(args, app_args)
    offline = None
    if args.offline:
        offline = Offline(app_args, [c[0] for c in conversations], args.max_tokens,
                          args.prompt_tag)
    half = max(1, math.ceil(args.rounds / 2))
    if offline is not None:
        offline.run(loads, half)
    with contextlib.ExitStack() as stack:
        ours = None if args.url else ServedApp(app_args)
        url = args.url or stack.enter_context(ours)
        targets = [make_target(OURS, url, args.model_name, ours and ours.pid, args.api_key)]
        peer_url, peer = args.peer_url, None
        if peer_url is None and (run["peer_app_args"] or run["peer_env"]):
            peer_args = {**app_args, **parse_app_args(args.peer_app_arg)}
            peer = ServedApp(peer_args, run["peer_env"])
            peer_url = stack.enter_context(peer)
        if peer_url:
            targets.append(make_target(PEER, peer_url, args.peer_model, peer and peer.pid,
                                       args.peer_api_key))
        for target in targets:
            warm_up(target)
        beside = offline if args.url is None else None  # a server elsewhere is not "the app"
        levels, records, cpu_use = measure(targets, conversations, loads, args, beside)
    if offline is not None:  # the apps started here have stopped
        offline.run(loads, half)
    offline_rows: dict[int, list[Summary]] = {}
    for label in (OFFLINE, OFFLINE_APP_UP) if offline is not None else ():
        for c, summary in offline.summaries(label).items():
            offline_rows.setdefault(c, []).append(summary)
    summaries = report(levels, loads, cpu_use, offline_rows, args.max_tokens)
    out = {"settings": run,
           "summaries": [{**asdict(s), "ttft_p50_by_turn_s": list(s.ttft_p50_by_turn_s)}
                         for s in summaries],
           "requests": [asdict(r) for r in records]}
    if args.cpu:
        out["cpu"] = cpu_use
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
