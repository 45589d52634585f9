"""``eaglewire <command>``: parse flags (over a --config FILE) into a config, call the library, print the result."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from dataclasses import asdict
from pathlib import Path

from eaglewire.core.configs import RESOLVED_CONFIG, add_config_args, config_from_args, write_resolved_config


def _table(rows: list[tuple[str, str]], title: str) -> str:
    width = max(len(k) for k, _ in rows)
    lines = [title, "-" * len(title)] + [f"{k:<{width}}  {v}" for k, v in rows]
    return "\n".join(lines)


def _set_threads(n: int | None) -> None:
    if n:
        import torch

        torch.set_num_threads(n)


def _record(directory, config) -> None:
    """The run directory's record of its resolved config (rank 0 alone under torchrun)."""
    from eaglewire.core.distributed import dist_rank_world

    if dist_rank_world()[0] == 0:
        write_resolved_config(directory, config)


def cmd_prepare(args: argparse.Namespace) -> int:
    from eaglewire.data.prepare import PrepareConfig, prepare

    config = config_from_args(PrepareConfig, args)
    summary = prepare(config, progress=not args.no_progress)
    _record(config.out, config)
    print(_table(summary.rows(), f"prepared {summary.out}"))
    if summary.skipped:
        skipped = ", ".join(f"{n} {why}" for why, n in sorted(summary.skipped.items(), key=lambda x: -x[1]))
        print(f"skipped conversations: {skipped} (each by id and reason in {summary.out}/manifest*.json, "
              "status.load_report)", file=sys.stderr)
    return 0


