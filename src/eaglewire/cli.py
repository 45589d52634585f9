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
        print(f"skipped conversations: {skipped} (each by id and reason in {summary.out}/manifest*.json, "
              "status.load_report)", file=sys.stderr)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from eaglewire.train import TrainConfig, train

    config = config_from_args(TrainConfig, args)
    result = train(config, progress=not args.no_progress)
    rows = [("steps", f"{result.steps:,}"), ("epochs", f"{result.epochs_done:.2f}"),
            ("training tokens", f"{result.train_tokens:,}"), ("wall time", f"{result.seconds:,.0f} s")]
    rows += [(k.removeprefix("val_").replace("_", " ") + " (held-out)", f"{v:.3f}")
             for k, v in result.final_eval.items() if k != "step"]
    rows += [(f"time in {k.replace('_', ' ')}", f"{v:,.1f} s") for k, v in result.timers.items()]
    status = "" if result.finished else " (stopped early: run again with --resume to continue)"
    print(_table(rows, f"draft written to {result.out}{status}"))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from eaglewire.decode.sampling import SamplingParams
    from eaglewire.decode.text import TextStream, encode_prompt
    from eaglewire.runtime import load_decoder
    from eaglewire.tokens import stop_token_ids

    from eaglewire.decode.engine import SpecConfig

    decoder = load_decoder(args.target, args.draft, config_from_args(SpecConfig, args), device=args.device)
    tok = decoder.target.tokenizer
    prompt_ids = encode_prompt(tok, args.prompt, chat=args.chat)
    text = TextStream(tok, args.stop or [])
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    for tokens in decoder.stream(prompt_ids, max_new_tokens=args.max_new_tokens, sampling=sampling,
                                 stop_token_ids=set(stop_token_ids(tok, decoder.target.model)),
                                 should_stop=text.stops):
        sys.stdout.write(text.push(tokens))
        sys.stdout.flush()
    sys.stdout.write(text.finish() + "\n")
    st = decoder.stats
    print(f"[{st.new_tokens} tokens in {st.total_seconds:.2f} s: {st.tokens_per_second:.1f} tok/s; "
          f"accept length {st.accept_length:.2f} over {st.rounds} target passes "
          f"({st.verified_per_round:.2f} tokens verified per pass); "
          f"per-position acceptance {[round(x, 2) for x in st.position_acceptance]}; "
          f"draft {st.draft_seconds:.2f} s, verify {st.verify_seconds:.2f} s, prefill {st.prefill_seconds:.2f} s; "
          f"finish: {st.finish_reason}]", file=sys.stderr)
    return 0


def cmd_quickstart(args: argparse.Namespace) -> int:
    from eaglewire.quickstart import QuickstartConfig, run_quickstart, summary_rows

    config = config_from_args(QuickstartConfig, args)
    done = run_quickstart(config, progress=not args.no_progress)
    rows = summary_rows(done)
    print("\n" + _table(rows, f"quickstart: report folder {config.out} (summary.md, doctor.txt, bench/, tune.json)"))
    return 0 if done["doctor"]["ok"] else 1


def cmd_doctor(args: argparse.Namespace) -> int:
    from eaglewire.doctor import DoctorConfig, run_doctor

    report = run_doctor(config_from_args(DoctorConfig, args))
    print(report.render())
    return report.exit_code


def cmd_export(args: argparse.Namespace) -> int:
    from eaglewire.engines import export_draft

    report = export_draft(args.draft, args.to, args.out, target_arch=args.target_arch,
                          verifier_name=args.verifier_name, num_steps=args.num_steps, outtype=args.outtype,
                          target_outtype=args.target_outtype, llamacpp_dir=args.llamacpp_dir,
                          allow=set(args.allow_target_mismatch or ()))
    print(report.summary())
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from eaglewire.engines import import_draft
    from eaglewire.target import load_target

    report = import_draft(args.src, args.from_, load_target(args.target, device="cpu", dtype="fp32"), args.out,
                          target_arch=args.target_arch, allow=set(args.allow_target_mismatch or ()))
    print(report.summary())
    return 0


