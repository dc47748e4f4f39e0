"""The reference implementation measured like ``bench_decode.py``: kvpress 0.5.5 ``DMSPress(KVzapPress)``.

Runs in its own virtual environment (kvpress 0.5.5 needs transformers < 5.3), with the same model, prompt,
threshold, window and surrogate weights as the kvzap benchmark (kvpress's Hub download is bypassed by loading
kvzap's surrogate weights into kvpress's own surrogate module). Modes: ``none`` and ``kvpress``.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import load, meta, prefill_and_decode, sweep, write_results
from benchmarks.outside import model_storage_keys, reachable_bytes

MODES = ("none", "kvpress")


def make_press(args, model):
    import kvpress
    from kvpress.presses.kvzap_press import KVzapConfig, KVzapModel

    from kvzap.surrogates import KVzapSurrogate, bundled_surrogate_dir

    path = args.surrogate or bundled_surrogate_dir(model.config._name_or_path, "mlp")
    ours = KVzapSurrogate.from_pretrained(path)
    theirs = KVzapModel(KVzapConfig(**{k: v for k, v in ours.config.items() if k != "model_type"}))
    theirs.load_state_dict(ours.state_dict())
    scorer = kvpress.KVzapPress(model_type="mlp")
    scorer.kvzap_model = theirs.eval()
    scorer.post_init_from_model = lambda model: None  # weights set above: nothing is downloaded
    return kvpress.DMSPress(scorer, threshold=args.threshold, sliding_window_size=args.window, decoding=args.decoding)


def one_run(model, mode, prompt, args):
    press = make_press(args, model) if mode == "kvpress" else None
    # kvpress keeps every pair (evicted keys are overwritten with fake keys): measured from outside like kvzap.
    weights = model_storage_keys(model)
    out, _ = prefill_and_decode(
        model,
        prompt,
        args.decode,
        press(model) if press else None,
        kv_bytes=lambda c: reachable_bytes(c, weights).total,
    )
    out["evicted_share"] = float(press.compression_ratio) if press else 0.0
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="local model directory")
    parser.add_argument("--surrogate", default=None)
    parser.add_argument("--prefill", type=int, nargs="+", default=[2048])
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threshold", type=float, default=-4.0)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--no-decoding", dest="decoding", action="store_false")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--peak-memory", choices=MODES, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    import kvpress  # noqa: F401  (patches attention functions: only in this process)

    model, tokenizer = load(args.model)
    setup = meta(
        tool="kvpress 0.5.5",
        model=args.model,
        dtype="float32",
        decode_tokens=args.decode,
        runs=args.runs,
        threshold=args.threshold,
        window=args.window,
        decoding_pruning=args.decoding,
    )
    results = sweep(model, tokenizer, args, MODES, one_run)
    write_results(args.json, setup, results)


if __name__ == "__main__":
    main()