def cmd_regenerate(args: argparse.Namespace) -> int:
    from eaglewire.data.regenerate_command import RegenerateCommandConfig, run_regenerate
    from eaglewire.data.remote_regenerate import meta_path

    config = config_from_args(RegenerateCommandConfig, args)
    report = run_regenerate(config, progress=not args.no_progress)
    print(report.summary())
    print(f"replies in {config.out} (settings in {meta_path(config.out)}); read them with "
          f"`eaglewire prepare --data {config.out}`")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from eaglewire.train.loop import train
    from eaglewire.train.train_config import TrainConfig

    config = config_from_args(TrainConfig, args)
    result = train(config, progress=not args.no_progress)
    _record(config.out, config)
    rows = [("steps", f"{result.steps:,}"), ("epochs", f"{result.epochs_done:.2f}"),
            ("training tokens", f"{result.train_tokens:,}"), ("wall time", f"{result.seconds:,.0f} s")]
    speed = result.throughput
    if speed.get("tokens_per_s"):  # over the training steps: evaluations and saves left out
        rows.append(("tokens/s (training steps)", f"{speed['tokens_per_s']:,.0f}"))
        if speed.get("tflops") is not None:
            mfu = speed.get("mfu")
            rows.append(("model FLOP/s", f"{speed['tflops']:.3g} TFLOP/s" +
                         (f" = {100 * mfu:.1f}% MFU" if mfu is not None else " (the device's peak is unknown: no MFU)")))
    rows += [(k.removeprefix("val_").replace("_", " ") + " (held-out)", f"{v:.3f}")
             for k, v in result.final_eval.items() if k != "step"]
    rows += [(f"time in {k.replace('_', ' ')}", f"{v:,.1f} s") for k, v in result.timers.items()]
    status = "" if result.finished else " (stopped early: run again with --resume to continue)"
    print(_table(rows, f"draft written to {result.out}{status}"))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from eaglewire.cli_settings import GenerateConfig
    from eaglewire.decode.sampling import SamplingParams
    from eaglewire.decode.text import TextStream, encode_prompt
    from eaglewire.decode.load import load_decoder
    from eaglewire.core.tokens import stop_token_ids

    config = config_from_args(GenerateConfig, args)
    decoder = load_decoder(config.target, config.draft, config.spec, device=config.device, dtype=config.dtype)
    tok = decoder.target.tokenizer
    prompt_ids = encode_prompt(tok, config.prompt, chat=config.chat)
    text = TextStream(tok, config.stop or [])
    sampling = SamplingParams(temperature=config.temperature, top_p=config.top_p, seed=config.seed)
    for tokens in decoder.stream(prompt_ids, max_new_tokens=config.max_new_tokens, sampling=sampling,
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
    from eaglewire.quickstart import QuickstartConfig, exit_code, run_quickstart, summary_rows

    config = config_from_args(QuickstartConfig, args)
    done = run_quickstart(config, progress=not args.no_progress)
    _record(config.out, config)
    rows = summary_rows(done)
    print("\n" + _table(rows, f"quickstart: report folder {config.out} (summary.md, doctor.txt, bench/, tune.json)"))
    return exit_code(done)


def cmd_doctor(args: argparse.Namespace) -> int:
    from eaglewire.doctor import DoctorConfig, run_doctor

    report = run_doctor(config_from_args(DoctorConfig, args))
    print(report.render())
    return report.exit_code


def cmd_export(args: argparse.Namespace) -> int:
    from eaglewire.engines.command_settings import ExportCommandConfig
    from eaglewire.engines import export_draft

    c = config_from_args(ExportCommandConfig, args)
    print(export_draft(c.draft, c.to, c.out, allow=c.allow, **asdict(c.export)).summary())
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from eaglewire.engines.command_settings import ImportConfig
    from eaglewire.engines import import_draft
    from eaglewire.model.target import load_target

    c = config_from_args(ImportConfig, args)
    print(import_draft(c.src, c.format, load_target(c.target, device="cpu", dtype="fp32"), c.out,
                       target_arch=c.target_arch, allow=c.allow).summary())
    return 0


def cmd_import_data(args: argparse.Namespace) -> int:
    from eaglewire.data.import_data import ImportDataConfig, import_data

    config = config_from_args(ImportDataConfig, args)
    summary = import_data(config)
    print(_table(summary.rows(), f"imported {config.layout} captures into {summary.out}"))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from eaglewire.bench.bench_command import BenchConfig, run_bench
    from eaglewire.bench.bench_report import terminal_table, write_report

    config = config_from_args(BenchConfig, args)
    if config.concurrency is not None:
        return _bench_concurrency(config, progress=not args.no_progress)
    result = run_bench(config, progress=not args.no_progress)
    print(terminal_table(result))
    paths = write_report(result, config.out_dir)
    _record(config.out_dir, config)
    print(f"\nreport written to {config.out_dir}: {', '.join(p.name for p in paths + [Path(RESOLVED_CONFIG)])}")
    return 0


def _bench_concurrency(config, *, progress: bool) -> int:
    """``bench --concurrency``: the table, concurrency.json and concurrency.png in the report directory."""
    from eaglewire.concurrency.closed_loop import plot, table
    from eaglewire.bench.bench_command import run_bench_concurrency
    from eaglewire.core.fileio import atomic_write_text
    from eaglewire.core.machine import summary_line

    rows = run_bench_concurrency(config, progress=progress)
    print(table(rows))
    out = config.out_dir
    out.mkdir(parents=True, exist_ok=True)
    report = {"machine": summary_line(), "command": config.command_line(), "rows": [r.to_dict() for r in rows]}
    atomic_write_text(out / "concurrency.json", json.dumps(report, indent=2) + "\n")
    paths = [out / "concurrency.json", plot(rows, out / "concurrency.png")]
    _record(out, config)
    print(f"\nreport written to {out}: {', '.join(p.name for p in paths + [Path(RESOLVED_CONFIG)])}")
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from eaglewire.tune.tune_command import TuneConfig, run_tune

    config = config_from_args(TuneConfig, args)
    progress = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    if config.concurrency is not None:
        from eaglewire import engines
        from eaglewire.tune.load_schedule import run_concurrency

        report = run_concurrency(config, progress=progress)
        print(report.format())
        if config.schedule_out and engines.get(config.engine).in_process:
            print(f"\nschedule written to {config.schedule_out}: eaglewire serve --draft {config.draft} "
                  f"--schedule {config.schedule_out}")
        elif config.schedule_out:
            print(f"\nschedule written to {config.schedule_out}: which {config.engine} launch pays up to which load "
                  "(the engine keeps its launch's shape at every load)")
        return 0
    result = run_tune(config, progress=progress)
    print(result.format())
    if config.out:
        print(f"\nreport written to {config.out}")
    return 0


def cmd_engines(args: argparse.Namespace) -> int:
    """``eaglewire engines install|which ENGINE``: install a third-party engine once, with progress, or say which
    installation the commands use (the engine's installer)."""
    from tqdm.auto import tqdm

    from eaglewire import engines
    from eaglewire.engines.command_settings import EnginesConfig
    from eaglewire.engines.interface import InstallError

    config = config_from_args(EnginesConfig, args)
    installer = engines.get(config.engine, engines.Ability.INSTALL).installer
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

    try:
        found = (installer.install(config.settings(), progress) if config.action == "install"
                 else installer.which(config.settings()))
    except InstallError as e:
        print(str(e), file=sys.stderr)
        return 1
    finally:
        if bar is not None:
            bar.close()
    print(_table(found.rows(), installer.title))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from eaglewire.serve.app import serve  # the web framework is imported by the command that serves alone

    return serve(config_from_args(args.config_class, args))


def cmd_contract(args: argparse.Namespace) -> int:
    """Show how each engine names a boundary layout of a target, and which code says so."""
    from eaglewire import engines
    from eaglewire.cli_settings import ContractConfig
    from eaglewire.core.contract import EngineConventionError, default_aux_boundaries, target_arch, validate_boundaries

    config = config_from_args(ContractConfig, args)
    # the engines whose reading of the ids follows the target's model file: their release and the code that says so
    ruled = {e.name: e for e in map(engines.get, engines.names(aliases=False))
             if e.linter is not None and e.linter.file_for is not None}
    if config.num_layers is None:
        from eaglewire.model.target import load_target

        target = load_target(config.target, device="cpu")
        num_layers, arch = target.num_layers, config.target_arch or target.fingerprint.architecture
    else:
        num_layers, arch = config.num_layers, config.target_arch
    arch = target_arch(arch) if arch else None
    bounds = validate_boundaries(config.aux_boundaries or default_aux_boundaries(num_layers), num_layers)
    result: dict[str, object] = {"num_layers": num_layers, "aux_boundaries": bounds, "target_arch": arch,
                                 "versions": {name: e.version for name, e in ruled.items()}}

    def ids(engine: str, a: str | None) -> object:
        try:
            return engines.to_engine(bounds, num_layers, engine, target_arch=a)
        except EngineConventionError as e:
            return f"not expressible: {e}"

    for engine in (n for n in engines.names() if n != "eaglewire"):  # eaglewire's own reads the contract
        e = engines.get(engine)
        if e.needs_target_arch and arch is None:  # the rule depends on the model file: show every one
            result[engine] = {family: ids(engine, archs[0]) for family, archs in e.eagle3.families().items()}
        else:
            result[engine] = ids(engine, arch if e.per_model_file else None)
    if arch is not None:
        result["rules"] = {name: f"{e.linter.file_for(arch).path}: {e.linter.file_for(arch).function}"
                           for name, e in ruled.items()}
    print(json.dumps(result, indent=2))
    return 0


def _command(sub, name: str, config_class: type, func, help_text: str, *, progress: bool = False):
    """Subcommand ``name``: its flags and ``--config`` from ``config_class``; ``progress`` adds the
    terminal's ``--no-progress`` (not a setting of the run: never in a config file)."""
    p = sub.add_parser(name, help=help_text, description=help_text)
    add_config_args(p, config_class)
    if progress:
        p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=func, config_class=config_class)
    return p


