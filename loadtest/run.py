"""Run one headless Locust test and keep its CSVs, records and settings in one folder.

    python -m loadtest.run --host http://127.0.0.1:8000 --shape trace --trace conv \
        --time-scale 0.05 --max-requests 50 --duration 60 --out results/run1

The folder gets `run.json` (the settings and outcome), `records.jsonl` (one line per request),
Locust's `locust_stats.csv`, `locust_stats_history.csv`, `locust_failures.csv`, `locust.html`
and its log. The test stops by itself: the shape ends at `--duration` (trace replay also ends
when every arrival has been answered) and the Locust process is killed if it overruns.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from loadtest.settings import API_KEY_ENV, SETTINGS_ENV, LoadSettings

LOCUSTFILE = Path(__file__).resolve().parent / "locustfile.py"
RECORDS = "records.jsonl"
STOP_TIMEOUT_S = 30  # in-flight requests may finish after the shape ends
OVERRUN_S = 60.0  # beyond duration + stop timeout, the Locust process is killed


def run_headless(
    host: str = "http://127.0.0.1:8000",
    out: str | os.PathLike[str] = "results/run",
    progress_s: float = 5.0,
    prometheus: str | None = None,
    api_key: str | None = None,
    **settings: Any,
) -> Path:
    """Run one test; `settings` are `LoadSettings` fields (shape=, duration_s=, ...). The folder.
    `api_key`: the server's, sent as a Bearer token (default: $OPENAI_API_KEY)."""
    api_key = api_key or os.environ.get(API_KEY_ENV)
    _check_reachable(host, api_key)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / RECORDS).unlink(missing_ok=True)
    load = LoadSettings.from_mapping({**settings, "records_path": str(out_dir / RECORDS)})
    started = time.time()
    rc = _run_locust(host, load, out_dir, progress_s, api_key)
    ended = time.time()
    _write_run_json(out_dir, host, load, rc, started, ended)
    if prometheus:
        _dump_prometheus(prometheus, out_dir, started, ended)
    if not (out_dir / "locust_stats.csv").is_file():
        raise RuntimeError(f"locust wrote no stats (exit {rc}); see {out_dir / 'locust.out'}")
    return out_dir


def _check_reachable(host: str, api_key: str | None) -> None:
    """Fails at once when nothing answers at `host`, or it wants an API key it was not given,
    where the run would count every request of its whole duration as an error and say nothing
    of why. Any other HTTP answer will do."""
    request = urllib.request.Request(f"{host.rstrip('/')}/v1/models")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        urllib.request.urlopen(request, timeout=10).close()
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            given = "refused the API key given" if api_key else "wants an API key"
            raise RuntimeError(f"the server at {host} {given} (HTTP 401): pass --api-key or "
                               f"set ${API_KEY_ENV}") from exc
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise RuntimeError(f"nothing answers at {host} ({reason}): is the server up?") from exc


def locust_command(host: str, out_dir: Path) -> list[str]:
    return [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", host,
        "--csv", str(out_dir / "locust"), "--csv-full-history",
        "--html", str(out_dir / "locust.html"), "--logfile", str(out_dir / "locust.log"),
        "--stop-timeout", f"{STOP_TIMEOUT_S}s", "--only-summary",
    ]


def _run_locust(
    host: str, load: LoadSettings, out_dir: Path, progress_s: float, api_key: str | None
) -> int:
    env = {**os.environ, SETTINGS_ENV: load.to_json()}
    if api_key:
        env[API_KEY_ENV] = api_key
    deadline = time.monotonic() + load.duration_s + STOP_TIMEOUT_S + OVERRUN_S
    print(f"loadtest: {load.shape} against {host} for up to {load.duration_s:.0f} s -> {out_dir}")
    command = locust_command(host, out_dir)
    with open(out_dir / "locust.out", "w") as console:
        proc = subprocess.Popen(command, env=env, stdout=console, stderr=console)
        t0 = time.monotonic()
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(min(progress_s, max(0.1, deadline - time.monotonic())))
            if proc.poll() is None:
                elapsed = time.monotonic() - t0
                print(f"  {elapsed:6.0f} s  {_progress(out_dir / RECORDS)}", flush=True)
        if proc.poll() is None:
            print("loadtest: locust overran its deadline, killing it")
            proc.kill()
        rc = proc.wait()
    print(f"loadtest: done in {time.monotonic() - t0:.0f} s, {_progress(out_dir / RECORDS)}")
    return rc


