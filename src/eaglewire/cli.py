"""``eaglewire <command>``: parse flags into a config, call the library, print the result."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from eaglewire.configs import add_config_args, config_from_args


def _table(rows: list[tuple[str, str]], title: str) -> str:
    width = max(len(k) for k, _ in rows)
    lines = [title, "-" * len(title)] + [f"{k:<{width}}  {v}" for k, v in rows]
    return "\n".join(lines)


def _set_threads(n: int | None) -> None:
    if n:
        import torch

        torch.set_num_threads(n)


def cmd_prepare(args: argparse.Namespace) -> int:
    from eaglewire.data.prepare import PrepareConfig, prepare

    config = config_from_args(PrepareConfig, args)
    summary = prepare(config, progress=not args.no_progress)
    print(_table(summary.rows(), f"prepared {summary.out}"))
    if summary.skipped:
        skipped = ", ".join(f"{n} {why}" for why, n in sorted(summary.skipped.items(), key=lambda x: -x[1]))
        print(f"skipped conversations: {skipped}", file=sys.stderr)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from eaglewire.train import TrainConfig, train

    config = config_from_args(TrainConfig, args)
    result = train(config, progress=not args.no_progress)
    rows = [("steps", f"{result.steps:,}"), ("epochs", f"{result.epochs_done:.2f}"),
            ("training tokens", f"{result.train_tokens:,}"), ("wall time", f"{result.seconds:,.0f} s")]
    rows += [(k.removeprefix("val_").replace("_", " ") + " (held-out)", f"{v:.3f}")
             for k, v in result.final_eval.items() if k != "step"]
    status = "" if result.finished else " (stopped early: run again with --resume to continue)"
    print(_table(rows, f"draft written to {result.out}{status}"))
    return 0


def cmd_contract(args: argparse.Namespace) -> int:
    """Show how each engine names a boundary layout of a target."""
    from eaglewire.contract import ENGINES, EngineConventionError, default_aux_boundaries, sglang_ambiguity, to_engine

    if args.num_layers is None:
        from eaglewire.target import load_target

        num_layers = load_target(args.target, device="cpu").num_layers
    else:
        num_layers = args.num_layers
    bounds = args.aux_boundaries or default_aux_boundaries(num_layers)
    result: dict[str, object] = {"num_layers": num_layers, "aux_boundaries": bounds}
    for engine in ENGINES:
        try:
            result[engine] = to_engine(bounds, num_layers, engine)
        except EngineConventionError as e:
            result[engine] = f"not expressible: {e}"
    sglang_ids = result["sglang"]
    if isinstance(sglang_ids, list):
        result["sglang_note"] = sglang_ambiguity(bounds, sglang_ids) or "both SGLang rules read these ids the same way"
    print(json.dumps(result, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from eaglewire.data.prepare import PrepareConfig
    from eaglewire.train import TrainConfig

    parser = argparse.ArgumentParser(prog="eaglewire", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prepare", help="conversations -> captured hidden-state shards")
    add_config_args(p, PrepareConfig)
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("train", help="train an EAGLE-3 draft (TTT) on shards or live captures")
    add_config_args(p, TrainConfig)
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("contract", help="how SGLang, vLLM, SpecForge and EAGLE name a boundary layout")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--num-layers", type=int, default=None, help="skip loading the target")
    p.add_argument("--aux-boundaries", type=lambda s: [int(x) for x in s.split(",")], default=None)
    p.set_defaults(func=cmd_contract)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for noisy in ("transformers", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    _set_threads(args.threads)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        # User-facing errors carry their own explanation; no traceback needed.
        logging.getLogger("eaglewire").debug("error", exc_info=True)
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
