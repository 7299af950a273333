"""A live Serve app on a real local Ray (tiny models, autoscaling 1 -> 2 replicas with short
delays) under a headless Locust step load; its replicas' metrics read from Ray's own metrics
endpoints and through a real Prometheus that scrapes them from Ray's service-discovery file.

One module-scoped cluster and app; the load runs once (a fixture) and every test reads its
outcome. Slow (a Ray cluster, Serve and Prometheus start); progress is printed (`pytest -s`)."""

from __future__ import annotations

import csv
import json
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from deployments import dashboard
from deployments.metrics import CATALOGUE, MODE, NUM_ACCEPTED_TOKENS, NUM_DRAFTS, exported_names
from loadtest.prometheus import series_points
from tests.observability.prometheus_server import PrometheusServer, free_port, require_prometheus
from tests.observability.promtool import metric_names

pytestmark = [pytest.mark.ray, pytest.mark.slow]

APP = "observed"
MODEL = "tiny"
ENGINE = "FaserEngine"
SD_FILE = "prom_metrics_service_discovery.json"
PROMPTS = ["Tell me about speculative decoding.", "Count from one to ten.",
           "Why is the sky blue?", "Write a short poem about a fox."]


def log(message: str) -> None:
    print(f"[observability {time.strftime('%H:%M:%S')}] {message}", flush=True)


def wait_for(what: str, check, timeout_s: float, period_s: float = 1.0):
    """Polls `check()` until it returns something truthy, printing progress now and then."""
    start = time.monotonic()
    last_note = start
    while True:
        value = check()
        if value:
            log(f"{what}: after {time.monotonic() - start:.0f} s")
            return value
        now = time.monotonic()
        assert now - start < timeout_s, f"timed out after {timeout_s} s waiting for {what}"
        if now - last_note >= 10:
            log(f"waiting for {what} ({now - start:.0f} s)")
            last_note = now
        time.sleep(period_s)


# ---- the Ray side ----------------------------------------------------------------------------


def running_replicas() -> int:
    from ray import serve

    app = serve.status().applications.get(APP)
    if app is None or ENGINE not in app.deployments:
        return 0
    return app.deployments[ENGINE].replica_states.get("RUNNING", 0)