def build_parser() -> argparse.ArgumentParser:
    from eaglewire.bench.bench_command import BenchConfig
    from eaglewire.cli_settings import ContractConfig, GenerateConfig
    from eaglewire.data.import_data import ImportDataConfig
    from eaglewire.data.prepare import PrepareConfig
    from eaglewire.data.regenerate_command import RegenerateCommandConfig
    from eaglewire.doctor import DoctorConfig
    from eaglewire.engines.command_settings import EnginesConfig, ExportCommandConfig, ImportConfig
    from eaglewire.quickstart import QuickstartConfig
    from eaglewire.serve.serve_config import ServeConfig
    from eaglewire.train.train_config import TrainConfig
    from eaglewire.tune.tune_command import TuneConfig

    parser = argparse.ArgumentParser(prog="eaglewire", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    sub = parser.add_subparsers(dest="command", required=True)
    _command(sub, "prepare", PrepareConfig, cmd_prepare, "conversations -> captured hidden-state shards", progress=True)
    _command(sub, "regenerate", RegenerateCommandConfig, cmd_regenerate, "replace assistant replies with the target's own (in this process, or through OpenAI-compatible servers) -> conversations JSONL", progress=True)
    _command(sub, "train", TrainConfig, cmd_train, "train an EAGLE-3 draft (TTT) on shards or live captures",
             progress=True)
    _command(sub, "generate", GenerateConfig, cmd_generate, "generate text with speculative decoding (stream to stdout)")
    _command(sub, "serve", ServeConfig, cmd_serve, "OpenAI-compatible HTTP server with speculative decoding")
    _command(sub, "quickstart", QuickstartConfig, cmd_quickstart,
             "the whole pipeline on the default target: data, draft, doctor, bench", progress=True)
    _command(sub, "doctor", DoctorConfig, cmd_doctor,
             "the standalone wiring test: is the draft fed what it was trained on?")
    _command(sub, "export", ExportCommandConfig, cmd_export,
             "write a draft in SGLang, vLLM/speculators or llama.cpp (GGUF) format")
    _command(sub, "engines", EnginesConfig, cmd_engines, "install or find third-party engines (llama.cpp, vLLM)",
             progress=True)
    _command(sub, "import", ImportConfig, cmd_import, "convert a SGLang, SpecForge, speculators or EAGLE draft")
    _command(sub, "import-data", ImportDataConfig, cmd_import_data,
             "hidden states captured by vLLM, speculators or SpecForge -> shards")
    _command(sub, "bench", BenchConfig, cmd_bench,
             "tokens/s, τ and acceptance of speculation configs (and HF baselines) on a prompt set", progress=True)
    _command(sub, "tune", TuneConfig, cmd_tune, "measure an engine's round costs and the draft's acceptance; rank "
             "speculation shapes by predicted tokens/s and recommend one (or plain decoding, with the reason)")
    _command(sub, "contract", ContractConfig, cmd_contract, "how SGLang, vLLM, SpecForge and EAGLE name a boundary layout")
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
    previous = signal.signal(signal.SIGTERM, _terminate)  # a kill stops the servers a command launched, too
    try:
        return args.func(args)
    except KeyboardInterrupt:
        # Every long command resumes from what it wrote; a traceback would only hide that.
        print("\ninterrupted; run the same command to resume", file=sys.stderr)
        return 130
    except Terminated:
        print("\nterminated; run the same command to resume", file=sys.stderr)
        return 143
    except Exception as e:
        from eaglewire.core.errors import user_message

        if (message := user_message(e)) is None:
            raise  # a bug: its traceback is what a report needs
        logging.getLogger("eaglewire").debug("error", exc_info=True)  # -v: the traceback too
        print(f"error: {message}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)


class Terminated(BaseException):
    """SIGTERM, raised where the command runs: its ``with`` blocks exit (a launched llama-server or vLLM is stopped,
    a lock released) instead of the process dying around them. A BaseException, so no ``except Exception`` eats it."""


def _terminate(signum, frame) -> None:
    raise Terminated


if __name__ == "__main__":
    sys.exit(main())