def _progress(records: Path) -> str:
    """Counts by status so far, read from the records file."""
    counts = {"ok": 0, "backpressure": 0, "error": 0}
    tokens = 0
    if records.is_file():
        for line in records.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            counts[row.get("status", "error")] = counts.get(row.get("status", "error"), 0) + 1
            tokens += int(row.get("output_tokens") or 0) if row.get("status") == "ok" else 0
    return (
        f"ok {counts['ok']}  503 {counts['backpressure']}  errors {counts['error']}  "
        f"output tokens {tokens}"
    )


def _write_run_json(
    out_dir: Path, host: str, load: LoadSettings, rc: int, started: float, ended: float
) -> None:
    run = {
        "host": host,
        "settings": json.loads(load.to_json()),
        "locust_exit_code": rc,  # 1 when any request failed; not an error of the runner
        "started": started,
        "ended": ended,
    }
    (out_dir / "run.json").write_text(json.dumps(run, indent=2) + "\n", encoding="utf-8")


def _dump_prometheus(url: str, out_dir: Path, started: float, ended: float) -> None:
    from loadtest.prometheus import DEFAULT_QUERIES, dump_metrics

    try:
        dump_metrics(url, DEFAULT_QUERIES, started, ended, out_dir / "metrics.json")
    except OSError as error:
        print(f"loadtest: could not read Prometheus at {url}: {error}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--host", default="http://127.0.0.1:8000")
    p.add_argument("--out", default="results/run")
    p.add_argument("--shape", choices=("step", "spike", "diurnal", "trace"), default="step")
    p.add_argument("--duration", type=float, default=60.0, help="seconds; bounds every shape")
    p.add_argument("--api", choices=("chat", "completions"), default="chat")
    p.add_argument("--model", help="default: the first entry of the server's /v1/models")
    p.add_argument("--speculation", help="FASER policy name or JSON, sent as `speculation`")
    p.add_argument("--prompts", help="Spec-Bench JSONL (default $FASER_PROMPTS or ../shared)")
    p.add_argument("--max-tokens", type=int, default=128, help="closed-loop shapes")
    p.add_argument("--users", type=int, default=8, help="peak users (step, spike, diurnal)")
    p.add_argument("--base-users", type=int, default=1)
    p.add_argument("--step-users", type=int, default=1)
    p.add_argument("--step-s", type=float, default=10.0)
    p.add_argument("--think-s", type=float, default=0.0)
    p.add_argument("--trace", default="conv", help="conv, code or a trace CSV path")
    p.add_argument("--time-scale", type=float, default=1.0, help="replay offset = trace / S")
    p.add_argument("--trace-start", type=float, default=0.0, help="window start, trace seconds")
    p.add_argument("--trace-span", type=float, help="window length, trace seconds")
    p.add_argument("--max-requests", type=int)
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--max-output-tokens", type=int, default=128)
    p.add_argument("--pool-users", type=int, default=64, help="most replay requests in flight")
    p.add_argument("--prometheus", help="Prometheus base URL to dump metrics.json from")
    p.add_argument("--api-key", help=f"the server's API key (default ${API_KEY_ENV})")
    return p.parse_args(argv)


def settings_from_args(args: argparse.Namespace) -> dict[str, Any]:
    fields = {
        "shape": args.shape, "duration_s": args.duration, "api": args.api, "model": args.model,
        "speculation": args.speculation, "prompts_path": args.prompts,
        "max_tokens": args.max_tokens, "users": args.users, "base_users": args.base_users,
        "step_users": args.step_users, "step_s": args.step_s, "think_s": args.think_s,
        "trace": args.trace, "time_scale": args.time_scale, "trace_start_s": args.trace_start,
        "trace_span_s": args.trace_span, "max_requests": args.max_requests,
        "max_prompt_tokens": args.max_prompt_tokens, "max_output_tokens": args.max_output_tokens,
        "pool_users": args.pool_users,
    }
    return {name: value for name, value in fields.items() if value is not None}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        out = run_headless(
            args.host, args.out, prometheus=args.prometheus, api_key=args.api_key,
            **settings_from_args(args),
        )
    except RuntimeError as exc:
        sys.exit(f"loadtest: {exc}")
    print(f"loadtest: results in {out}; report with: python -m loadtest.report {out}")


if __name__ == "__main__":
    main()
