"""The ``kvzap`` command line: ``kvzap demo`` (the main job), ``calibrate``, ``train``, ``evaluate``, ``harness``
and ``info``."""

from __future__ import annotations

import argparse
import inspect
import logging
import sys
import time

__all__ = ["main", "demo_context"]

NEEDLE = "The secret launch code for the kvzap demo is 7384."
# No "answer with the number only": SmolLM2-135M then opens its answer with a stray "1" and often stops there or
# drifts (with that instruction the bundled MLP failed at tau -5, -4.5, -3 and -2.5, 32-77% evicted; with the
# plain question it answers at every threshold from -5 to -2.5).
QUESTION = "What is the secret launch code for the kvzap demo?"

# Standard-library modules whose documentation makes a long, real, offline haystack (always installed).
_HAYSTACK_MODULES = (
    "argparse", "collections", "json", "logging", "pathlib", "re", "subprocess", "typing", "unittest",
    "itertools", "functools", "datetime", "csv", "textwrap", "threading",
    # Appended (longer contexts: 32k tokens for Gemma 3); the texts of shorter contexts are unchanged.
    "asyncio", "email.message", "http.client", "urllib.request", "xml.etree.ElementTree", "sqlite3", "tarfile",
    "zipfile", "shutil", "decimal", "fractions", "statistics", "random", "enum", "dataclasses", "inspect", "ast",
    "configparser", "optparse", "pickle", "string", "calendar", "heapq", "contextlib", "io", "tempfile", "difflib",
    "pprint", "copy", "operator", "types", "queue", "codecs", "locale", "gettext", "traceback", "warnings",
    "doctest", "importlib", "pkgutil", "socketserver", "multiprocessing", "concurrent.futures",
)  # fmt: skip