def cmd_import_data(args: argparse.Namespace) -> int:
    from eaglewire.data.import_data import ImportDataConfig, import_data

    config = config_from_args(ImportDataConfig, argparse.Namespace(**vars(args), layout=args.from_))
    summary = import_data(config)
    print(_table(summary.rows(), f"imported {config.layout} captures into {summary.out}"))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from eaglewire.bench import BenchConfig, run_bench
    from eaglewire.bench_report import terminal_table, write_report

    config = config_from_args(BenchConfig, args)
    result = run_bench(config, progress=not args.no_progress)
    print(terminal_table(result))
    paths = write_report(result, config.out_dir)
    print(f"\nreport written to {config.out_dir}: {', '.join(p.name for p in paths)}")
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from eaglewire.tune.run import TuneConfig, run_tune

    config = config_from_args(TuneConfig, args)
    result = run_tune(config, progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(result.format())
    if config.out:
        print(f"\nreport written to {config.out}")
    return 0


def cmd_engines(args: argparse.Namespace) -> int:
    """``eaglewire engines install llamacpp``: download and build llama.cpp once, with progress."""
    from tqdm.auto import tqdm

    from eaglewire.engines import llamacpp

    bar = None

    def progress(stage: str, percent: float | None) -> None:
        nonlocal bar
        if percent is None:
            if bar is not None:
                bar.close()
                bar = None
            print(stage, file=sys.stderr)
            return
        if bar is None:
            bar = tqdm(total=100, desc=stage.split(" (")[0], unit="%", disable=args.no_progress)
        bar.update(percent - bar.n)

    if args.action == "install":
        found = llamacpp.install(llamacpp_dir=args.llamacpp_dir, jobs=args.jobs, use_path=not args.build,
                                 progress=progress)
    else:
        server, tree = llamacpp.find_server(args.llamacpp_dir), llamacpp.find_tree(args.llamacpp_dir)
        if server is None or tree is None:
            print(f"llama.cpp is not installed: {llamacpp.INSTALL_HINT}", file=sys.stderr)
            return 1
        build = llamacpp.BUILD if server == llamacpp.built_server(llamacpp.source_dir()) else llamacpp.server_build(server)
        found = llamacpp.Installation(server=server, tree=tree, build=build, how="found")
    if bar is not None:
        bar.close()
    print(_table(found.rows(), f"llama.cpp (pinned build {llamacpp.BUILD})"))
    return 0


def cmd_contract(args: argparse.Namespace) -> int:
    """Show how each engine names a boundary layout of a target, and which code says so."""
    from eaglewire import engines
    from eaglewire.contract import EngineConventionError, default_aux_boundaries, target_arch, validate_boundaries
    from eaglewire.engines import sglang, vllm

    if args.num_layers is None:
        from eaglewire.target import load_target

        target = load_target(args.target, device="cpu")
        num_layers, arch = target.num_layers, args.target_arch or target.fingerprint.architecture
    else:
        num_layers, arch = args.num_layers, args.target_arch
    arch = target_arch(arch) if arch else None
    bounds = validate_boundaries(args.aux_boundaries or default_aux_boundaries(num_layers), num_layers)
    result: dict[str, object] = {"num_layers": num_layers, "aux_boundaries": bounds, "target_arch": arch,
                                 "versions": {m.NAME: m.VERSION for m in (sglang, vllm)}}

    def ids(engine: str, a: str | None) -> object:
        try:
            return engines.to_engine(bounds, num_layers, engine, target_arch=a)
        except EngineConventionError as e:
            return f"not expressible: {e}"

    for engine in (n for n in engines.names() if n != "eaglewire"):  # eaglewire's own reads the contract
        e = engines.get(engine)
        if e.needs_target_arch and arch is None:  # the rule depends on the model file: show every one
            result[engine] = {family: ids(engine, archs[0]) for family, archs in e.module.families().items()}
        else:
            result[engine] = ids(engine, arch if e.per_model_file else None)
    if arch is not None:
        result["rules"] = {m.__name__.rpartition(".")[2]: f"{m.file_for(arch).path}: {m.file_for(arch).function}"
                           for m in (sglang, vllm)}
    print(json.dumps(result, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from eaglewire.data.prepare import PrepareConfig
    from eaglewire.decode.engine import SpecConfig
    from eaglewire.engines import names as engine_names
    from eaglewire.engines import llamacpp
    from eaglewire.engines.llamacpp import DRAFT_OUTTYPES, TARGET_OUTTYPES
    from eaglewire.presets import DEFAULT_TARGET
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

    p = sub.add_parser("generate", help="generate text with speculative decoding (stream to stdout)")
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--draft", default=None, help="draft directory (none: plain decoding)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the target's chat template")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--device", default="auto")
    add_config_args(p, SpecConfig)
    p.set_defaults(func=cmd_generate)

    from eaglewire.server import add_serve_args, cmd_serve

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with speculative decoding")
    add_serve_args(p)
    p.set_defaults(func=cmd_serve)

    from eaglewire.quickstart import QuickstartConfig

    p = sub.add_parser("quickstart", help="the whole pipeline on the default target: data, draft, doctor, bench")
    add_config_args(p, QuickstartConfig)
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_quickstart)

    from eaglewire.doctor import DoctorConfig

    p = sub.add_parser("doctor", help="the standalone wiring test: is the draft fed what it was trained on?")
    add_config_args(p, DoctorConfig)
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("export", help="write a draft in SGLang, vLLM/speculators or llama.cpp (GGUF) format")
    p.add_argument("--draft", required=True)
    p.add_argument("--to", required=True, choices=engine_names("export"))
    p.add_argument("--out", required=True)
    p.add_argument("--target-arch", default=None, help="the target's architecture, whose model file sets the "
                   "engine's reading of the ids (default: the one the draft records), e.g. llama, qwen3, deepseek_v3")
    p.add_argument("--verifier-name", default=None, help="target path or hub id written into the export "
                   "(default: the recorded target, as an absolute path when it is a local directory)")
    p.add_argument("--num-steps", type=int, default=5, help="speculative steps suggested in SERVING.md")
    p.add_argument("--allow-target-mismatch", type=lambda s: s.split(","), default=None)
    p.add_argument("--outtype", default="q8_0", choices=DRAFT_OUTTYPES, help="llamacpp: the draft GGUF's weights")
    p.add_argument("--target-outtype", default="f16", choices=TARGET_OUTTYPES,
                   help="llamacpp: also write the target as GGUF of this type (none: skip)")
    p.add_argument("--llamacpp-dir", default=None, help="llamacpp: a llama.cpp tree (default: the one `engines install` made)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("engines", help="install or find third-party engines (llama.cpp)")
    p.add_argument("action", choices=["install", "which"])
    p.add_argument("engine", choices=[llamacpp.NAME])
    p.add_argument("--llamacpp-dir", default=None, help="use this llama.cpp build (directory or llama-server binary)")
    p.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: all cores)")
    p.add_argument("--build", action="store_true", help="build into the cache even when llama-server is on PATH")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_engines)

    p = sub.add_parser("import", help="convert a SGLang, SpecForge, speculators or EAGLE draft")
    p.add_argument("--from", dest="from_", required=True, choices=engine_names("import"))
    p.add_argument("src", help="the checkpoint directory to import")
    p.add_argument("--target", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--target-arch", default=None, help="the target's architecture whose SGLang model file "
                   "reads the ids (default: the target's own)")
    p.add_argument("--allow-target-mismatch", type=lambda s: s.split(","), default=None)
    p.set_defaults(func=cmd_import)

    from eaglewire.data.import_data import ImportDataConfig
    from eaglewire.data.foreign import LAYOUTS

    p = sub.add_parser("import-data", help="hidden states captured by vLLM, speculators or SpecForge -> shards")
    p.add_argument("--from", dest="from_", required=True, choices=LAYOUTS)
    p.add_argument("src", help="the directory of captured states")
    add_config_args(p, ImportDataConfig)
    p.set_defaults(func=cmd_import_data)

    from eaglewire.bench import BenchConfig

    p = sub.add_parser("bench", help="tokens/s, τ and acceptance of speculation configs (and HF baselines) on a prompt set")
    add_config_args(p, BenchConfig)
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_bench)

    from eaglewire.tune.run import TuneConfig

    p = sub.add_parser("tune", help="measure an engine's round costs and the draft's acceptance; rank speculation "
                       "shapes by predicted tokens/s and recommend one (or plain decoding, with the reason)")
    add_config_args(p, TuneConfig)
    p.set_defaults(func=cmd_tune)

    p = sub.add_parser("contract", help="how SGLang, vLLM, SpecForge and EAGLE name a boundary layout")
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--num-layers", type=int, default=None, help="skip loading the target")
    p.add_argument("--aux-boundaries", type=lambda s: [int(x) for x in s.split(",")], default=None)
    p.add_argument("--target-arch", default=None, help="the target's architecture (llama, qwen3, deepseek_v3, "
                   "...; default: the target's own; with --num-layers and none: every SGLang model file)")
    p.set_defaults(func=cmd_contract)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # its deprecation notices are not the user's business
    hf_logging.disable_progress_bar()
    for noisy in ("transformers", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    _set_threads(args.threads)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        # Every long command resumes from what it wrote; a traceback would only hide that.
        print("\ninterrupted; run the same command to resume", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        # User-facing errors carry their own explanation; no traceback needed.
        logging.getLogger("eaglewire").debug("error", exc_info=True)
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
