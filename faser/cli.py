"""The `faser` command. Each subcommand registers its arguments and its handler in one function,
so that adding one is adding a function and a line in SUBCOMMANDS."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path


def _add_distill(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "distill",
        help="train the project's draft model for a target",
        description="Generate the target's answers to the built-in prompts (or to --prompts) "
        "with the engine, then distill a small draft from them (resumable; writes the draft to "
        "--out).",
    )
    p.add_argument("--target", default="smollm2-135m-instruct", help="target name or path")
    p.add_argument("--out", type=Path, required=True, help="directory for the draft")
    p.add_argument("--work-dir", type=Path, help="answers and labels (default: <out>/_work)")
    p.add_argument(
        "--prompts", type=Path, nargs="+", metavar="FILE",
        help="JSON-lines files of {\"category\", \"prompt\"} objects, e.g. "
        "$FASER_DISTILL_PROMPTS/*.jsonl (real prompts; docs/distill_corpus.md): their "
        "prompts replace the built-in templated requests of the first stage (the later stages "
        "still run on the answers, as their shares say); every 10th prompt of each file (from its "
        "2nd) is held out, answered greedily and its agreement reported every epoch. Default: "
        "the built-in set",
    )
    p.add_argument(
        "--num-prompts", type=int, default=512,
        help="first-stage prompts at most (of --prompts: categories interleaved, in file order)",
    )
    p.add_argument("--max-tokens", type=int, default=192, help="tokens per answer")
    p.add_argument("--chunk-size", type=int, default=16, help="prompts generated at once")
    p.add_argument("--gen-minutes", type=float, default=20.0, help="time budget of generation")
    p.add_argument(
        "--real-text-share", type=float, default=0.25,
        help="share of the generation time for requests about real prose and translations",
    )
    p.add_argument(
        "--passage-share", type=float, default=0.2,
        help="share of the generation time for summaries and rewrites of the target's answers",
    )
    p.add_argument(
        "--listed-share", type=float, default=0.0,
        help="share of the generation time for requests the target lists, then answers",
    )
    p.add_argument("--train-minutes", type=float, default=20.0, help="time budget of training")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--layers", default="0,1", help="target layers the draft starts from")
    p.add_argument(
        "--feature-layers", default="",
        help="train a feature draft (EAGLE-style) reading these target layers' outputs, e.g. "
        "30 for a 30-layer target's final hidden state (default: a standalone draft)",
    )
    p.add_argument("--output-vocab", type=int, default=8192)
    p.add_argument("--top-k", type=int, default=32, help="target candidates in the soft labels")
    p.add_argument(
        "--corpus-tokens", type=int, default=0,
        help="also train on this many tokens of real text shipped with Python (pydoc pages, "
        "the standard library's docstrings and code), labelled by the target",
    )
    p.add_argument("--corpus-width", type=int, default=1024, help="tokens per real-text sequence")
    p.add_argument(
        "--init-from", type=Path,
        help="resume from this draft (its token map and weights), not from the target's layers; "
        "with more --layers than it has, the extra layers start as identities",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(handler=_run_distill)


def _run_distill(args: argparse.Namespace) -> int:
    from faser.distill.generate import GenerationConfig
    from faser.distill.run import DistillConfig, distill
    from faser.distill.train import TrainConfig

    generation = GenerationConfig(
        target=args.target, num_prompts=args.num_prompts, max_tokens=args.max_tokens,
        chunk_size=args.chunk_size, time_budget_s=60 * args.gen_minutes,
        passage_share=args.passage_share, real_text_share=args.real_text_share,
        listed_share=args.listed_share, num_threads=args.threads, seed=args.seed,
        prompt_files=tuple(str(f) for f in args.prompts or ()),
    )
    train = TrainConfig(
        epochs=args.epochs, lr=args.lr, time_budget_s=60 * args.train_minutes, seed=args.seed
    )
    layers = tuple(int(x) for x in args.layers.split(",") if x.strip())
    feature_layers = tuple(int(x) for x in args.feature_layers.split(",") if x.strip())
    summary = distill(
        DistillConfig(
            target=args.target, out=args.out, generation=generation, train=train,
            layer_ids=layers, feature_layers=feature_layers, output_vocab=args.output_vocab,
            top_k=args.top_k, num_threads=args.threads, work_dir=args.work_dir,
            corpus_tokens=args.corpus_tokens, corpus_width=args.corpus_width,
            init_from=args.init_from,
        )
    )
    print(f"best held-out greedy agreement: {summary['best_held_out_agreement']:.3f}")
    return 0


def _add_dashboard(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dashboard", help="the Grafana dashboard of the serving metrics")
    actions = p.add_subparsers(dest="action", required=True)
    push = actions.add_parser(
        "push", help="push the dashboard and a Prometheus datasource to Grafana",
        description="Create or update the Prometheus datasource, then save the dashboard "
        "(overwriting an older version) through Grafana's HTTP API.",
    )
    push.add_argument("--url", required=True, help="Grafana's base URL")
    push.add_argument("--token", help="a Grafana service-account token (default $GRAFANA_TOKEN)")
    push.add_argument("--prometheus-url", default="http://prometheus:9090",
                      help="where Grafana reaches Prometheus")
    push.add_argument("--folder-uid", help="Grafana folder to save the dashboard in")
    push.set_defaults(handler=_run_dashboard_push)
    export = actions.add_parser("export", help="write the dashboard JSON")
    export.add_argument("--out", type=Path, help="default: k8s/grafana-dashboard.json")
    export.set_defaults(handler=_run_dashboard_export)


def _run_dashboard_push(args: argparse.Namespace) -> int:
    import os

    from deployments.grafana import push

    token = args.token or os.environ.get("GRAFANA_TOKEN")
    print(f"dashboard: pushing to {args.url} (datasource -> {args.prometheus_url})")
    result = push(args.url, token, args.prometheus_url, args.folder_uid)
    print(f"dashboard: datasource {result.datasource}; dashboard at {args.url.rstrip('/')}"
          f"{result.dashboard_url}")
    return 0


def _run_dashboard_export(args: argparse.Namespace) -> int:
    from deployments.dashboard import main as export

    export(["--out", str(args.out)] if args.out else [])
    return 0


SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    _add_distill,
    _add_dashboard,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="faser", description="FASER serve tools")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (ValueError, OSError) as exc:  # bad input, a file or a server out of reach
        print(f"faser: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