def demo_context(tokenizer, n_tokens: int = 4000) -> str:
    """A long real text (Python standard-library documentation) of about ``n_tokens`` tokens with a needle in
    its middle."""
    import importlib

    paragraphs: list[str] = []
    for name in _HAYSTACK_MODULES:
        module = importlib.import_module(name)
        for obj in [module, *(getattr(module, a) for a in sorted(dir(module)) if not a.startswith("_"))]:
            doc = inspect.getdoc(obj) if inspect.ismodule(obj) or inspect.isclass(obj) or callable(obj) else None
            if doc and len(doc) > 200:
                paragraphs.extend(p.strip() for p in doc.split("\n\n") if len(p.strip()) > 80)
    seen, unique = set(), []
    for p in paragraphs:  # keep the first copy of repeated docstrings
        if p not in seen:
            seen.add(p)
            unique.append(p)
    text, count = [], 0
    for p in unique:
        count += len(tokenizer.encode(p, add_special_tokens=False))
        text.append(p)
        if count >= n_tokens:
            break
    text.insert(len(text) // 2, NEEDLE)
    return "\n\n".join(text)


def _demo(args: argparse.Namespace) -> int:
    import torch
    from tqdm.auto import tqdm
    from transformers import DynamicCache, pipeline

    from kvzap import DMSThresholdPress
    from kvzap.cache import kv_bytes
    from kvzap.models import load_model

    scorer = _scorer(args)  # before the model loads: a wrong --variant is refused at once
    torch.set_grad_enabled(False)
    steps = tqdm(total=4, desc="kvzap demo", unit="step")
    steps.set_postfix_str("loading the model")
    model, tokenizer = load_model(args.model)
    if model.device.type == "cpu":
        from kvzap.paged.kernels import decode_kernel, kernel_status

        if kernel_status() == "not built":
            # Built once per machine (30-60 s) before anything is timed, so the table compares the two runs only.
            steps.set_postfix_str("building the fused decode kernel, once")
            decode_kernel()
    steps.update()
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
    context = demo_context(tokenizer, args.context_tokens)
    n_tokens = len(tokenizer.encode(context))
    press = DMSThresholdPress(scorer, threshold=args.threshold, sliding_window_size=args.window)

    results = {}
    label = "Fast KVzip" if args.model_type == "fastkvzip" else f"KVzap-{args.model_type}"
    for name, the_press in (("full cache", None), (label, press)):
        steps.set_postfix_str(f"answering with {name} ({n_tokens} context tokens)")
        cache = DynamicCache(config=model.config)
        start = time.perf_counter()
        answer = pipe(context, question=QUESTION, press=the_press, max_new_tokens=args.max_new_tokens, cache=cache)
        results[name] = (answer["answer"].strip(), time.perf_counter() - start, kv_bytes(cache))
        steps.update()
    steps.set_postfix_str("done")
    steps.update()
    steps.close()

    print(f"\nModel: {model.config._name_or_path}   context: {n_tokens} tokens   press: {press!r}")
    print(f"Surrogate: {scorer.source}")
    print(f"Question: {QUESTION}\nExpected: 7384\n")
    print(f"{'run':<16} {'correct':>8} {'time (s)':>9} {'KV memory (MB)':>15} {'vs full cache':>14}")
    for name, (answer, seconds, sizes) in results.items():
        correct = "yes" if "7384" in answer else "no"
        mb, share = sizes.physical / 2**20, sizes.physical / sizes.full
        print(f"{name:<16} {correct:>8} {seconds:>9.1f} {mb:>15.1f} {share:>14.1%}")
    print("\nAnswers:")
    for name, (answer, _, _) in results.items():
        print(f"  {name}: {' '.join(answer.split())}")
    print(f"\nCompression ratio (share of KV pairs evicted): {press.compression_ratio:.1%}")
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvzap.calibrate import calibrate, collect_scores, compression_curve
    from kvzap.models import load_model

    if args.texts:
        missing = [p for p in args.texts if not Path(p).is_file()]
        if missing:  # checked before the model is loaded
            raise FileNotFoundError(f"--texts: no such file: {', '.join(missing)}. Pass readable text files.")
    scorer = _scorer(args)
    model, tokenizer = load_model(args.model)
    if args.texts:
        texts = [Path(p).read_text(encoding="utf-8", errors="replace") for p in args.texts]
    else:  # the demo's documentation text, cut into independent samples
        words = demo_context(tokenizer, args.max_tokens * 3).split()
        size = len(words) // 3
        texts = [" ".join(words[i * size : (i + 1) * size]) for i in range(3)]
    scores = collect_scores(
        model, tokenizer, scorer, texts, max_tokens=args.max_tokens, prune_sliding_layers=args.prune_sliding_layers
    )
    print(f"Model: {model.config._name_or_path}   surrogate: {scorer.source}   window: {args.window}")
    print(f"Layers calibrated: {_calibrated_layers(model, args.prune_sliding_layers)}")
    print(f"{'target':>8} {'threshold':>10} {'reached':>8}")
    for target in args.target:
        tau = calibrate(model, tokenizer, scorer, texts, target, sliding_window_size=args.window, scores=scores)
        reached = float(compression_curve(scores, [tau], args.window)[0])
        print(f"{target:>8.2f} {tau:>10.3f} {reached:>8.3f}")
    if args.thresholds:  # the other direction: what each given threshold evicts on the same texts
        curve = compression_curve(scores, args.thresholds, args.window)
        print(f"\n{'threshold':>10} {'evicted':>8}")
        for tau, ratio in zip(args.thresholds, curve.tolist(), strict=True):
            print(f"{tau:>10.3f} {ratio:>8.3f}")
    return 0


def _calibrated_layers(model, prune_sliding_layers: bool) -> str:
    """Which layers the thresholds are for, and the press option that prunes the same ones."""
    from kvzap.layers import prunable_layers, sliding_layers

    n_layers, sliding = model.config.num_hidden_layers, sliding_layers(model)
    layers = prunable_layers(model, prune_sliding_layers)
    if not sliding:
        return f"all {n_layers} (no sliding-window layer)"
    named = f"sliding-window layer{'s' if len(sliding) > 1 else ''} {list(sliding)}"
    if prune_sliding_layers:
        return f"all {n_layers}, {named} included: use them with DMSThresholdPress(..., prune_sliding_layers=True)"
    return (
        f"{len(layers)} of {n_layers}, {named} left alone as a press does by default (--prune-sliding-layers "
        "counts them, for a press built with prune_sliding_layers=True)"
    )


def _info(args: argparse.Namespace) -> int:
    import torch
    import transformers

    import kvzap
    from kvzap.surrogates import list_bundled
    from kvzap.surrogates.bundled import BUNDLED_DIR

    print(f"kvzap {kvzap.__version__} | torch {torch.__version__} | transformers {transformers.__version__}")
    print(f"bundled surrogates: {list_bundled() or 'none'}")
    # The directories, for tools that take a surrogate directory (kvzap evaluate --surrogate-mlp DIR, ...).
    print(f"  in {BUNDLED_DIR}/<model>/<type>")
    return 0


def _scorer(args: argparse.Namespace):
    """The scorer of --model-type, --surrogate and --variant (checked here, before any model is loaded)."""
    from kvzap import FastKVzipScorer, KVzapScorer

    if args.model_type == "fastkvzip":
        if args.variant is not None:
            raise ValueError("--variant selects a bundled KVzap surrogate; Fast KVzip has none: drop --variant.")
        return FastKVzipScorer(surrogate=args.surrogate)
    return KVzapScorer(model_type=args.model_type, surrogate=args.surrogate, variant=args.variant)


def _check_local_paths(args: argparse.Namespace) -> None:
    """Refuse --model/--surrogate paths that do not exist before anything is loaded (a path is not a Hub id)."""
    from pathlib import Path

    from kvzap.surrogates.checkpoint import _looks_like_local_path

    for flag in ("model", "surrogate"):
        value = getattr(args, flag, None)
        if value and _looks_like_local_path(value) and not Path(value).expanduser().is_dir():
            raise FileNotFoundError(
                f"--{flag}: no directory {value!r}. Pass an existing local directory, or a Hub id ('owner/name')."
            )


def _int_at_least(text: str, minimum: int, expected: str) -> int:
    """``text`` as an int >= ``minimum``, or an argparse error saying what was ``expected``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
    return value


def _positive_int(text: str) -> int:
    return _int_at_least(text, 1, "a positive integer")


def _non_negative_int(text: str) -> int:
    return _int_at_least(text, 0, "an integer >= 0")


def _threshold(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number (or -inf), got {text!r}") from None
    if value != value:
        raise argparse.ArgumentTypeError("the threshold cannot be NaN; use a number, or -inf to evict nothing")
    return value


def _ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a compression ratio in [0, 1), got {text!r}") from None
    if not 0 <= value < 1:  # also refuses NaN
        raise argparse.ArgumentTypeError(f"expected a compression ratio in [0, 1), got {text}")
    return value


VARIANT_HELP = (
    "another surrogate bundled for the model instead of its default one (`kvzap info` lists them as "
    "<model-type>-<variant>), e.g. 'average' for SmolLM2-135M-Instruct's MLP"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvzap", description="KVzap: adaptive KV-cache pruning for transformers.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what kvzap does")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="answer a question about a long text with and without KVzap pruning")
    demo.add_argument("--model", default=None, help="Hub id or local dir (default: the embedded SmolLM2-135M)")
    demo.add_argument(
        "--model-type", choices=["mlp", "linear", "fastkvzip"], default="mlp", help="KVzap-MLP/-Linear or Fast KVzip"
    )
    demo.add_argument("--surrogate", default=None, help="surrogate dir or Hub id (default: bundled for the model)")
    demo.add_argument("--variant", default=None, help=VARIANT_HELP)
    demo.add_argument("--threshold", type=_threshold, default=-4.0)
    demo.add_argument("--window", type=_non_negative_int, default=128, help="sliding window size")
    demo.add_argument("--context-tokens", type=_positive_int, default=2000)
    demo.add_argument("--max-new-tokens", type=_positive_int, default=24)
    demo.set_defaults(func=_demo)

    cal = sub.add_parser("calibrate", help="thresholds reaching target compression ratios on sample texts")
    cal.add_argument("--target", type=_ratio, nargs="+", default=[0.25, 0.5, 0.75], help="compression ratios")
    cal.add_argument("--model", default=None, help="Hub id or local dir (default: the embedded SmolLM2-135M)")
    cal.add_argument(
        "--model-type", choices=["mlp", "linear", "fastkvzip"], default="mlp", help="KVzap-MLP/-Linear or Fast KVzip"
    )
    cal.add_argument("--surrogate", default=None)
    cal.add_argument("--variant", default=None, help=VARIANT_HELP)
    cal.add_argument("--window", type=_non_negative_int, default=128, help="sliding window size")
    cal.add_argument("--texts", nargs="*", help="text files (default: Python documentation text)")
    cal.add_argument("--max-tokens", type=_positive_int, default=2048, help="tokens per text")
    cal.add_argument(
        "--thresholds",
        type=float,
        nargs="+",
        default=[],
        help="also print the share each of these thresholds evicts on the same texts (README's threshold table: "
        "--max-tokens 4096 --thresholds -7 -6 -5 -4.5 -4 -3.5 -3 -2.5 -2 -1.5)",
    )
    cal.add_argument(
        "--prune-sliding-layers",
        action="store_true",
        help="also calibrate the sliding-window layers (Gemma 3 local layers, Mistral), for a press built with "
        "prune_sliding_layers=True; by default they are left out, as a press leaves them alone",
    )
    cal.set_defaults(func=_calibrate)

    info = sub.add_parser("info", help="versions and bundled surrogates")
    info.set_defaults(func=_info)

    # `kvzap train ...` and `kvzap evaluate ...` hand every following argument to the tool's own command line
    # (listed here for --help only).
    sub.add_parser("train", help="collect KVzip+ targets and fit surrogates: `kvzap train --help`")
    sub.add_parser("evaluate", help="accuracy vs compression on long-context benchmarks: `kvzap evaluate --help`")
    sub.add_parser(
        "harness", help="lm-evaluation-harness with the kvzap model and offline tasks: `kvzap harness --help`"
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["train"], ["evaluate"]):
        return _run_tool(argv[0], argv[1:])
    if argv[:1] == ["harness"]:
        return _run_harness(argv[1:])

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        _check_local_paths(args)
        return int(args.func(args) or 0)
    except (ValueError, TypeError, OSError, RuntimeError) as error:
        # kvzap's errors are sentences saying what is wrong and the fix: show them, not a traceback (-v shows it).
        if args.verbose:
            raise
        print(f"kvzap {args.command}: error: {error}", file=sys.stderr)
        return 1


_TOOLS = {"train": "train", "evaluate": "evaluation"}


def _import_tool(package: str):
    """Import ``kvzap.<package>``: the tools of ``train/`` and ``evaluation/``, installed under kvzap's name.

    When the imported ``kvzap`` is a source checkout's (its parent holds ``pyproject.toml`` and ``<package>/``),
    the tools are read from that checkout, under the same name (their modules import each other relatively),
    whatever an editable install made from another checkout would map; installed from a wheel, they are imported
    from it.
    """
    import importlib
    import importlib.util
    from pathlib import Path

    name = f"kvzap.{package}"
    if name in sys.modules:
        return sys.modules[name]
    root = Path(__file__).resolve().parent.parent
    checkout = root / package
    if not ((root / "pyproject.toml").is_file() and (checkout / "__init__.py").is_file()):
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as error:
            if error.name != name:
                raise  # a dependency of the tool is missing: say which
            raise SystemExit(
                f"This kvzap installation has no {name} package: reinstall kvzap (`pip install 'kvzap[train,eval]'`, "
                "or `pip install -e '.[train,eval]'` in a source checkout)."
            ) from error
    spec = importlib.util.spec_from_file_location(
        name, checkout / "__init__.py", submodule_search_locations=[str(checkout)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _run_tool(command: str, argv: list[str]) -> int:
    """Run ``kvzap train ...`` (the ``train/`` command line) or ``kvzap evaluate ...`` (``evaluation/``)."""
    import importlib

    package = _TOOLS[command]
    _import_tool(package)
    entry = importlib.import_module(f"kvzap.{package}.__main__")
    return int(entry.main(argv, prog=f"kvzap {command}") or 0)


def _run_harness(argv: list[str]) -> int:
    """Run ``kvzap harness ...`` (lm-eval's command line with the kvzap model registered, :mod:`kvzap.harness`)."""
    import importlib

    try:
        harness_cli = importlib.import_module("kvzap.harness.cli")
    except ModuleNotFoundError as error:
        if error.name is None or not error.name.startswith("lm_eval"):
            raise
        print(f"kvzap harness: error: {error}", file=sys.stderr)
        return 2
    return int(harness_cli.main(argv, prog="kvzap harness") or 0)


if __name__ == "__main__":
    sys.exit(main())