def scrape(sd_file: Path) -> dict[str, float]:
    """Every sample on every target of Ray's SD file: `name{labels}` -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[str, float] = {}
    for group in json.loads(sd_file.read_text()):
        for target in group["targets"]:
            try:
                with urllib.request.urlopen(f"http://{target}/metrics", timeout=10) as answer:
                    text = answer.read().decode()
            except OSError:
                continue  # a target that went away (a stopped worker)
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                    samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


def names(samples: dict[str, float]) -> set[str]:
    return {key.split("{", 1)[0] for key in samples}


def total(samples: dict[str, float], name: str) -> float:
    return sum(v for k, v in samples.items() if k.split("{", 1)[0] == name)


@dataclass
class Live:
    base_url: str
    sd_file: Path
    prometheus: PrometheusServer
    before: dict[str, float] = field(default_factory=dict)


@pytest.fixture(scope="module")
def live(tiny_close_pair, tmp_path_factory):
    import ray
    from ray import serve

    from deployments import build_app

    target, draft = tiny_close_pair
    require_prometheus()  # before Ray starts: a skip past this point would leave Ray running
    port = free_port()
    log("starting Ray (with its dashboard, which writes the Prometheus SD file)")
    ray.init(num_cpus=2, include_dashboard=True, dashboard_port=free_port(),
             log_to_driver=False, _system_config={"metrics_report_interval_ms": 1000})
    # whatever fails from here on, Ray and Serve stop: the serving tests start their own cluster
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = build_app({
            "model": str(target), "draft_model": str(draft), "served_model_name": MODEL,
            # fixed k in two frontiers: a rejection in the first prunes the second
            "policy": "fixed", "max_k": 4, "frontier_size": 2, "max_model_len": 256,
            "num_kv_blocks": 96,
            "max_num_seqs": 2, "max_ongoing_requests": 3, "max_queued_requests": 6,
            "num_cpus": 0.5, "torch_threads": 1, "routing_stats_period_s": 0.2,
            # aggressive autoscaling: two busy requests per replica ask for a second replica
            "num_replicas": "auto", "min_replicas": 1, "max_replicas": 2, "target_load": 0.6,
            "upscale_delay_s": 1.0, "downscale_delay_s": 3.0, "look_back_period_s": 2.0,
            "metrics_interval_s": 0.5,
            # loose targets every request meets: the SLO counters must move too
            "slo_tpot_ms": 60_000, "slo_ttft_ms": 60_000,
        })
        log("deploying the app (tiny models)")
        serve.run(app, name=APP, route_prefix=f"/{APP}")
        session = Path(ray._private.worker.global_worker.node.get_session_dir_path())
        sd_file = wait_for("Ray's SD file",
                           lambda: (session / SD_FILE).is_file() and session / SD_FILE, 60)
        prometheus = PrometheusServer(sd_file, tmp_path_factory.mktemp("prometheus"))
        try:
            prometheus.wait_ready()
            state = Live(f"http://127.0.0.1:{port}/{APP}", sd_file, prometheus)
            # the poller sets the gauges within a second or two of the replica starting
            wait_for("the engine gauges", lambda: MODE.series in names(scrape(sd_file)), 60)
            state.before = scrape(sd_file)
            yield state
        finally:
            prometheus.stop()
            serve.delete(APP)
    finally:
        serve.shutdown()
        ray.shutdown()


@dataclass
class LoadOutcome:
    out: Path
    replicas: list[int]  # RUNNING engine replicas, sampled every second during the load
    after: dict[str, float]


@pytest.fixture(scope="module")
def loaded(live, tmp_path_factory) -> LoadOutcome:
    from loadtest.run import run_headless

    work = tmp_path_factory.mktemp("load")
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "turns": [p]}) + "\n"
                               for i, p in enumerate(PROMPTS)))
    replicas: list[int] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            replicas.append(running_replicas())
            done.wait(1.0)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        out = run_headless(
            live.base_url, work / "run", progress_s=5.0, shape="step", base_users=2,
            step_users=3, step_s=5.0, users=8, duration_s=40.0, max_tokens=24,
            prompts_path=str(prompts), model=MODEL, prometheus=live.prometheus.url,
        )
        log(f"replicas during the load: {replicas}")
        wait_for("scale-down to one replica", lambda: running_replicas() == 1, 120)
    finally:
        done.set()
        sampler.join()
    log(f"replicas sampled: {replicas}")
    # counters reach the endpoint within a report interval (1 s here)
    time.sleep(3.0)
    return LoadOutcome(out, replicas, scrape(live.sd_file))


def _locust_rows(out: Path) -> dict[str, dict[str, str]]:
    with open(out / "locust_stats.csv", newline="") as f:
        return {f"{r['Type']} {r['Name']}": r for r in csv.DictReader(f)}


def test_step_load_has_ttft_tpot_and_no_failures(loaded: LoadOutcome) -> None:
    rows = _locust_rows(loaded.out)
    assert int(rows["METRIC ttft"]["Request Count"]) > 0
    assert int(rows["METRIC tpot"]["Request Count"]) > 0
    assert int(rows["POST /v1/chat/completions"]["Request Count"]) > 0
    failures = (loaded.out / "locust_failures.csv").read_text().strip().splitlines()
    assert len(failures) == 1, failures  # the header alone
    assert sum(int(r["Failure Count"]) for r in rows.values()) == 0
    assert json.loads((loaded.out / "run.json").read_text())["locust_exit_code"] == 0
    records = [json.loads(line) for line in (loaded.out / "records.jsonl").read_text().splitlines()]
    statuses = {r["status"] for r in records}
    assert statuses <= {"ok", "backpressure"}, [r for r in records if r["status"] == "error"][:3]
    assert all(r["http_status"] == 503 for r in records if r["status"] == "backpressure")


def test_replicas_scale_up_and_back_down(loaded: LoadOutcome) -> None:
    assert max(loaded.replicas) == 2, loaded.replicas
    assert loaded.replicas[0] == 1 and running_replicas() == 1


def test_every_metric_is_exported_and_counters_moved(live: Live, loaded: LoadOutcome) -> None:
    exported = names(loaded.after)
    missing = exported_names() - exported
    assert not missing, sorted(missing)
    for spec in CATALOGUE:
        if spec.kind == "counter":
            assert total(loaded.after, spec.series) > total(live.before, spec.series), spec.name
    accepted_pos0 = [k for k in loaded.after
                     if k.startswith("ray_faser_spec_decode_num_accepted_tokens_per_pos_total{")
                     and "position=0" in k]
    assert accepted_pos0, "no per-position series for position 0"
    for histogram in ("ray_faser_time_to_first_token_seconds_count",
                      "ray_faser_time_per_output_token_seconds_count",
                      "ray_faser_e2e_request_latency_seconds_count", "ray_faser_spec_k_count"):
        assert total(loaded.after, histogram) > total(live.before, histogram), histogram
    assert all("replica=" in k for k in loaded.after if k.startswith("ray_faser_"))


def test_dashboard_uses_only_names_a_live_replica_exports(loaded: LoadOutcome) -> None:
    used = set().union(*(metric_names(e) for e in dashboard.expressions()))
    assert used <= names(loaded.after), sorted(used - names(loaded.after))


def test_prometheus_answers_a_query(live: Live, loaded: LoadOutcome) -> None:
    expr = f"sum({NUM_DRAFTS.series})"
    result = wait_for("Prometheus to have scraped the drafts counter",
                      lambda: live.prometheus.query(expr), 60)
    assert float(result[0]["value"][1]) > 0
    mean_length = live.prometheus.query(
        f"1 + sum({NUM_ACCEPTED_TOKENS.series}) / sum({NUM_DRAFTS.series})"
    )
    assert float(mean_length[0]["value"][1]) >= 1.0
    # every replica that ran labels its series; Prometheus kept the stopped one's
    replicas = live.prometheus.query(
        f"count(count by (replica) (max_over_time({MODE.series}[10m])))"
    )
    assert int(float(replicas[0]["value"][1])) == max(loaded.replicas)
    # the load test's own dump of the run from Prometheus (loadtest.prometheus.DEFAULT_QUERIES)
    dump = json.loads((loaded.out / "metrics.json").read_text())
    assert {name: bool(series_points(raw)) for name, raw in dump.items()} == dict.fromkeys(
        dump, True
    )
    targets = json.loads(urllib.request.urlopen(f"{live.prometheus.url}/api/v1/targets").read())
    assert any(t["health"] == "up" for t in targets["data"]["activeTargets"])
